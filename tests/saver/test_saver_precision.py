"""Saves compressed or with values at a lower precision, and their restores."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import companion_content, content, fill, make_variable

import de_store as ds
from de_store.checkpoint.manifest import manifest_from_json
from de_store.compaction import compact
from de_store.errors import CheckpointError
from de_store.formats.precision import SCALE_COLUMN, error_bound
from de_store.saver import device_restore

COMPRESSED = [("parquet", "zstd"), ("parquet", "lz4"), ("arrow", "zstd"), ("arrow", "lz4")]


def manifest_of(url: str) -> dict[str, Any]:
    (path,) = Path(url).glob("manifest-*.json")
    return dict(json.loads(path.read_bytes()))


def restored(url: str, dim: int = 4, shards: int = 2) -> ds.Variable:
    """A fresh variable of ``shards`` table shards restored from ``url``."""
    var = make_variable("emb", None, dim=dim, shards=shards)
    ds.restore([var], url)
    return var


def rows_in_key_order(var: ds.Variable, keys: np.ndarray) -> np.ndarray:
    got = content(var)
    return np.array([got[k] for k in keys.tolist()], np.float32)


@pytest.mark.parametrize(("format", "compression"), COMPRESSED)
def test_compressed_save_restores_exactly(tmp_path: Path, format: str, compression: str) -> None:
    var = make_variable("emb", None, shards=2)
    fill(var, 300)
    url = str(tmp_path / "ckpt")
    ds.save([var], url, blocking=True, format=format, compression=compression)

    back = restored(url, shards=3)
    assert content(back) == content(var)
    assert companion_content(back, "adam_m") == companion_content(var, "adam_m")
    entry = manifest_of(url)["variables"]["emb"]
    assert (entry["compression"], "value_precision" in entry) == (compression, False)
    assert manifest_of(url)["format_version"] == 4


@pytest.mark.parametrize("format", ["parquet", "arrow", "binary"])
@pytest.mark.parametrize(
    ("precision", "dtype"), [("bfloat16", tf.bfloat16), ("float16", tf.float16)]
)
def test_16_bit_values_equal_tf_cast(
    tmp_path: Path, format: str, precision: str, dtype: tf.DType
) -> None:
    var = make_variable("emb", None)
    keys, values = fill(var, 200)
    values[0, :2] = [np.inf, -np.inf]  # kept as they are
    var.upsert(keys[:1], values[:1])
    url = str(tmp_path / "ckpt")
    ds.save([var], url, blocking=True, format=format, value_precision=precision)

    back = restored(url)
    expected = tf.cast(tf.cast(values, dtype), tf.float32).numpy()
    np.testing.assert_array_equal(rows_in_key_order(back, keys), expected)
    assert companion_content(back, "adam_m") == companion_content(var, "adam_m")  # exact
    entry = manifest_of(url)["variables"]["emb"]
    assert entry["value_precision"] == precision
    assert entry["stored_columns"] == {"value": {"dim": 4, "dtype": f"packed_{precision}"}}
    assert [s["value_precision"] for s in entry["shards"]] == [precision]


@pytest.mark.parametrize("format", ["parquet", "binary"])
def test_int8_within_its_bound_and_exact_where_representable(tmp_path: Path, format: str) -> None:
    var = make_variable("emb", None, dim=16, shards=2)
    keys, values = fill(var, 500)
    values[1] = 0.0  # a row of zeros: scale 0
    values[2] = np.arange(-8, 8) * np.float32(2.0**-5)  # codes times a float16 scale
    values[2, 0] = 127 * 2.0**-5
    values[3] = 1e-9 * np.arange(16)  # past float16's normal range: a subnormal scale
    var.upsert(keys[:4], values[:4])
    url = str(tmp_path / "ckpt")
    compression = "zstd" if format == "parquet" else "none"
    ds.save([var], url, blocking=True, format=format, value_precision="int8",
            compression=compression)  # fmt: skip

    got = rows_in_key_order(restored(url, dim=16), keys)
    scale = (np.abs(values).max(axis=1) / np.float32(127)).astype(np.float16)
    scale = np.where(scale.astype(np.float32) < np.abs(values).max(axis=1) / 127,
                     np.nextafter(scale, np.float16(np.inf)), scale)  # fmt: skip
    assert (np.abs(got - values) <= error_bound(scale)[:, None]).all()
    np.testing.assert_array_equal(got[1:3], values[1:3])
    assert 0 < np.abs(got[3:] - values[3:]).max() < 0.02
    entry = manifest_of(url)["variables"]["emb"]
    assert entry["stored_columns"] == {
        "value": {"dim": 16, "dtype": "packed_int8"},
        SCALE_COLUMN: {"dim": 1, "dtype": "float16"},
    }
    assert entry["columns"]["value"] == {"dim": 16, "dtype": "float32"}


def test_incremental_chain_and_compaction_keep_the_precision(tmp_path: Path) -> None:
    saver = ds.FileSystemSaver(value_precision="bfloat16", compression="zstd", incremental=True)
    var = make_variable("emb", saver)
    keys, values = fill(var, 100)
    root = tmp_path / "run"
    ds.save([var], str(root / "1"), saver=saver, blocking=True)
    var.upsert(keys[:5], values[:5] + 1)
    var.remove(tf.constant(keys[5:8]))
    ds.save([var], str(root / "2"), saver=saver, blocking=True)
    delta = manifest_of(str(root / "2"))["variables"]["emb"]
    assert (delta["incremental"], delta["value_precision"]) == (True, "bfloat16")
    assert [r.get("value_precision") for r in delta["removed"]] == [None]  # tombstones exact

    expected = tf.cast(tf.cast(rows_in_key_order(var, keys[8:]), tf.bfloat16), tf.float32)
    np.testing.assert_array_equal(rows_in_key_order(restored(str(root / "2")), keys[8:]), expected)
    compact(str(root / "2"), str(tmp_path / "flat"))
    flat = manifest_of(str(tmp_path / "flat"))["variables"]["emb"]
    assert (flat["value_precision"], flat["compression"]) == ("bfloat16", "zstd")
    np.testing.assert_array_equal(rows_in_key_order(restored(str(tmp_path / "flat")), keys[8:]),
                                  expected)  # fmt: skip


def test_manifest_without_the_fields_reads_as_float32_uncompressed(tmp_path: Path) -> None:
    var = make_variable("emb", None)
    fill(var, 50)
    url = str(tmp_path / "ckpt")
    ds.save([var], url, blocking=True)
    data = manifest_of(url)
    entry = data["variables"]["emb"]
    assert data["format_version"] == 1
    assert not {"compression", "compression_level", "value_precision", "stored_columns"} & set(
        entry
    )
    assert "value_precision" not in entry["shards"][0]
    assert content(restored(url)) == content(var)


def test_unknown_precision_in_a_manifest_is_refused(tmp_path: Path) -> None:
    var = make_variable("emb", None)
    fill(var, 20)
    url = str(tmp_path / "ckpt")
    ds.save([var], url, blocking=True, value_precision="int8")
    (path,) = Path(url).glob("manifest-*.json")
    data = path.read_bytes()
    assert manifest_from_json(data, "m.json").variables["emb"].value_precision == "int8"
    with pytest.raises(CheckpointError) as err:
        manifest_from_json(data.replace(b'"int8"', b'"int4"'), "m.json")
    assert str(err.value) == (
        "m.json: variable 'emb' is stored at value_precision 'int4', which this de_store "
        "does not read (it reads ['bfloat16', 'float16', 'int8']); upgrade de_store"
    )


def test_options_that_make_no_sense_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        ds.FileSystemSaver(format="binary", compression="zstd")
    assert str(err.value) == "shard format 'binary' has no compression 'zstd': it offers ['none']"
    with pytest.raises(ValueError) as err:
        ds.FileSystemSaver(value_precision="int4")
    assert str(err.value) == (
        "value_precision must be one of ['float32', 'bfloat16', 'float16', 'int8'], got 'int4'"
    )
    counts = make_variable("counts", None, value_dtype=tf.int64)
    counts.upsert(tf.constant([1], tf.int64), tf.constant([[1, 2, 3, 4]], tf.int64))
    with pytest.raises(ValueError) as err:
        ds.save([counts], str(tmp_path / "a"), blocking=True, value_precision="int8")
    assert str(err.value) == (
        "value_precision='int8' cannot store variable 'counts': its values are int64, "
        "value_precision applies to float32 values only"
    )


@pytest.mark.parametrize(
    ("precision", "row", "message"),
    [
        ("int8", [np.nan, 0, 0, 0], "holds an infinity or NaN, which int8 cannot store; use "
         "value_precision='bfloat16' or 'float16'"),
        ("int8", [1e9, 0, 0, 0], "holds 1000000000.0: an int8 row's scale (max|x| / 127) must "
         "fit float16, so max|x| <= 8.31901e+06; use value_precision='bfloat16'"),
        ("float16", [0, 70000, 0, 0], "holds 70000.0, past float16's largest value 65504; use "
         "value_precision='bfloat16'"),
    ],
)  # fmt: skip
def test_values_a_precision_cannot_hold_are_refused(
    tmp_path: Path, precision: str, row: list[float], message: str
) -> None:
    var = make_variable("emb", None)
    var.upsert(tf.constant([7, 8], tf.int64), tf.constant([[1.0] * 4, row], tf.float32))
    with pytest.raises(ValueError) as err:
        ds.save([var], str(tmp_path / "ckpt"), blocking=True, value_precision=precision)
    assert str(err.value) == f"variable 'emb': the row of key 8 {message}"
    assert not (tmp_path / "ckpt" / "manifest-000001.json").exists()


def test_a_restore_into_ps_tasks_reads_other_precisions_through_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(device_restore, "_is_remote", lambda device: True)  # as PS tasks'
    var = make_variable("emb", None, shards=2)
    keys, values = fill(var, 1000)
    url = str(tmp_path / "ckpt-1")
    ds.save([var], url, blocking=True, format="binary", bucketed=True, value_precision="float16")
    with caplog.at_level(logging.INFO, logger="de_store"):
        back = restored(url)
    expected = values.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(rows_in_key_order(back, keys), expected)
    assert f"{url} stores values at float16; the tasks read them at the variable's dtype " in (
        caplog.text
    )
