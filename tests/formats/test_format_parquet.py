"""The format suite on ``parquet``, plus what plain pyarrow reads of its shards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from formats_testdata import concat, make_keys, make_values, same

from de_store.formats import SchemaInfo, batch_from_numpy, batch_to_numpy, get_format
from de_store.testing.format_suite import ColumnarShardFormatTests


class TestParquetFormat(ColumnarShardFormatTests):
    format_name = "parquet"
    compressions = ("snappy", "zstd", "lz4")


def test_batches_built_with_plain_pyarrow_are_accepted(memory_location):
    backend = memory_location.open()
    values = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.float32)), 2)
    batch = pa.record_batch({"key": pa.array([5, 6, 7]), "value": values})
    f = get_format("parquet")
    info = f.write(backend, "p.parquet", [batch], schema_info=SchemaInfo("e", 2))
    got_keys, got_values, _ = concat(list(f.read(backend, info.path, expected=info)))
    assert got_keys.tolist() == [5, 6, 7] and got_values.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_plain_pyarrow_reads_parquet_shards_and_variable_folders(local_location):
    """What users rely on: pq.read_table on one shard, ds.dataset over a variable's folder."""
    backend = local_location.open()
    f = get_format("parquet")
    keys, values = make_keys(1000, "int64"), make_values(1000, 8, "float32")
    for shard in range(4):
        rows = slice(shard * 250, (shard + 1) * 250)
        schema = SchemaInfo("user_emb", 8, shard_id=shard)
        f.write(
            backend,
            f"user_emb/shard-{shard:05d}.parquet",
            [batch_from_numpy(keys[rows], values[rows])],
            schema_info=schema,
        )
    folder = f"{local_location.url}/user_emb"

    one = pq.read_table(f"{folder}/shard-00002.parquet")
    value_type = one.schema.field("value").type
    assert pa.types.is_fixed_size_list(value_type) and value_type.list_size == 8
    assert value_type.value_type == pa.float32()
    assert one.schema.metadata[b"de_store.variable"] == b"user_emb"
    assert one.schema.metadata[b"de_store.shard_id"] == b"2"
    got_keys, got_values, _ = batch_to_numpy(one)
    assert same(got_keys, keys[500:750]) and same(got_values, values[500:750])

    table = ds.dataset(folder, format="parquet").to_table()
    got_keys, got_values, _ = batch_to_numpy(table)
    order = np.argsort(got_keys)
    expected_order = np.argsort(keys)
    assert same(got_keys[order], keys[expected_order]) and same(
        got_values[order], values[expected_order]
    )
    subset = ds.dataset(folder, format="parquet").to_table(filter=ds.field("key") == int(keys[7]))
    assert subset.column("key").to_pylist() == [keys[7]]
