"""A restore into an empty variable loads its rows while the shards are still read.

The loads start before the last part is read; a damaged part, a key held twice or two
variables of which the second cannot be read leave every variable empty, as it was; a
variable that holds keys is replaced only after every part was read. ``map_ahead``
ahead by bytes keeps its order, its bound and the producer's error.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import content, make_variable

import de_store as ds
from de_store.backends import local
from de_store.checkpoint import shards
from de_store.checkpoint.variable_rows import ShardRows, even_sizes
from de_store.errors import CheckpointCorruptError, ChecksumError
from de_store.formats._shard import map_ahead
from de_store.saver import rows as rows_module
from de_store.saver import streamed
from de_store.tables.hash_table import HashTable
from de_store.testing.page_cache import evict, reads_from_disk

ROWS = 200_000  # dim 64: batches of 65,536 rows at most, so 4 load batches


def saved(tmp_path: Path, name: str = "emb") -> tuple[ds.Variable, str]:
    var = make_variable(name, ds.FileSystemSaver(buffer_size=4096), dim=64)
    var.upsert(tf.range(ROWS, dtype=tf.int64) * 7, tf.random.uniform([ROWS, 64], seed=1))
    return var, tf.train.Checkpoint(**{name: var}).write(str(tmp_path / "ckpt"))


def record_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``"read"`` for each batch of rows read, ``"load"`` for each batch loaded, in order."""
    steps: list[str] = []
    lock = threading.Lock()
    read_rows = shards.read_shard_rows

    def reading(*args, **kwargs):
        for rows in read_rows(*args, **kwargs):
            with lock:
                steps.append("read")
            yield rows

    original = HashTable.load_distinct

    def load_distinct(table: HashTable, keys: tf.Tensor, values: tf.Tensor) -> None:
        if keys.shape[0]:
            with lock:
                steps.append("load")
        original(table, keys, values)

    monkeypatch.setattr(shards, "read_shard_rows", reading)
    monkeypatch.setattr(HashTable, "load_distinct", load_distinct)
    return steps


def test_an_empty_variable_loads_before_the_last_part_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    var, prefix = saved(tmp_path)
    monkeypatch.setattr(streamed, "READ_AHEAD_BYTES", 1 << 20)  # four parts ahead at most
    steps = record_steps(monkeypatch)
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert steps.count("load") == 4
    assert steps.index("load") < len(steps) - 1 - steps[::-1].index("read")
    assert content(restored) == content(var)


def test_a_variable_holding_keys_is_replaced_after_every_part_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    var, prefix = saved(tmp_path)
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64)
    restored.upsert(tf.constant([-1], tf.int64), tf.ones([1, 64]))
    steps = record_steps(monkeypatch)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert steps.index("load") > len(steps) - 1 - steps[::-1].index("read")
    assert content(restored) == content(var)


def test_the_table_shards_are_readied_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each table shard of an empty variable is grown and runs its bulk load once on no
    rows in a thread of its own, all three at once (they meet at a barrier in that empty
    load; taking turns, the first would wait there alone until the barrier broke)."""
    var, prefix = saved(tmp_path)
    barrier = threading.Barrier(3, timeout=60)
    original = HashTable.load_distinct

    def load_distinct(table: HashTable, keys: tf.Tensor, values: tf.Tensor) -> None:
        if not keys.shape[0]:
            barrier.wait()
        original(table, keys, values)

    monkeypatch.setattr(HashTable, "load_distinct", load_distinct)
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64, shards=3)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    assert all(int(shard.size()) for shard in restored.shards)


@pytest.mark.parametrize("holding", ["variable", "companion"])
def test_a_restore_empties_a_companion_the_checkpoint_does_not_hold(
    tmp_path: Path, holding: str
) -> None:
    """The restored variable holds the checkpoint's content and nothing else: an
    ``adam_m`` companion the checkpoint has no column for ends empty, whether the
    variable held keys too or only its companion did."""
    var, prefix = saved(tmp_path)
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64, shards=2)
    keys, rows = tf.constant([-1, -2], tf.int64), tf.ones([2, 64])
    if holding == "variable":
        restored.upsert(keys, rows)
    restored.companion("adam_m", 64, tf.float32).upsert(keys, rows)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    assert int(restored.companions()["adam_m"].size()) == 0


def test_rows_are_regrouped_into_each_shards_even_load_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every row read goes, with all its columns and once, into a load batch of its key's
    table shard; each shard gets its share in the even batches a restore compiles for,
    its rows in the order they were read."""
    monkeypatch.setattr(rows_module, "LOAD_ROWS", 4000)
    var = make_variable("emb", None, dim=2, shards=3)
    keys = np.random.default_rng(6).permutation(np.arange(-20_000, 30_000, dtype=np.int64))
    values = np.stack([keys, -keys], 1).astype(np.float32)
    slots = np.stack([keys * 2, keys * 3], 1).astype(np.float32)
    read = [
        ShardRows(
            keys[i : i + 7000], {"value": values[i : i + 7000], "adam_m": slots[i : i + 7000]}
        )
        for i in range(0, len(keys), 7000)
    ]
    owner = np.mod(keys, 3)
    shares = [int(np.sum(owner == shard)) for shard in range(3)]
    regrouped = list(rows_module.shard_batches(read, var, shares))
    for shard in range(3):
        mine = [batch for to, batch in regrouped if to == shard]
        assert [b.rows for b in mine] == even_sizes(shares[shard], 4000)
        got = np.concatenate([b.keys for b in mine])
        np.testing.assert_array_equal(got, keys[owner == shard])
        for column, source in (("value", values), ("adam_m", slots)):
            np.testing.assert_array_equal(
                np.concatenate([b.columns[column] for b in mine]), source[owner == shard]
            )


def damage_a_part(tmp_path: Path, name: str) -> Path:
    """Flip one byte in the middle of ``name``'s shard file (a part's data)."""
    (path,) = (tmp_path / "de_store").rglob(f"{name}/*.parquet")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_checkpoint_no_longer_in_the_page_cache_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its parts of 1 MiB or more are read straight from the disk (O_DIRECT, Linux), into
    buffers whose memory goes from part to part while the rows of earlier ones load."""
    var, prefix = saved(tmp_path)
    evict(tmp_path)
    direct: list[int] = []
    release = local.LocalReadFile.release

    def counted(f: local.LocalReadFile) -> None:
        direct.append(f.direct_reads)
        release(f)

    monkeypatch.setattr(local.LocalReadFile, "release", counted)
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    # the full parts of 4096 rows (1.08 MB); the last is streamed. The kernel may hold the
    # last page of a part again by the time it is read (then read from the page cache)
    (shard,) = tmp_path.rglob("*.parquet")
    assert len(direct) == 1 and (sum(direct) > 0 or not reads_from_disk(shard))


def test_a_damaged_part_leaves_the_variable_empty_and_names_the_file(tmp_path: Path) -> None:
    _, prefix = saved(tmp_path)
    path = damage_a_part(tmp_path, "emb")
    restored = make_variable("emb", ds.FileSystemSaver(), dim=64)
    with pytest.raises(ChecksumError, match=f"crc32c mismatch in part .* of .*{path.name}"):
        tf.train.Checkpoint(emb=restored).read(prefix)
    assert int(restored.size()) == 0


def test_a_variable_streamed_before_another_fails_to_read_is_emptied(tmp_path: Path) -> None:
    """All or nothing over the variables of one restore: the first is loaded while read,
    the second's file is damaged, and the first holds nothing afterwards."""
    first = make_variable("a", ds.FileSystemSaver(buffer_size=4096), dim=64)
    second = make_variable("b", ds.FileSystemSaver(buffer_size=4096), dim=64)
    keys = tf.range(ROWS, dtype=tf.int64)
    for var in (first, second):
        var.upsert(keys, tf.random.uniform([ROWS, 64], seed=2))
    prefix = tf.train.Checkpoint(a=first, b=second).write(str(tmp_path / "ckpt"))
    path = damage_a_part(tmp_path, "b")
    into = [make_variable(n, ds.FileSystemSaver(), dim=64) for n in ("a", "b")]
    with pytest.raises(ChecksumError, match=path.name):
        tf.train.Checkpoint(a=into[0], b=into[1]).read(prefix)
    assert [int(var.size()) for var in into] == [0, 0]


def test_a_key_held_twice_empties_the_variable_and_names_both_files(tmp_path: Path) -> None:
    """Two table shards saved with the same key (a forged checkpoint): the stream loads
    one row fewer than the manifest counts; the restore reads the rows again and names
    the key and its files."""
    var = make_variable("emb", ds.FileSystemSaver(), shards=2)
    var.upsert(tf.range(1000, dtype=tf.int64), tf.ones([1000, 4]))
    twin = var.shards[1]
    key = int(var.shards[0].export_all()[0][0])
    twin.insert(tf.constant([key], tf.int64), tf.zeros([1, 4]))  # behind the partitioner
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    restored = make_variable("emb", ds.FileSystemSaver(), shards=2)
    with pytest.raises(CheckpointCorruptError, match=f"key {key} is held 2 times"):
        tf.train.Checkpoint(emb=restored).read(prefix)
    assert int(restored.size()) == 0


def saved_chain(tmp_path: Path) -> tuple[ds.Variable, str, str]:
    """A full checkpoint ``ckpt-0`` and a delta ``ckpt-1`` on it (updates, new keys,
    removals); the variable, and the delta's URL and its folder name."""
    var = make_variable("emb", None, dim=64)
    var.upsert(tf.range(ROWS, dtype=tf.int64) * 7, tf.random.uniform([ROWS, 64], seed=1))
    policy = ds.IncrementalPolicy(full_every=1000, max_chain_ratio=1e9)
    ds.save([var], str(tmp_path / "ckpt-0"), incremental=policy, buffer_size=4096, blocking=True)
    var.upsert(tf.range(0, 7000, 7, dtype=tf.int64), tf.zeros([1000, 64]))
    var.upsert(tf.range(-500, 0, dtype=tf.int64), tf.ones([500, 64]))
    var.remove(tf.range(7000, 14_000, 7, dtype=tf.int64))
    ds.save([var], str(tmp_path / "ckpt-1"), incremental=policy, blocking=True)
    return var, str(tmp_path / "ckpt-1"), "ckpt-1"


def test_a_chain_streams_its_full_link_then_applies_its_deltas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    var, url, _ = saved_chain(tmp_path)
    monkeypatch.setattr(streamed, "READ_AHEAD_BYTES", 1 << 20)
    steps = record_steps(monkeypatch)
    restored = make_variable("emb", None, dim=64)
    manifest = ds.restore([restored], url)
    assert manifest.variables["emb"].incremental
    # the delta's part first, then the full link's, the loads among them
    assert steps.index("load") < len(steps) - 1 - steps[::-1].index("read")
    assert content(restored) == content(var)


def test_a_damaged_delta_leaves_the_variable_empty_and_names_its_file(tmp_path: Path) -> None:
    """A chain's deltas are read and checked before its full link is loaded."""
    _, url, name = saved_chain(tmp_path)
    (path,) = (tmp_path / name).rglob("emb/r0*.parquet")  # its rows, not its tombstones
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restored = make_variable("emb", None, dim=64)
    with pytest.raises(ChecksumError, match=f"crc32c mismatch in part .* of .*{path.name}"):
        ds.restore([restored], url)
    assert int(restored.size()) == 0


# --- map_ahead, ahead by bytes -----------------------------------------------------------
def same(item: Any) -> Any:
    return item


def test_map_ahead_by_bytes_keeps_order_and_its_bound() -> None:
    held = []
    produced = threading.Semaphore(0)

    def items():
        for i in range(20):
            held.append(i)
            produced.release()
            yield np.full(10, i, np.int64)  # 80 bytes each

    out = []
    ahead = map_ahead(same, items(), 1, "test", limit=250, size=lambda a: a.nbytes)
    for array in ahead:
        produced.acquire(timeout=5)  # this item's production
        out.append(int(array[0]))
        # at most three items of 80 bytes are queued beyond the one in hand
        assert len(held) - len(out) <= 3
    assert out == list(range(20))


def test_map_ahead_by_bytes_raises_the_producers_error_after_its_items() -> None:
    def items():
        yield 1
        yield 2
        raise OSError("disk gone")

    ahead = map_ahead(same, items(), 1, "test", limit=100, size=lambda _: 1)
    assert [next(ahead), next(ahead)] == [1, 2]
    with pytest.raises(OSError, match="disk gone"):
        next(ahead)


def test_closing_map_ahead_by_bytes_early_stops_and_closes_the_producer() -> None:
    closed = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            closed.set()

    ahead = map_ahead(same, items(), 1, "test", limit=10, size=lambda _: 1)
    assert next(ahead) == 0
    ahead.close()
    assert closed.is_set()
    assert not [t for t in threading.enumerate() if t.name == "de_store-test"]
