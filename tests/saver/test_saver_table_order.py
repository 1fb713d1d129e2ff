"""A one-process save writes each shard's rows in the order its table holds them.

The shard is then one key bucket (no sort, no gather into bucket order); a restore into any
number of table shards or processes still gets exactly its keys, each rank reading every
part. ``bucketed=True`` (or several saving processes) groups rows by bucket instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf
from saver_helpers import companion_content, content, fill, make_variable

import de_store as ds
from de_store.backends import open_location
from de_store.checkpoint.topology import Topology
from de_store.saver import core, restore_flow


def _records(folder: Path) -> list[dict]:
    (manifest,) = folder.glob("manifest-*.json")
    return json.loads(manifest.read_text())["variables"]["emb"]["shards"]


def test_rows_are_written_as_the_row_store_holds_them(tmp_path: Path) -> None:
    """A table filled in one batch holds key ``i`` of the batch in row ``i``: the file
    holds the keys in that order (not in index-slot or bucket order), one bucket."""
    keys = np.random.default_rng(3).permutation(np.arange(-30_000, 30_000, dtype=np.int64))
    values = np.stack([keys, -keys], 1).astype(np.float32)
    var = make_variable("emb", ds.FileSystemSaver(buffer_size=7000), dim=2)
    var.upsert(keys, values)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))

    (record,) = _records(tmp_path / "de_store" / "ckpt")
    assert (record["num_buckets"], record["part_buckets"]) == (1, [0] * 9)
    table = pq.read_table(tmp_path / "de_store" / "ckpt" / record["info"]["path"])
    np.testing.assert_array_equal(table.column("key").to_numpy(), keys)
    got = np.stack(table.column("value").to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(got, values)

    restored = make_variable("emb", ds.FileSystemSaver(), dim=2, shards=3)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)


@pytest.mark.parametrize(
    ("dim", "buffer_size", "parts"),
    [(16, None, [262_144, 37_856]), (64, None, [65_536] * 4 + [37_856]),
     (16, 100_000, [100_000] * 3)],
    ids=["16_wide", "64_wide", "told"],
)  # fmt: skip
def test_parts_hold_about_16_mib_unless_told_how_many_rows(
    tmp_path: Path, dim: int, buffer_size: int | None, parts: list[int]
) -> None:
    """Without ``buffer_size`` a part holds the multiple of 65,536 rows nearest 16 MiB of
    its columns (a row of 16 float32 values and its int64 key: 72 bytes, so 262,144
    rows; 64 wide: 264 bytes, 65,536); with it, that many rows. A restore reads them all."""
    keys = np.arange(300_000, dtype=np.int64) * 7
    values = np.repeat(keys[:, None] % 1000, dim, 1).astype(np.float32)
    var = make_variable("emb", ds.FileSystemSaver(buffer_size=buffer_size), dim=dim)
    var.upsert(keys, values)
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))

    (record,) = _records(tmp_path / "de_store" / "ckpt")
    metadata = pq.ParquetFile(tmp_path / "de_store" / "ckpt" / record["info"]["path"]).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == parts
    restored = make_variable("emb", ds.FileSystemSaver(), dim=dim, shards=2)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)


def test_freed_rows_are_left_out(tmp_path: Path) -> None:
    """Removed keys free their rows: the store has holes, and only live rows are written."""
    var = make_variable("emb", ds.FileSystemSaver())
    keys, _ = fill(var, 20_000)
    var.remove(tf.constant(keys[::3]))
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))
    (record,) = _records(tmp_path / "de_store" / "ckpt")
    assert record["num_buckets"] == 1 and record["info"]["rows"] == 20_000 - len(keys[::3])

    restored = make_variable("emb", ds.FileSystemSaver(), shards=2)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    assert companion_content(restored, "adam_m") == companion_content(var, "adam_m")
    assert not set(content(restored)) & set(keys[::3].tolist())


@pytest.mark.parametrize("companion", [False, True])
def test_with_freed_rows_the_live_rows_are_written_in_the_stores_order(
    tmp_path: Path, companion: bool
) -> None:
    """Removed keys leave holes in the row store and new keys fill some of them: the
    file holds the live rows front to back as the store does (the keys kept, in the
    order they were inserted), not in the index's slot order; with an ``adam_m``
    companion (looked up by key) too."""
    keys = np.random.default_rng(4).permutation(np.arange(-30_000, 30_000, dtype=np.int64))
    var = make_variable("emb", ds.FileSystemSaver(buffer_size=7000), dim=2)
    var.upsert(keys, np.stack([keys, -keys], 1).astype(np.float32))
    var.remove(tf.constant(keys[::3]))
    new = np.arange(100_000, 100_500, dtype=np.int64)
    var.upsert(new, np.stack([new, new], 1).astype(np.float32))
    if companion:
        live = var.export()[0]
        var.companion("adam_m", 2, tf.float32).upsert(live, tf.ones([int(var.size()), 2]))
    prefix = tf.train.Checkpoint(emb=var).write(str(tmp_path / "ckpt"))

    (record,) = _records(tmp_path / "de_store" / "ckpt")
    written = pq.read_table(tmp_path / "de_store" / "ckpt" / record["info"]["path"])
    written_keys = written.column("key").to_numpy()
    kept = np.delete(keys, np.s_[::3])
    np.testing.assert_array_equal(written_keys[np.isin(written_keys, kept)], kept)
    assert len(written_keys) == len(kept) + len(new)
    assert set(written_keys.tolist()) == set(kept.tolist()) | set(new.tolist())

    restored = make_variable("emb", ds.FileSystemSaver(), dim=2, shards=2)
    tf.train.Checkpoint(emb=restored).read(prefix).assert_consumed()
    assert content(restored) == content(var)
    if companion:
        assert companion_content(restored, "adam_m") == companion_content(var, "adam_m")


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_restores_exactly_its_keys_reading_every_part(tmp_path: Path, ranks: int) -> None:
    var = make_variable("emb", None, shards=2)
    keys, _ = fill(var, 50_000, start=-25_000)
    url = str(tmp_path / "ck")
    ds.save([var], url, blocking=True)
    seen = []
    for rank in range(ranks):
        backend, name = open_location(url, None)
        target = make_variable("emb", None)
        backend.stats.reset()
        manifest = restore_flow.restore_checkpoint(
            [target], backend, name, Topology(ranks, rank), core.IOOptions()
        )
        assert {r.num_buckets for r in manifest.variables["emb"].shards} == {1}
        assert backend.stats.bytes_read >= sum(
            part_bytes for r in manifest.variables["emb"].shards for part_bytes in _sizes(r)
        )
        got = target.export()[0].numpy()
        assert np.all(np.mod(got, ranks) == rank)
        seen.append(got)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.sort(keys))


def _sizes(record) -> list[int]:
    return [r["length"] for part in record.info["parts"] for r in part["ranges"]]


def test_a_checkpoint_in_table_order_compacts_into_key_groups(tmp_path: Path) -> None:
    """Compaction chooses its own key groups for a full link of one bucket (it reads the
    link whole): 70,000 rows give the 4 groups 70,000 rows bucketed would have."""
    var = make_variable("emb", None)
    fill(var, 70_000)
    ds.save([var], str(tmp_path / "ck"), blocking=True)
    out = ds.compact(str(tmp_path / "ck"), str(tmp_path / "flat"), group_rows=1000)
    records = _records(tmp_path / "flat")
    assert [r["shard"] for r in records] == [0, 1, 2, 3]
    for record in records:
        keys = pq.read_table(tmp_path / "flat" / record["info"]["path"]).column("key")
        assert set(np.mod(keys.to_numpy(), 4)) == {record["shard"]}
    restored = make_variable("emb", None)
    ds.restore([restored], out)
    assert content(restored) == content(var)
    assert companion_content(restored, "adam_m") == companion_content(var, "adam_m")


def test_who_groups_rows_by_bucket() -> None:
    one, two = Topology(1, 0), Topology(2, 1)
    assert (core.IOOptions().bucketed_for(one), core.IOOptions().bucketed_for(two)) == (
        False,
        True,
    )
    assert core.IOOptions().bucketed_for(one, chained=True) is True  # incremental saves
    assert ds.FileSystemSaver(incremental=True).options.bucketed_for(one, chained=True)
    assert core.IOOptions(bucketed=True).bucketed_for(one) is True
    assert core.IOOptions(bucketed=False).bucketed_for(two) is False
    assert ds.FileSystemSaver(bucketed=True).options.bucketed is True
    with pytest.raises(ValueError, match="bucketed must be True, False or None, got 'yes'"):
        ds.FileSystemSaver(bucketed="yes")  # type: ignore[arg-type]
