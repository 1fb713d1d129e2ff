"""Bad inputs at the public API: a clear error naming the thing, nothing written or lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from faults_helpers import content

import de_store as ds
from de_store.checkpoint.retry import NO_RETRY
from de_store.errors import BackendError, CheckpointError, DeStoreError
from de_store.testing import StorageLocation

RESULTS: list[dict[str, Any]] = []


@pytest.fixture
def saved(local_location: StorageLocation) -> tuple[str, dict[Any, Any]]:
    var = ds.Variable("emb", key_dtype=tf.int64, dim=4)
    var.upsert(np.arange(50, dtype=np.int64), np.ones([50, 4], np.float32))
    url = f"{local_location.url}/ckpt-1"
    ds.save([var], url, blocking=True)
    return url, content(var)


def fresh(**kwargs: Any) -> ds.Variable:
    var = ds.Variable("emb", **{"key_dtype": tf.int64, "dim": 4, **kwargs})
    var.upsert(np.array([999], np.int64), np.full([1, var.dim], 3, var.value_dtype.as_numpy_dtype))
    return var


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 8}, r"variable 'emb'.*\(key_dtype, value_dtype, dim\)"),
        ({"value_dtype": tf.float64}, r"variable 'emb'.*float32.*float64"),
        ({"key_dtype": tf.int32}, r"variable 'emb'.*int64.*int32"),
    ],
)
def test_restore_into_an_incompatible_variable(
    saved: tuple[str, dict[Any, Any]], kwargs: dict[str, Any], message: str
) -> None:
    url, saved_content = saved
    var = fresh(**kwargs)
    before = content(var)
    with pytest.raises(CheckpointError, match=message):
        ds.restore([var], url)
    assert content(var) == before
    restored = fresh()
    ds.restore([restored], url)
    assert content(restored) == saved_content  # the checkpoint is intact
    RESULTS.append({"case": f"restore with {kwargs}", "lost": 0, "wrong": 0})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"format": "csv"}, r"format 'csv' is not one of"),
        ({"buffer_size": -1}, r"buffer_size must be an int >= 1 or None, got -1"),
        ({"proc_size": 2, "proc_rank": 2}, r"proc_rank must be an int in \[0, proc_size=2\)"),
        ({"barrier_timeout_s": 0}, r"barrier_timeout_s must be > 0"),
        ({"job_id": ""}, r"job_id must be a non-empty string"),
    ],
)
def test_bad_saver_options_fail_before_writing(
    saved: tuple[str, dict[Any, Any]], options: dict[str, Any], message: str
) -> None:
    url, _ = saved
    parent = Path(url).parent
    before = sorted(p.relative_to(parent) for p in parent.rglob("*"))
    with pytest.raises(ValueError, match=message):
        ds.save([fresh()], url, blocking=True, **options)
    assert sorted(p.relative_to(parent) for p in parent.rglob("*")) == before
    RESULTS.append({"case": f"save with {options}", "lost": 0, "wrong": 0})


def test_unwritable_path() -> None:
    # sysfs refuses new files even to root, so this runs as any user
    with pytest.raises(BackendError, match=r"kernel/de_store_test/ckpt-1"):
        ds.save([fresh()], "/sys/kernel/de_store_test/ckpt-1", blocking=True)


def test_path_under_a_file_is_unwritable(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(DeStoreError, match=r"a-file/ckpt-1"):
        ds.save([fresh()], str(tmp_path / "a-file" / "ckpt-1"), blocking=True)
    assert (tmp_path / "a-file").read_text() == "x"
    RESULTS.append({"case": "unwritable path", "lost": 0, "wrong": 0})


@pytest.mark.parametrize(
    "bad",
    [
        {"key": "secret", "value": "wrong"},  # moto checks no signatures...
        {"key": "endpoint_url", "value": "http://127.0.0.1:9"},  # ...so: a wrong endpoint
        {"key": "bucket", "value": "no-such-bucket"},
    ],
)
def test_bad_credentials_or_endpoint(s3_location: StorageLocation, bad: dict[str, str]) -> None:
    options = dict(s3_location.storage_options)
    url = f"{s3_location.url}/ckpt-1"
    ds.save([fresh()], url, storage_options=options, blocking=True)
    if bad["key"] == "bucket":
        target = url.replace("de-store-test", bad["value"])
    else:
        options[bad["key"]] = bad["value"]
        options.setdefault("config_kwargs", {"connect_timeout": 1, "retries": {"max_attempts": 1}})
        target = url.replace("ckpt-1", "ckpt-2")
    saver = ds.FileSystemSaver(storage_options=options, retry=NO_RETRY)
    try:
        ds.save([fresh()], target, saver=saver, blocking=True)
    except DeStoreError as err:
        assert "ckpt-" in str(err)
        outcome = "refused"
    else:
        outcome = "accepted"  # moto does not check secret keys: the save goes through
    restored = fresh()
    ds.restore([restored], url, storage_options=s3_location.storage_options)
    assert content(restored) == {999: (3.0,) * 4}  # the good checkpoint is intact
    RESULTS.append({"case": f"bad {bad['key']}: {outcome}", "lost": 0, "wrong": 0})
    if bad["key"] != "secret":
        assert outcome == "refused"
