"""Every format writes and reads back exactly: dtypes, dims, extras, parts, columns."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from formats_testdata import concat, make_keys, make_values, same

from de_store.errors import FormatError
from de_store.formats import (
    ExtraColumn,
    SchemaInfo,
    ShardInfo,
    batch_from_numpy,
    batch_to_numpy,
    get_format,
)

FORMATS = ["parquet", "arrow", "binary"]
VALUE_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64"]


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest):
    return request.getfixturevalue(f"{request.param}_location").open()


def write_read(
    backend, fmt_name, keys, values, *, extras=None, schema_info, buffer_size=64, **read
):
    fmt = get_format(fmt_name)
    path = "emb/shard-0" + fmt.suffix
    batch = batch_from_numpy(keys, values, extras)
    info = fmt.write(backend, path, [batch], schema_info=schema_info, buffer_size=buffer_size)
    batches = list(fmt.read(backend, path, expected=info, buffer_size=50, **read))
    assert all(b.num_rows <= 50 for b in batches)
    return info, batches


# binary stores integer keys only: test_binary_rejects_extras_and_string_keys checks that
KEY_CASES = [
    (fmt, key) for fmt in FORMATS for key in ("int64", "int32", "string")
    if not (fmt == "binary" and key == "string")
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "key_dtype"), KEY_CASES)
@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("dim", [1, 16])
def test_round_trip_is_exact(backend, fmt, key_dtype, value_dtype, dim):
    keys, values = make_keys(300, key_dtype), make_values(300, dim, value_dtype)
    schema = SchemaInfo("user/emb", dim, key_dtype, value_dtype)
    info, batches = write_read(backend, fmt, keys, values, schema_info=schema)
    got_keys, got_values, extras = concat(batches)
    assert same(got_keys, keys) and same(got_values, values) and extras == {}
    assert info.rows == 300 and [p.rows for p in info.parts] == [64, 64, 64, 64, 44]
    assert (info.min_key, info.max_key) == (min(keys.tolist()), max(keys.tolist()))
    assert info.bytes == sum(backend.size(f.path) for f in info.files)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_extra_columns_round_trip(backend, fmt):
    n, dim = 200, 8
    keys, values = make_keys(n, "int64"), make_values(n, dim, "float32")
    extras = {
        "adam_m": make_values(n, dim, "bfloat16", seed=2),
        "adam_v": make_values(n, dim, "float32", seed=3),
        "timestamp": np.arange(n, dtype=np.int64) + 1_700_000_000,
        "frequency": np.arange(n, dtype=np.int32),
    }
    schema = SchemaInfo(
        "emb",
        dim,
        extras=(
            ExtraColumn("adam_m", "bfloat16", dim),
            ExtraColumn("adam_v", "float32", dim),
            ExtraColumn("timestamp", "int64"),
            ExtraColumn("frequency", "int32"),
        ),
    )
    info, batches = write_read(backend, fmt, keys, values, extras=extras, schema_info=schema)
    got_keys, got_values, got_extras = concat(batches)
    assert same(got_keys, keys) and same(got_values, values)
    assert list(got_extras) == list(extras)
    assert all(same(got_extras[name], extras[name]) for name in extras)
    assert info.columns == ("key", "value", "adam_m", "adam_v", "timestamp", "frequency")


# binary shards cannot be read without their ShardInfo: test_binary_needs_its_shard_info
PART_CASES = [(fmt, v) for fmt in FORMATS for v in (True, False) if fmt != "binary" or v]


@pytest.mark.parametrize(("fmt", "verified"), PART_CASES)
def test_some_parts_and_columns(backend, fmt, verified):
    keys, values = make_keys(300, "int64"), make_values(300, 4, "float32")
    info, _ = write_read(backend, fmt, keys, values, schema_info=SchemaInfo("emb", 4))
    f = get_format(fmt)
    expected = info if verified else None
    batches = list(f.read(backend, info.path, parts=[3, 1], expected=expected, columns=["key"]))
    assert [b.schema.names for b in batches] == [["key"]] * len(batches)
    got = np.concatenate([b.column(0).to_numpy() for b in batches])
    assert same(got, np.concatenate([keys[192:256], keys[64:128]]))
    value_only = list(f.read(backend, info.path, expected=expected, columns=["value"]))
    assert same(concat_values(value_only), values)
    with pytest.raises(ValueError, match=r"has 5 parts .*cannot read parts \[7\]"):
        list(f.read(backend, info.path, parts=[7], expected=expected))


def concat_values(batches):
    return np.concatenate(
        [batch_to_numpy(b.add_column(0, "key", pa.nulls(b.num_rows)))[1] for b in batches]
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_shard(backend, fmt):
    f = get_format(fmt)
    schema = SchemaInfo("emb", 4)
    empty = batch_from_numpy(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
    for batches in ([], [empty]):
        info = f.write(backend, "empty" + f.suffix, batches, schema_info=schema)
        assert (info.rows, info.parts, info.min_key, info.max_key) == (0, (), None, None)
        assert list(f.read(backend, info.path, expected=info)) == []
        if fmt != "binary":
            assert list(f.read(backend, info.path)) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_batches_become_parts_in_order(backend, fmt):
    f = get_format(fmt)
    keys, values = make_keys(500, "int64"), make_values(500, 2, "float16")
    batches = [batch_from_numpy(keys[i : i + 100], values[i : i + 100]) for i in range(0, 500, 100)]
    info = f.write(
        backend,
        "s" + f.suffix,
        batches,
        schema_info=SchemaInfo("e", 2, value_dtype="float16"),
        buffer_size=60,
    )
    assert [p.rows for p in info.parts] == [60, 40] * 5
    assert [p.row_offset for p in info.parts] == [0, 60, 100, 160, 200, 260, 300, 360, 400, 460]
    assert (
        info.parts[2].min_key == keys[100:160].min()
        and info.parts[2].max_key == keys[100:160].max()
    )
    got_keys, got_values, _ = concat(list(f.read(backend, info.path, expected=info)))
    assert same(got_keys, keys) and same(got_values, values)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_info_survives_json(backend, fmt):
    keys = make_keys(100, "int32")
    info, _ = write_read(
        backend, fmt, keys, make_values(100, 3, "float32"), schema_info=SchemaInfo("e", 3, "int32")
    )
    again = ShardInfo.from_dict(json.loads(json.dumps(info.to_dict())))
    assert again == info
    assert len(list(get_format(fmt).read(backend, info.path, expected=again))) == 2


@pytest.mark.parametrize(
    ("fmt", "compression"),
    [("parquet", c) for c in ("snappy", "zstd", "lz4")] + [("arrow", c) for c in ("lz4", "zstd")],
)
def test_compressions_round_trip(backend, fmt, compression):
    f = get_format(fmt, compression=compression)
    keys, values = make_keys(400, "string"), np.zeros((400, 16), np.float32)
    info = f.write(
        backend,
        "c" + f.suffix,
        [batch_from_numpy(keys, values)],
        schema_info=SchemaInfo("e", 16, "string"),
    )
    assert info.bytes < values.nbytes  # zeros compress
    got_keys, got_values, _ = concat(list(f.read(backend, info.path, expected=info)))
    assert same(got_keys, keys) and same(got_values, values)


def test_unknown_format_and_compression():
    with pytest.raises(
        ValueError,
        match=r"unknown shard format 'orc'; known formats: \['arrow', 'binary', 'parquet'\]",
    ):
        get_format("orc")
    with pytest.raises(ValueError, match="parquet compression must be one of"):
        get_format("parquet", compression="brotli")


def test_binary_rejects_extras_and_string_keys(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    with pytest.raises(
        FormatError, match=r"integer keys and one value column only: got key_dtype='string'"
    ):
        f.write(backend, "s", [], schema_info=SchemaInfo("e", 2, "string"))
    schema = SchemaInfo("e", 2, extras=(ExtraColumn("timestamp", "int64"),))
    with pytest.raises(FormatError, match=r"extra columns \['timestamp'\]"):
        f.write(backend, "s", [], schema_info=schema)
    assert backend.list() == []


def test_batch_of_another_schema_is_refused(memory_location):
    backend = memory_location.open()
    batch = batch_from_numpy(make_keys(10, "int32"), make_values(10, 2, "float32"))
    with pytest.raises(
        FormatError,
        match=r"expected columns \[key: int64, value: float\[2\]\], "
        r"found \[key: int32",
    ):
        get_format("arrow").write(backend, "s.arrow", [batch], schema_info=SchemaInfo("e", 2))
    assert not backend.exists("s.arrow")


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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_round_trip_on_object_stores(request, store, fmt):
    """The same shards through a real moto S3 server and a real GCS emulator."""
    backend = request.getfixturevalue(f"{store}_location").open()
    keys, values = make_keys(3000, "int64"), make_values(3000, 16, "bfloat16")
    schema = SchemaInfo("emb", 16, value_dtype="bfloat16")
    info, batches = write_read(backend, fmt, keys, values, schema_info=schema, buffer_size=1000)
    got_keys, got_values, _ = concat(batches)
    assert same(got_keys, keys) and same(got_values, values)
    part = list(get_format(fmt).read(backend, info.path, expected=info, parts=[2]))
    assert same(concat(part)[0], keys[2000:])


def test_binary_needs_its_shard_info(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    keys, values = make_keys(10, "int64"), make_values(10, 2, "float32")
    f.write(backend, "s", [batch_from_numpy(keys, values)], schema_info=SchemaInfo("e", 2))
    with pytest.raises(ValueError, match=r"binary shard .*/s records no dim or dtypes"):
        list(f.read(backend, "s"))
