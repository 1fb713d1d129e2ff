"""Real processes save one checkpoint together and restore it into other process counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from mp_worker import expected_rows, rank_keys
from saver_helpers import make_variable

import de_store as ds
from de_store.errors import BarrierTimeoutError
from de_store.testing import StorageLocation

WORKER = str(Path(__file__).with_name("mp_worker.py"))
KEYS_PER_RANK = 3000


def run_ranks(args_per_rank: list[list[str]], timeout: float = 240) -> None:
    procs = [
        subprocess.Popen([sys.executable, WORKER, *args], stderr=subprocess.PIPE, text=True)
        for args in args_per_rank
    ]
    errors = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            errors.append(f"rank {rank} exited {proc.returncode}: {err[-2000:]}")
    assert not errors, "\n".join(errors)


def restore_in_processes(url: str, size: int, options: dict, tmp_path: Path) -> list[np.ndarray]:
    outs = [str(tmp_path / f"restored-{size}-{r}.npz") for r in range(size)]
    run_ranks(
        [
            ["restore", url, str(size), str(r), "2", json.dumps(options), outs[r]]
            for r in range(size)
        ]
    )
    keys = []
    for rank, out in enumerate(outs):
        data = np.load(out)
        assert np.all(np.mod(data["keys"], size) == rank)
        np.testing.assert_array_equal(data["values"], expected_rows(data["keys"]))
        keys.append(data["keys"])
    return keys


def all_saved_keys(size: int) -> np.ndarray:
    return np.sort(np.concatenate([rank_keys(size, r, KEYS_PER_RANK) for r in range(size)]))


def check_every_key_once(parts: list[np.ndarray], saved_by: int) -> None:
    union = np.concatenate(parts)
    assert len(union) == len(np.unique(union))
    np.testing.assert_array_equal(np.sort(union), all_saved_keys(saved_by))


@pytest.mark.parametrize(("saved_by", "restored_by"), [(2, 3), (4, 2)])
def test_processes_save_together_and_reshard(
    local_location: StorageLocation, tmp_path: Path, saved_by: int, restored_by: int
) -> None:
    url = f"{local_location.url}/step-7"
    run_ranks(
        [
            ["save", url, str(saved_by), str(r), str(KEYS_PER_RANK), "2", "{}"]
            for r in range(saved_by)
        ]
    )
    manifest = ds.restore([make_variable("emb", None, shards=4)], url)
    assert manifest.proc_size == saved_by
    assert manifest.variables["emb"].shard_count == saved_by * 2
    check_every_key_once(restore_in_processes(url, restored_by, {}, tmp_path), saved_by)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_processes_save_to_object_stores(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{backend}_location")
    url, options = f"{location.url}/step-1", location.storage_options
    run_ranks(
        [["save", url, "2", str(r), str(KEYS_PER_RANK), "2", json.dumps(options)] for r in range(2)]
    )
    target = make_variable("emb", None, shards=4)
    ds.restore([target], url, storage_options=options)
    keys, values = (t.numpy() for t in target.export())
    check_every_key_once([keys], 2)
    np.testing.assert_array_equal(values, expected_rows(keys))


def test_tf_checkpoint_from_several_processes(
    local_location: StorageLocation, tmp_path: Path
) -> None:
    save_path = f"{local_location.url}/kv"
    run_ranks(
        [
            [
                "tfsave",
                str(tmp_path / f"rank{r}" / "ckpt"),
                save_path,
                "2",
                str(r),
                str(KEYS_PER_RANK),
                "{}",
            ]
            for r in range(2)
        ]
    )
    target = make_variable("emb", ds.FileSystemSaver(save_path=save_path), shards=3)
    tf.train.Checkpoint(emb=target).read(str(tmp_path / "rank0" / "ckpt"))
    keys, values = (t.numpy() for t in target.export())
    check_every_key_once([keys], 2)
    np.testing.assert_array_equal(values, expected_rows(keys))


def test_missing_rank_times_out_naming_it_and_nothing_is_committed(tmp_path: Path) -> None:
    var = make_variable("emb", None)
    var.upsert(np.arange(10, dtype=np.int64), np.zeros([10, 4], np.float32))
    url = str(tmp_path / "step-1")
    with pytest.raises(BarrierTimeoutError, match=r"rank\(s\) \[1, 2\] of 3 did not arrive"):
        ds.save([var], url, proc_size=3, proc_rank=0, barrier_timeout_s=1.0, blocking=True)
    assert not (tmp_path / "step-1").exists()
    assert (tmp_path / "step-1.pending" / "ABORT").exists()
    with pytest.raises(ds.errors.CheckpointNotFoundError):
        ds.restore([var], url)
