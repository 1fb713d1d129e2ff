"""A shard file's rows grouped by key bucket: gathered a chunk of whole buckets at a time.

Every part holds the rows of the one bucket the record names, parts go in bucket order,
a bucket larger than ``buffer_size`` rows spans several parts, and chunk boundaries never
split or reorder a bucket. The record's shard info is exactly what the format returned.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import pyarrow.parquet as pq
import pytest

from de_store.backends import open_backend
from de_store.checkpoint import shards
from de_store.checkpoint.buckets import BucketOrder, choose_num_buckets, key_hash_mod, stable_order
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.variable_rows import (
    VALUE_COLUMN,
    PendingShardRows,
    RowsOf,
    ShardRows,
    SnapshotRows,
    VariableRows,
    even_batches,
)
from de_store.formats import ExtraColumn, SchemaInfo, batch_from_numpy, get_format

ROWS = 200_000  # 12 buckets of about 16,700 rows


def variable_rows(count: int) -> VariableRows:
    rng = np.random.default_rng(7)
    keys = rng.permutation(np.arange(count, dtype=np.int64) * 7919 - 10**6)
    values = rng.standard_normal((count, 4), dtype=np.float32)
    slots = rng.standard_normal((count, 4), dtype=np.float32)
    columns = {VALUE_COLUMN: ColumnSpec("float32", 4), "adam_m": ColumnSpec("float32", 4)}
    shard = ShardRows(keys, {VALUE_COLUMN: values, "adam_m": slots})
    return VariableRows("emb", "int64", "float32", 4, columns, [shard])


@pytest.mark.parametrize("gather_rows", [1, 40_000, 1 << 20])
def test_parts_hold_one_bucket_each_across_gather_chunks(
    tmp_path, monkeypatch: pytest.MonkeyPatch, gather_rows: int
) -> None:
    monkeypatch.setattr(shards, "GATHER_ROWS", gather_rows)
    rows = variable_rows(ROWS)
    backend = open_backend(str(tmp_path))
    record = shards.write_shard(backend, rows, 0, rank=0, global_shard=0, format_name="parquet",
                                buffer_size=1000)  # fmt: skip
    buckets = choose_num_buckets(ROWS)
    assert (record.num_buckets, buckets) == (12, 12)
    file = pq.ParquetFile(tmp_path / record.info["path"])
    assert file.metadata.num_row_groups == len(record.part_buckets)
    assert record.part_buckets == sorted(record.part_buckets)
    assert set(record.part_buckets) == set(range(buckets))
    for index, bucket in enumerate(record.part_buckets):
        part = file.read_row_group(index)
        assert 0 < part.num_rows <= 1000
        assert set(np.mod(part.column("key").to_numpy(), buckets)) == {bucket}
    table = file.read().sort_by("key")
    order = np.argsort(rows.shards[0].keys)
    source = rows.shards[0]
    np.testing.assert_array_equal(table.column("key").to_numpy(), source.keys[order])
    for name in (VALUE_COLUMN, "adam_m"):
        found = np.stack(table.column(name).to_numpy(zero_copy_only=False))
        np.testing.assert_array_equal(found, source.columns[name][order])


def test_values_given_as_rows_of_a_store_are_written_as_gathered(tmp_path) -> None:
    """A snapshot gives its values as the table's row store and each key's row (rows not
    in key order, free rows in between): the file holds exactly each key's row."""
    rows = variable_rows(ROWS)
    shard = rows.shards[0]
    assert isinstance(shard, ShardRows)
    rng = np.random.default_rng(3)
    where = rng.permutation(2 * ROWS)[:ROWS]  # each key's row in a store twice as long
    store = rng.standard_normal((2 * ROWS, 4), dtype=np.float32)
    store[where] = shard.columns[VALUE_COLUMN]
    held = SnapshotRows(
        shard.keys, {VALUE_COLUMN: RowsOf(store, where), "adam_m": shard.columns["adam_m"]}
    )
    snapshot = dataclasses.replace(rows, shards=[PendingShardRows(ROWS, lambda: held)])
    record = shards.write_shard(open_backend(str(tmp_path)), snapshot, 0, rank=0, global_shard=0,
                                format_name="parquet", buffer_size=1000)  # fmt: skip
    table = pq.read_table(tmp_path / record.info["path"]).sort_by("key")
    order = np.argsort(shard.keys)
    np.testing.assert_array_equal(table.column("key").to_numpy(), shard.keys[order])
    for name in (VALUE_COLUMN, "adam_m"):
        found = np.stack(table.column(name).to_numpy(zero_copy_only=False))
        np.testing.assert_array_equal(found, shard.columns[name][order])


@pytest.mark.parametrize("count", [0, 1, 5, 30_000, 200_000])
@pytest.mark.parametrize("chunk_rows", [1, 3_000, 1 << 20])
def test_bucket_order_is_a_stable_sort_by_bucket(count: int, chunk_rows: int) -> None:
    keys = np.random.default_rng(count).integers(-(2**40), 2**40, count)
    order = BucketOrder(keys, "int64")
    buckets = key_hash_mod(keys, order.num_buckets, "int64")
    chunks = order.chunks(chunk_rows)
    assert [a for a, _ in chunks[1:]] == [b for _, b in chunks[:-1]]  # contiguous ranges
    got = np.concatenate([order.rows(*c) for c in chunks] or [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(got, np.argsort(buckets, kind="stable"))


@pytest.mark.parametrize("ids", [1, 720, 4097, 5040])
def test_stable_order_of_bucket_ids_wider_than_a_counting_sort(ids: int) -> None:
    """5040 bucket ids span more than Arrow's counting sort takes: sorted another way,
    with the same (stable) order."""
    buckets = np.random.default_rng(ids).integers(0, ids, 100_000)
    order = stable_order(buckets)
    assert order.dtype == np.int64
    np.testing.assert_array_equal(order, np.argsort(buckets, kind="stable"))


def test_empty_shard_has_no_parts(tmp_path) -> None:
    rows = variable_rows(0)
    record = shards.write_shard(open_backend(str(tmp_path)), rows, 0, rank=0, global_shard=0,
                                format_name="parquet", buffer_size=1000)  # fmt: skip
    assert (record.part_buckets, record.info["parts"], record.info["rows"]) == ([], (), 0)
    assert pq.read_table(tmp_path / record.info["path"]).num_rows == 0


@pytest.mark.parametrize("format_name", ["parquet", "arrow"])
def test_record_info_is_the_shard_info_as_a_dict(tmp_path, format_name: str) -> None:
    info = SchemaInfo(name="emb", dim=2, key_dtype="string", extras=(ExtraColumn("n", "int64"),))
    keys = np.array(["b", "a", "zz", "q"], dtype=object)
    batch = batch_from_numpy(keys, np.ones((4, 2), np.float32), {"n": np.arange(4)},
                             schema=info.arrow_schema())  # fmt: skip
    written = get_format(format_name).write(open_backend(str(tmp_path)), "s", [batch],
                                            schema_info=info, buffer_size=3)  # fmt: skip
    as_dict = shards.plain_dict(written)
    assert as_dict == written.to_dict()
    assert type(as_dict["parts"]) is tuple and type(as_dict["parts"][0]["ranges"]) is tuple
    assert as_dict["parts"][0]["min_key"] == "a"
    assert as_dict["files"][0]["crc32c"] == written.files[0].crc32c


def test_record_info_of_a_two_file_shard(tmp_path) -> None:
    info = SchemaInfo(name="emb", dim=2)
    batch = batch_from_numpy(np.arange(5), np.ones((5, 2), np.float32), schema=info.arrow_schema())
    written = get_format("binary").write(open_backend(str(tmp_path)), "s", [batch],
                                         schema_info=info, buffer_size=2)  # fmt: skip
    assert len(written.files) == 2
    assert shards.plain_dict(written) == written.to_dict()


def test_restored_rows_are_loaded_in_batches_of_even_size() -> None:
    """A bulk load compiles per batch size class: a restore's batches differ by one row
    at most, in the order read, every column cut with its keys."""
    sizes = [3, 0, 10, 4]
    parts, start = [], 0
    for n in sizes:
        keys = np.arange(start, start + n, dtype=np.int64)
        parts.append(ShardRows(keys, {VALUE_COLUMN: keys[:, None] * 10.0}))
        start += n
    got = list(even_batches(parts, 17, 5))
    assert [b.rows for b in got] == [5, 4, 4, 4]
    np.testing.assert_array_equal(np.concatenate([b.keys for b in got]), np.arange(17))
    for batch in got:
        np.testing.assert_array_equal(batch.columns[VALUE_COLUMN][:, 0], batch.keys * 10.0)
    assert [b.rows for b in even_batches(parts, 17, 100)] == [17]


def test_load_batches_reuse_the_memory_of_batches_no_longer_held() -> None:
    """Each joined batch is new memory only while the ones before are still held: one
    dropped lends its buffers to the next, and a batch still held, or taken over by
    TensorFlow without a copy, keeps its buffers and its rows."""
    from de_store.saver.rows import to_tensor

    parts = []
    for start in range(0, 60, 3):
        keys = np.arange(start, start + 3, dtype=np.int64)
        parts.append(ShardRows(keys, {VALUE_COLUMN: keys[:, None] * np.ones((1, 4))}))
    batches = even_batches(parts, 60, 6)  # each batch joins two parts
    first = next(batches)
    first_keys = weakref.ref(first.keys.base)
    held = next(batches)
    held_values = weakref.ref(held.columns[VALUE_COLUMN].base)
    tensor = to_tensor(held.columns[VALUE_COLUMN])  # taken over without a copy
    del first
    third = next(batches)
    assert third.keys.base is first_keys()  # the dropped batch's buffer, again
    del held
    rest = list(batches)
    assert all(b.columns[VALUE_COLUMN].base is not held_values() for b in [third, *rest])
    np.testing.assert_array_equal(tensor.numpy()[:, 0], np.arange(6, 12))
    np.testing.assert_array_equal(
        np.concatenate([b.keys for b in [third, *rest]]), np.arange(12, 60)
    )
    for batch in [third, *rest]:
        np.testing.assert_array_equal(batch.columns[VALUE_COLUMN][:, 0], batch.keys)
        assert batch.keys.ctypes.data % 64 == 0


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_a_keys_bucket_names_its_table_shard_where_the_shard_count_divides_the_buckets(
    key_dtype: str,
) -> None:
    """What lets a restore size each table shard from the manifest alone: with
    ``default_partition_fn``, a key of bucket ``b`` belongs to table shard ``b mod n``."""
    import tensorflow as tf

    from de_store.partition import default_partition_fn

    extremes = np.array([-(2**63), -(2**63) + 1, -5041, -721, -1, 0, 2**63 - 2, 2**63 - 1])
    numbers = np.concatenate(
        [np.random.default_rng(5).integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64), extremes]
    )
    keys = numbers if key_dtype == "int64" else tf.strings.as_string(numbers).numpy()
    for buckets in (12, 720, 5040):
        bucket = key_hash_mod(keys, buckets, key_dtype)
        for count in (2, 3, 4, 6):
            shard = default_partition_fn(tf.constant(keys), count).numpy()
            np.testing.assert_array_equal(bucket % count, shard)
