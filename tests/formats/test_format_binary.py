"""The format suite on ``binary`` (TFRA's raw key/value layout), plus what it refuses."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from formats_testdata import make_keys, make_values

from de_store.errors import FormatError
from de_store.formats import ExtraColumn, SchemaInfo, batch_from_numpy, get_format
from de_store.testing.format_suite import ShardFormatTests


class TestBinaryFormat(ShardFormatTests):
    format_name = "binary"


def test_binary_rejects_string_keys_and_extras_that_cannot_name_a_file(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    with pytest.raises(FormatError, match=r"integer keys only: got key_dtype='string'"):
        f.write(backend, "s", [], schema_info=SchemaInfo("e", 2, "string"))
    for name in ("slot/m", "keys"):
        schema = SchemaInfo("e", 2, extras=(ExtraColumn(name, "int64"),))
        with pytest.raises(FormatError, match=rf"extra column '{name}' cannot name a file"):
            f.write(backend, "s", [], schema_info=schema)
    assert backend.list() == []


def test_binary_writes_each_extra_column_as_a_raw_file(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    keys, values = make_keys(300, "int64"), make_values(300, 4, "float32")
    extras = {"adam_m": make_values(300, 4, "bfloat16", seed=2), "step": np.arange(300)}
    schema = SchemaInfo(
        "e", 4, extras=(ExtraColumn("adam_m", "bfloat16", 4), ExtraColumn("step", "int64"))
    )
    batches = [
        batch_from_numpy(keys[:100], values[:100], {n: c[:100] for n, c in extras.items()}),
        batch_from_numpy(keys[100:], values[100:], {n: c[100:] for n, c in extras.items()}),
    ]
    info = f.write(backend, "s", batches, schema_info=schema, buffer_size=64)
    assert [x.path for x in info.files] == ["s-keys", "s-values", "s-adam_m", "s-step"]
    assert np.frombuffer(backend.read_bytes("s-step"), "<i8").tolist() == list(range(300))
    written = pa.Table.from_batches(batches)["adam_m"].combine_chunks().flatten()
    assert backend.read_bytes("s-adam_m") == written.to_numpy().astype("<u2").tobytes()
    got = pa.Table.from_batches(list(f.read(backend, "s", expected=info, parts=[1, 3])))
    assert got["key"].to_pylist() == keys[64:100].tolist() + keys[164:228].tolist()
    assert got["step"].to_pylist() == list(range(64, 100)) + list(range(164, 228))
    whole = pa.Table.from_batches(list(f.read(backend, "s", expected=info)))
    assert whole.equals(pa.Table.from_batches(batches))


def test_binary_needs_its_shard_info(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    keys, values = make_keys(10, "int64"), make_values(10, 2, "float32")
    f.write(backend, "s", [batch_from_numpy(keys, values)], schema_info=SchemaInfo("e", 2))
    with pytest.raises(ValueError, match=r"binary shard .*/s records no dim or dtypes"):
        list(f.read(backend, "s"))
