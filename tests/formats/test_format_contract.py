"""What :class:`ShardFormat` builds on a format's own steps: ``read`` over ``read_verified``
and ``read_unverified`` (format check, column selection, batch size)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from de_store.backends import Backend
from de_store.errors import FormatError
from de_store.formats import SchemaInfo, ShardFormat, ShardInfo, batch_from_numpy, get_format
from de_store.formats.base import ReadRequest


class StepsOnly(ShardFormat):
    """A format that brings only ``write`` and ``read_verified`` (Arrow IPC's)."""

    name = "arrow"
    suffix = ".arrow"

    def __init__(self) -> None:
        self.requests: list[ReadRequest] = []

    def write(
        self, backend: Backend, path: str, batches: Iterable[pa.RecordBatch], **kwargs: Any
    ) -> ShardInfo:
        return get_format("arrow").write(backend, path, batches, **kwargs)

    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        self.requests.append(request)
        return get_format("arrow").read_verified(backend, path, expected, request)


def written(backend: Backend, fmt: ShardFormat) -> ShardInfo:
    keys = np.arange(10, dtype=np.int64)
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    batch = batch_from_numpy(keys, values)
    return fmt.write(backend, "s.arrow", [batch], schema_info=SchemaInfo("e", 2), buffer_size=8)


def test_read_selects_columns_and_cuts_batches_of_what_the_format_step_yields(memory_location):
    backend = memory_location.open()
    fmt = StepsOnly()
    info = written(backend, fmt)
    batches = list(fmt.read(backend, "s.arrow", expected=info, columns=["value"], buffer_size=3))
    assert [b.num_rows for b in batches] == [3, 3, 2, 2]
    assert {tuple(b.schema.names) for b in batches} == {("value",)}
    assert fmt.requests == [ReadRequest(parts=None, columns=["value"], buffer_size=3)]
    rows = pa.Table.from_batches(batches).column("value").to_pylist()
    assert rows == [[2.0 * i, 2.0 * i + 1] for i in range(10)]


def test_read_without_shard_info_is_refused_by_default(memory_location):
    backend = memory_location.open()
    fmt = StepsOnly()
    written(backend, fmt)
    where = f"{backend.url.rstrip('/')}/s.arrow"
    message = f"arrow shard {where} records no schema: pass expected=<its ShardInfo>"
    with pytest.raises(ValueError, match=re.escape(message)):
        list(fmt.read(backend, "s.arrow"))


def test_shard_info_of_another_format_is_refused_before_the_format_step(memory_location):
    backend = memory_location.open()
    fmt = StepsOnly()
    info = written(backend, fmt)
    foreign = ShardInfo.from_dict({**info.to_dict(), "format": "parquet"})
    where = f"{backend.url.rstrip('/')}/s.arrow"
    message = f"{where}: expected describes a 'parquet' shard, read as 'arrow'"
    with pytest.raises(FormatError, match=re.escape(message)):
        list(fmt.read(backend, "s.arrow", expected=foreign))
    assert fmt.requests == []
