"""Across formats: the registry's errors, and shards through real object stores.

Each format's own behaviour is the format suite (``de_store.testing.format_suite``), run
by ``test_format_<name>.py``."""

from __future__ import annotations

import pytest
from formats_testdata import concat, make_keys, make_values, same

from de_store.formats import SchemaInfo, batch_from_numpy, get_format

FORMATS = ["parquet", "arrow", "binary"]


def test_unknown_format_and_compression():
    with pytest.raises(
        ValueError,
        match=r"unknown shard format 'orc'; known formats: \['arrow', 'binary', 'parquet'\]",
    ):
        get_format("orc")
    with pytest.raises(ValueError, match="parquet compression must be one of"):
        get_format("parquet", compression="brotli")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_round_trip_on_object_stores(request, store, fmt):
    """The same shards through a real moto S3 server and a real GCS emulator."""
    backend = request.getfixturevalue(f"{store}_location").open()
    keys, values = make_keys(3000, "int64"), make_values(3000, 16, "bfloat16")
    schema = SchemaInfo("emb", 16, value_dtype="bfloat16")
    f = get_format(fmt)
    batch = batch_from_numpy(keys, values)
    info = f.write(backend, "emb/shard-0" + f.suffix, [batch], schema_info=schema, buffer_size=1000)
    batches = list(f.read(backend, info.path, expected=info, buffer_size=50))
    assert all(b.num_rows <= 50 for b in batches)
    got_keys, got_values, _ = concat(batches)
    assert same(got_keys, keys) and same(got_values, values)
    part = list(get_format(fmt).read(backend, info.path, expected=info, parts=[2]))
    assert same(concat(part)[0], keys[2000:])
