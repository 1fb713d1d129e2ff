"""The format suite on ``binary`` (TFRA's raw key/value layout), plus what it refuses."""

from __future__ import annotations

import pytest
from formats_testdata import make_keys, make_values

from de_store.errors import FormatError
from de_store.formats import ExtraColumn, SchemaInfo, batch_from_numpy, get_format
from de_store.testing.format_suite import ShardFormatTests


class TestBinaryFormat(ShardFormatTests):
    format_name = "binary"


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


def test_binary_needs_its_shard_info(memory_location):
    backend = memory_location.open()
    f = get_format("binary")
    keys, values = make_keys(10, "int64"), make_values(10, 2, "float32")
    f.write(backend, "s", [batch_from_numpy(keys, values)], schema_info=SchemaInfo("e", 2))
    with pytest.raises(ValueError, match=r"binary shard .*/s records no dim or dtypes"):
        list(f.read(backend, "s"))
