"""FileSystemSaver through TensorFlow's own checkpoint API: users change no code."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import (
    companion_content,
    content,
    failing_async_checkpoint,
    fill,
    make_variable,
)

import de_store as ds
from de_store.backends import open_backend
from de_store.catalog import list_checkpoints
from de_store.checkpoint import gc
from de_store.errors import CheckpointError, CheckpointNotFoundError, ChecksumError


def kv_folders(directory: Path) -> list[str]:
    root = directory / "de_store"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_write_and_restore_round_trip_exactly(tmp_path: Path) -> None:
    saver = ds.FileSystemSaver()
    var = make_variable("emb", saver, shards=2)
    fill(var, 5000)
    expected, expected_m = content(var), companion_content(var, "adam_m")
    step = tf.Variable(42, dtype=tf.int64)
    prefix = tf.train.Checkpoint(emb=var, step=step).write(str(tmp_path / "ckpt"))

    restored = make_variable("emb", ds.FileSystemSaver(), shards=3)
    restored_step = tf.Variable(0, dtype=tf.int64)
    tf.train.Checkpoint(emb=restored, step=restored_step).read(prefix).assert_consumed()
    assert content(restored) == expected
    assert companion_content(restored, "adam_m") == expected_m
    assert restored_step.numpy() == 42


def test_tables_are_not_in_tf_bundle(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 20000)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(prefix)]
    assert "emb/de_store_kv_url" in names
    bundle_bytes = sum(f.stat().st_size for f in tmp_path.glob("ckpt.*"))
    assert bundle_bytes < 10_000  # 20000 x 4 float32 = 320 kB live in de_store/ckpt
    assert kv_folders(tmp_path) == ["ckpt"]


def test_each_save_has_its_own_kv_folder_and_old_ones_stay_valid(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    keys, values = fill(var, 100)
    ckpt = tf.train.Checkpoint(emb=var)
    first = ckpt.save(str(tmp_path / "ckpt"))
    var.upsert(keys, values + 1)
    second = ckpt.save(str(tmp_path / "ckpt"))
    assert kv_folders(tmp_path) == ["ckpt-1", "ckpt-2"]
    ckpt.restore(first)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), values)
    ckpt.restore(second)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), values + 1)


def test_rewriting_the_same_prefix_replaces_it(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    keys, values = fill(var, 100)
    ckpt = tf.train.Checkpoint(emb=var)
    ckpt.write(str(tmp_path / "latest"))
    var.upsert(keys, values * 3)
    prefix = ckpt.write(str(tmp_path / "latest"))
    var.clear()
    ckpt.read(prefix)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), values * 3)
    assert sorted(os.listdir(tmp_path / "de_store")) == ["latest"]


def test_checkpoint_manager_removes_kv_data_of_deleted_checkpoints(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 100)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=var), tmp_path, max_to_keep=2)
    for _ in range(5):
        manager.save()
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-4", "ckpt-5"]
    # TF deletes ckpt-3 after the 5th save's KV commit: its KV data goes with the next save
    # or with gc; every older one is gone already.
    assert kv_folders(tmp_path) == ["ckpt-3", "ckpt-4", "ckpt-5"]
    listing = {s.path: s.status for s in list_checkpoints(str(tmp_path / "de_store"))}
    assert listing == {"ckpt-3": "orphaned", "ckpt-4": "committed", "ckpt-5": "committed"}
    removed = gc.collect(open_backend(str(tmp_path / "de_store")), grace_s=0)
    assert [g.folder for g in removed] == ["ckpt-3"]
    assert kv_folders(tmp_path) == ["ckpt-4", "ckpt-5"]


def test_async_save_snapshots_at_save_time_and_calls_back_after_commit(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver(), shards=2)
    keys, values = fill(var, 3000)
    seen: list[dict[int, tuple[float, ...]]] = []

    def restore_in_callback(path: str) -> None:
        probe = make_variable("emb", ds.FileSystemSaver(), shards=1)
        tf.train.Checkpoint(emb=probe).read(path)
        seen.append(content(probe))

    options = tf.train.CheckpointOptions(
        enable_async=True, experimental_write_callbacks=[restore_in_callback]
    )
    ckpt = tf.train.Checkpoint(emb=var)
    snapshot = content(var)
    ckpt.save(str(tmp_path / "ckpt"), options=options)
    var.upsert(keys, values + 10)  # training goes on while the save runs
    after = content(var)
    ckpt.save(str(tmp_path / "ckpt"), options=options)
    var.remove(keys[:10])
    ckpt.sync()
    assert seen == [snapshot, after]


def test_async_save_failure_is_raised_on_next_save(tmp_path: Path) -> None:
    ckpt = failing_async_checkpoint(tmp_path)
    options = tf.train.CheckpointOptions(enable_async=True)
    with pytest.raises(Exception, match="not-a-folder"):  # no sync() in between
        ckpt.save(str(tmp_path / "ckpt"), options=options)


def test_restore_into_other_dim_names_variable_and_leaves_table_unchanged(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver(), dim=4)
    fill(var, 50)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    other = make_variable("emb", ds.FileSystemSaver(), dim=8)
    fill(other, 5, seed=1)
    before = content(other)
    with pytest.raises(
        CheckpointError,
        match=r"variable 'emb'.*= \('int64', 'float32', 4\), "
        r"the variable expects \('int64', 'float32', 8\)",
    ):
        tf.train.Checkpoint(emb=other).read(prefix)
    assert content(other) == before


def test_corrupted_shard_is_detected_and_table_unchanged(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 2000)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    (shard,) = (tmp_path / "de_store" / "ckpt" / "emb").iterdir()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    target = make_variable("emb", ds.FileSystemSaver())
    fill(target, 3, seed=2)
    before = content(target)
    with pytest.raises(ChecksumError, match=shard.name):
        tf.train.Checkpoint(emb=target).read(prefix)
    assert content(target) == before


def test_missing_shard_is_named(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 200)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    (shard,) = (tmp_path / "de_store" / "ckpt" / "emb").iterdir()
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        tf.train.Checkpoint(emb=make_variable("emb", ds.FileSystemSaver())).read(prefix)


def test_uncommitted_checkpoint_is_never_restored(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 20)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    for marker in (tmp_path / "de_store" / "ckpt").glob("COMMIT-*"):
        marker.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at .*ckpt"):
        tf.train.Checkpoint(emb=make_variable("emb", ds.FileSystemSaver())).read(prefix)


def test_explicit_save_path_and_formats(tmp_path: Path) -> None:
    for fmt in ("parquet", "arrow"):
        saver = ds.FileSystemSaver(save_path=str(tmp_path / f"kv-{fmt}"), format=fmt)
        var = make_variable("emb", saver)
        fill(var, 300)
        expected = content(var)
        prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / f"ck-{fmt}" / "ckpt"))
        shard_files = list((tmp_path / f"kv-{fmt}" / "ckpt" / "emb").iterdir())
        assert [f.suffix for f in shard_files] == [f".{fmt}"]
        var.clear()
        tf.train.Checkpoint(emb=var).read(prefix)
        assert content(var) == expected


def test_saver_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1 or None, got -5"):
        ds.FileSystemSaver(buffer_size=-5)
    with pytest.raises(ValueError, match="format 'csv' is not one of"):
        ds.FileSystemSaver(format="csv")
    with pytest.raises(ValueError, match="proc_rank=3"):
        ds.FileSystemSaver(proc_size=2, proc_rank=3)


class _Served(tf.Module):
    def __init__(self, var: ds.Variable) -> None:
        super().__init__()
        self.emb = var

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def serve(self, ids: tf.Tensor) -> tf.Tensor:
        return self.emb.lookup(ids)


def test_saved_model_serves_and_carries_kv_data(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver(), shards=2)
    keys, values = fill(var, 300)
    tf.saved_model.save(_Served(var), str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    np.testing.assert_array_equal(loaded.serve(tf.constant(keys)).numpy(), values)
    kv_url = str(tmp_path / "model" / "variables" / "de_store" / "variables")
    restored = make_variable("emb", None, shards=3)
    ds.restore([restored], kv_url)
    assert content(restored) == content(var)


def test_checkpoint_with_saver_restores_into_variable_without_one(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 100)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    plain = make_variable("emb", None, shards=2)
    tf.train.Checkpoint(emb=plain).read(prefix)
    assert content(plain) == content(var)


def test_restored_optimizer_slots_keep_the_optimizers_initial_value(tmp_path: Path) -> None:
    var = make_variable("emb", ds.FileSystemSaver(), dim=2)
    var.upsert(np.arange(4, dtype=np.int64), np.ones([4, 2], np.float32))
    var.companion("adagrad_accumulator", 2, tf.float32, initializer=0.1).upsert(
        np.arange(4, dtype=np.int64), np.full([4, 2], 5.0, np.float32)
    )
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    restored = make_variable("emb", ds.FileSystemSaver(), dim=2)
    tf.train.Checkpoint(emb=restored).read(prefix)
    # the optimizer asks for its slot after the restore created it
    slot = restored.companion("adagrad_accumulator", 2, tf.float32, initializer=0.1)
    np.testing.assert_allclose(
        slot.lookup(np.array([0, 99], np.int64)).numpy(), [[5, 5], [0.1, 0.1]]
    )


def test_restored_rows_repeating_a_key_are_refused() -> None:
    """A checkpoint holds each key once, so a restore bulk-loads its rows; rows that repeat
    a key raise (the restore names the files, see tests/faults/test_faults_manifest.py)."""
    from de_store.errors import RepeatedKeysError
    from de_store.saver.rows import ShardRows, apply_rows

    variable = make_variable("emb_rows", ds.FileSystemSaver(), dim=2, shards=2)
    variable.upsert(tf.constant([99], tf.int64), tf.ones([1, 2]))
    first = ShardRows(np.array([1, 2, 3], np.int64), {"value": np.full([3, 2], 1.0, np.float32)})
    second = ShardRows(np.array([3, 4], np.int64), {"value": np.full([2, 2], 2.0, np.float32)})
    with pytest.raises(RepeatedKeysError):
        apply_rows(variable, {}, [first, second])


@pytest.mark.parametrize("shards", [2, 3])
def test_restore_grows_each_table_shard_once_for_exactly_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    """A bucketed shard's rows are grouped by bucket, and a bucket's keys all belong to one
    table shard of a variable partitioned by ``default_partition_fn`` when the shard count
    divides the bucket count (200,000 rows: 12 buckets), so a restore grows each table
    shard for exactly the rows it will hold, its companions' alike."""
    from de_store.tables.hash_table import HashTable

    var = make_variable("emb", ds.FileSystemSaver(bucketed=True))
    keys = np.arange(-100_000, 100_000, dtype=np.int64)
    keys_t = tf.constant(keys)
    var.upsert(keys_t, tf.ones([len(keys), 4]))
    var.companion("adam_m", 4, tf.float32).upsert(keys_t, tf.ones([len(keys), 4]))
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))

    restored = make_variable("emb", ds.FileSystemSaver(), shards=shards)
    restored.companion("adam_m", 4, tf.float32)
    reserved: list[tuple[str, int]] = []
    original = HashTable.reserve

    def reserve(table: HashTable, count: int) -> None:
        reserved.append((table.name, count))
        original(table, count)

    loaded: list[tuple[str, int]] = []
    original_load = HashTable.load_distinct

    def load_distinct(table: HashTable, keys: tf.Tensor, values: tf.Tensor) -> None:
        if keys.shape[0]:
            loaded.append((table.name, int(keys.shape[0])))
        original_load(table, keys, values)

    compiled: list[tuple[str, int]] = []
    monkeypatch.setattr(HashTable, "reserve", reserve)
    monkeypatch.setattr(HashTable, "load_distinct", load_distinct)
    monkeypatch.setattr(
        HashTable, "compile_load", lambda t, n, room_for=0: compiled.append((t.name, n))
    )
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    for variable in (restored, restored.companions()["adam_m"]):
        sizes = [int(variable.size(index)) for index in range(shards)]
        assert sum(sizes) == len(keys)
        for shard, size in zip(variable.shards, sizes, strict=True):
            # grown in the restore's helper threads while reading; after the clear the
            # room is kept and nothing grows
            assert [count for name, count in reserved if name == shard.name] == [size, size]
            # its rows sent to it whole, in one batch, compiled for ahead
            assert [count for name, count in loaded if name == shard.name] == [size]
            assert [count for name, count in compiled if name == shard.name] == [size]
    assert content(restored) == content(var)


def test_restore_splits_batches_whose_keys_belong_to_several_shards(tmp_path: Path) -> None:
    """Three table shards do not divide the 4 key buckets of 100,000 rows: a part's keys
    belong to several shards, and each goes to its own."""
    var = make_variable("emb", ds.FileSystemSaver(bucketed=True))
    var.upsert(tf.range(-40_000, 60_000, dtype=tf.int64), tf.random.uniform([100_000, 4]))
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    from de_store.checkpoint.buckets import choose_num_buckets

    assert choose_num_buckets(100_000) == 4
    restored = make_variable("emb", ds.FileSystemSaver(), shards=3)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    for index, shard in enumerate(restored.shards):
        keys = shard.export_all()[0].numpy()
        assert len(keys) and (np.mod(keys, 3) == index).all()
