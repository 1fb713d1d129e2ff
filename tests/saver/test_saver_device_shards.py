"""Shards written where their rows live (``de_store.saver.device_shards``).

A table on a parameter server is exported into tensors that stay there and written by
TensorFlow ops on that task; the cluster test (``tests/distribute/test_ps.py``) does it
across processes. Here the rows are tensors of this process's CPU, which runs the same
ops: the shard must read back exactly, grouped by bucket as host-written shards are, and
storage the device cannot write makes the rows go through this process instead.
"""

from __future__ import annotations

import logging

import google_crc32c
import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from de_store.backends import open_backend
from de_store.checkpoint._tf_bundle import read_index
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.variable_rows import VALUE_COLUMN, DeviceShardRows, VariableRows
from de_store.errors import CheckpointError, ChecksumError, FormatError
from de_store.formats import get_format
from de_store.formats.base import ShardInfo
from de_store.saver import device_shards

ROWS = 200_000  # 12 buckets of about 16,700 rows
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def device_rows(count: int, key_dtype: tf.DType = tf.int64) -> tuple[VariableRows, dict]:
    rng = np.random.default_rng(3)
    keys = rng.permutation(np.arange(count, dtype=np.int64) * 7919 - 10**6)
    host = {
        "keys": keys,
        VALUE_COLUMN: rng.standard_normal((count, 4), dtype=np.float32),
        "adagrad_accumulator": rng.standard_normal((count, 4), dtype=np.float32),
    }
    columns = {n: tf.constant(host[n]) for n in (VALUE_COLUMN, "adagrad_accumulator")}
    keys_t = tf.constant(keys) if key_dtype == tf.int64 else tf.strings.as_string(keys)
    shard = DeviceShardRows(CPU, keys_t, columns)
    specs = {
        VALUE_COLUMN: ColumnSpec("float32", 4),
        "adagrad_accumulator": ColumnSpec("float32", 4),
    }
    name = "string" if key_dtype == tf.string else "int64"
    return VariableRows("emb", name, "float32", 4, specs, [shard]), host


def write(backend, rows: VariableRows):
    return device_shards.write_shard(backend, rows, 0, rank=0, global_shard=0,
                                     format_name="parquet", buffer_size=1000)  # fmt: skip


def read_all(backend, record) -> pa.Table:
    info = ShardInfo.from_dict(record.info)
    fmt = get_format(info.format)
    return pa.Table.from_batches(list(fmt.read(backend, info.path, expected=info)))


def test_rows_on_a_device_become_a_binary_shard_of_one_part_per_bucket(tmp_path) -> None:
    rows, host = device_rows(ROWS)
    backend = open_backend(str(tmp_path))
    record = write(backend, rows)
    assert record.info["format"] == "binary" and record.num_buckets == 12
    assert record.part_buckets == list(range(12))
    paths = [f["path"] for f in record.info["files"]]
    assert [p.rsplit("-", 1)[1] for p in paths] == ["keys", "values", "adagrad_accumulator"]
    assert sorted(p.name for p in (tmp_path / "emb").iterdir()) == sorted(
        p.rsplit("/", 1)[1] for p in paths
    )  # the bundles' indexes are gone, the data files renamed
    info = ShardInfo.from_dict(record.info)
    fmt = get_format("binary")
    for index, bucket in enumerate(record.part_buckets):
        part = pa.Table.from_batches(list(fmt.read(backend, info.path, expected=info,
                                                   parts=[index])))  # fmt: skip
        keys = part.column("key").to_numpy()
        assert set(np.mod(keys, 12)) == {bucket}
        assert (info.parts[index].min_key, info.parts[index].max_key) == (keys.min(), keys.max())
    table = read_all(backend, record).sort_by("key")
    order = np.argsort(host["keys"])
    np.testing.assert_array_equal(table.column("key").to_numpy(), host["keys"][order])
    for name in (VALUE_COLUMN, "adagrad_accumulator"):
        found = np.stack(table.column(name).to_numpy(zero_copy_only=False))
        np.testing.assert_array_equal(found, host[name][order])


def test_a_changed_byte_of_a_device_written_file_fails_its_checksum(tmp_path) -> None:
    rows, _ = device_rows(5_000)
    backend = open_backend(str(tmp_path))
    record = write(backend, rows)
    values = tmp_path / record.info["files"][1]["path"]
    data = bytearray(values.read_bytes())
    data[100] ^= 1
    values.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="-values"):
        read_all(backend, record)


@pytest.mark.parametrize(
    ("location", "key_dtype", "reason"),
    [
        ("memory", tf.int64, "is not a local path that task can write"),
        ("local", tf.string, "binary shards hold no string keys"),
    ],
)
def test_rows_go_through_this_process_where_the_device_cannot_write(
    tmp_path, caplog, location: str, key_dtype: tf.DType, reason: str
) -> None:
    rows, host = device_rows(3_000, key_dtype)
    url = str(tmp_path) if location == "local" else f"memory://{tmp_path.name}"
    backend = open_backend(url)
    with caplog.at_level(logging.INFO, logger="de_store"):
        record = write(backend, rows)
    assert f"rows on {CPU} go through this process" in caplog.text and reason in caplog.text
    assert record.info["format"] == "parquet"
    table = read_all(backend, record).sort_by("key")
    assert table.num_rows == 3_000
    if key_dtype == tf.int64:
        np.testing.assert_array_equal(table.column("key").to_numpy(), np.sort(host["keys"]))


def test_a_bundle_index_is_checked_before_it_is_used(tmp_path) -> None:
    prefix = str(tmp_path / "b")
    tensors = [tf.range(3, dtype=tf.int64), tf.range(5, dtype=tf.int64)]
    tf.raw_ops.SaveV2(
        prefix=prefix, tensor_names=["00000", "00001"], shape_and_slices=["", ""], tensors=tensors
    )
    data = (tmp_path / "b.index").read_bytes()
    entries = read_index(data, "b.index")
    assert [(e.offset, e.size) for e in entries.values()] == [(0, 24), (24, 40)]
    raw = (tmp_path / "b.data-00000-of-00001").read_bytes()
    assert entries["00001"].crc32c == google_crc32c.value(raw[24:])
    damaged = bytearray(data)
    damaged[5] ^= 1
    with pytest.raises(FormatError, match=r"b\.index: block at byte 0 fails its crc32c"):
        read_index(bytes(damaged), "b.index")
    with pytest.raises(FormatError, match="x: not a TensorFlow bundle index"):
        read_index(b"\0" * 64, "x")


def test_a_device_whose_files_this_process_cannot_see_fails_the_save_clearly(tmp_path) -> None:
    """A task on another machine writes to its own disk when the folder is not shared."""
    with pytest.raises(CheckpointError, match=r"/job:ps/task:1 wrote its shard, but .*/s-keys"
                       r"\.tf\.index is not there for this process: .*shared mount"):  # fmt: skip
        device_shards._entries_of(str(tmp_path / "s-keys.tf"), [0], "/job:ps/task:1")
