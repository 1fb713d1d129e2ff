"""de_store.save / restore on every backend, and resharding that reads only what it needs."""

from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import companion_content, content, fill, make_variable

import de_store as ds
from de_store.backends import open_location
from de_store.checkpoint.topology import Topology
from de_store.saver import core, restore_flow
from de_store.testing import StorageLocation


def test_save_and_restore_on_every_backend(storage_location: StorageLocation) -> None:
    url = f"{storage_location.url}/run/step-1"
    options = storage_location.storage_options
    var = make_variable("user/emb", None, shards=2)
    fill(var, 3000)
    handle = ds.save([var], url, storage_options=options)
    assert handle.result(timeout=120) == url
    restored = make_variable("user/emb", None, shards=3)
    manifest = ds.restore([restored], url, storage_options=options)
    assert content(restored) == content(var)
    assert companion_content(restored, "adam_m") == companion_content(var, "adam_m")
    entry = manifest.variables["user/emb"]
    assert (entry.rows, entry.shard_count, entry.dim) == (3000, 2, 4)


def test_tf_checkpoint_with_remote_save_path(storage_location: StorageLocation, tmp_path) -> None:
    saver = ds.FileSystemSaver(
        save_path=f"{storage_location.url}/kv", storage_options=storage_location.storage_options
    )
    var = make_variable("emb", saver)
    fill(var, 500)
    expected = content(var)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=var), tmp_path, max_to_keep=3)
    manager.save()
    var.clear()
    tf.train.Checkpoint(emb=var).restore(manager.latest_checkpoint)
    assert content(var) == expected
    backend = storage_location.open()
    assert any(p.startswith("kv/ckpt-1/COMMIT-") for p in backend.list("kv"))


def test_string_keys_round_trip(tmp_path) -> None:
    var = make_variable("words", None, key_dtype=tf.string, dim=2)
    words = np.array([f"w{i}".encode() for i in range(1000)] + ["ünï".encode()], dtype=object)
    values = np.arange(len(words) * 2, dtype=np.float32).reshape(-1, 2)
    var.upsert(words, values)
    ds.save([var], str(tmp_path / "ck"), blocking=True)
    restored = make_variable("words", None, key_dtype=tf.string, dim=2, shards=2)
    ds.restore([restored], str(tmp_path / "ck"))
    assert content(restored) == content(var)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float64, tf.int32, tf.int64])
def test_value_dtypes_round_trip_exactly(tmp_path, dtype: tf.DType) -> None:
    var = make_variable("emb", None, value_dtype=dtype, dim=3)
    keys = np.arange(500, dtype=np.int64)
    var.upsert(keys, tf.cast(tf.reshape(tf.range(1500) - 700, [500, 3]), dtype))
    ds.save([var], str(tmp_path / "ck"), blocking=True, format="arrow")
    restored = make_variable("emb", None, value_dtype=dtype, dim=3, shards=2)
    ds.restore([restored], str(tmp_path / "ck"))
    assert content(restored) == content(var)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_rank_reads_only_its_share(tmp_path, ranks: int) -> None:
    var = make_variable("emb", None, dim=8, shards=2)
    keys, _ = fill(var, 400_000, start=-200_000)  # 12 key buckets a shard
    url = str(tmp_path / "ck")
    ds.save([var], url, blocking=True, bucketed=True)
    seen: list[np.ndarray] = []
    for rank in range(ranks):
        backend, name = open_location(url, None)
        target = make_variable("emb", None, dim=8)
        backend.stats.reset()
        manifest = restore_flow.restore_checkpoint(
            [target], backend, name, Topology(ranks, rank), core.IOOptions()
        )
        data_read = backend.stats.bytes_read
        total = manifest.bytes
        assert data_read <= total * (1 / ranks + 0.10), (rank, data_read, total)
        got, _ = target.export()
        got = got.numpy()
        assert np.all(np.mod(got, ranks) == rank)
        seen.append(got)
    union = np.concatenate(seen)
    assert len(union) == len(keys)
    np.testing.assert_array_equal(np.sort(union), np.sort(keys))


def test_restore_of_unknown_variable_names_what_is_there(tmp_path) -> None:
    var = make_variable("emb", None)
    fill(var, 10)
    ds.save([var], str(tmp_path / "ck"), blocking=True)
    with pytest.raises(ds.errors.CheckpointError, match="has no variable 'other'; it holds: emb"):
        ds.restore([make_variable("other", None)], str(tmp_path / "ck"))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_on_a_terminal_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    var = make_variable("emb", None)
    fill(var, 3000)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    ds.save([var], str(tmp_path / "ck"), blocking=True, progress=True)
    ds.restore([var], str(tmp_path / "ck"), progress=True)
    drawn = terminal.getvalue()
    saved = drawn[: drawn.index("restore")]
    assert "100%" in saved and "3,000/3,000 rows" in saved  # done, amount
    assert re.search(r"[\d,]+ rows/s ETA 0:00:00", saved)  # rate and time left
    assert "3,000/3,000 rows" in drawn[drawn.index("restore") :]
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    ds.save([var], str(tmp_path / "ck2"), blocking=True)  # progress is off by default
    ds.restore([var], str(tmp_path / "ck2"))
    assert quiet.getvalue() == ""
