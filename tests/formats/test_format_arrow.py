"""The format suite on ``arrow`` (Arrow IPC files), plus its schema check."""

from __future__ import annotations

import pytest
from formats_testdata import make_keys, make_values

from de_store.errors import FormatError
from de_store.formats import SchemaInfo, batch_from_numpy, get_format
from de_store.testing.format_suite import ColumnarShardFormatTests


class TestArrowFormat(ColumnarShardFormatTests):
    format_name = "arrow"
    compressions = ("lz4", "zstd")


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
