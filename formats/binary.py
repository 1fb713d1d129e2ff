"""Raw binary shards: a ``-keys`` file and a ``-values`` file, TFRA's FileSystemSaver layout.

No header, no metadata: ``{path}-keys`` holds the keys as raw little-endian integers and
``{path}-values`` the values as raw little-endian numbers, ``dim`` a row, row k belonging to
key k. Dim and dtypes live only in the :class:`ShardInfo` (the manifest), so reading needs
``expected``. Only integer keys and the ``value`` column are stored: string keys and extra
columns raise :class:`FormatError`. :mod:`de_store.formats.tfra` reads and writes whole
TFRA folders with this layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from de_store.errors import FormatError

from ._shard import (
    PartReader,
    location,
    map_ahead,
    read_together,
    shard_info,
    wanted_parts,
    write_parts,
)
from ._stream import ChecksummingWriter, check_crc_value, check_size, crc32c_combine
from .base import DEFAULT_BUFFER_SIZE, FileInfo, ReadRequest, SchemaInfo, ShardFormat, ShardInfo

if TYPE_CHECKING:
    from de_store.backends import Backend

KEYS_SUFFIX = "-keys"
VALUES_SUFFIX = "-values"


def numpy_dtype(name: str) -> np.dtype:
    """Little-endian numpy dtype for a de_store dtype name (bfloat16 as its uint16 bits)."""
    return np.dtype("<u2" if name == "bfloat16" else name).newbyteorder("<")


def _check_storable(schema_info: SchemaInfo, where: str) -> None:
    if schema_info.key_dtype == "string" or schema_info.extras:
        raise FormatError(
            f"binary shard {where} stores integer keys and one value column only: "
            f"got key_dtype={schema_info.key_dtype!r}, extra columns "
            f"{[e.name for e in schema_info.extras]}; use the parquet or arrow format"
        )


def _raw(array: pa.Array, dtype: np.dtype) -> np.ndarray:
    """The values of a numeric (or fixed_size_list) Arrow array as little-endian numpy."""
    if pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


class BinaryFormat(ShardFormat):
    """Raw little-endian ``-keys``/``-values`` file pairs (TFRA 0.8.1's layout)."""

    name = "binary"
    suffix = ""

    def write(
        self,
        backend: Backend,
        path: str,
        batches: Iterable[pa.RecordBatch],
        *,
        schema_info: SchemaInfo,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> ShardInfo:
        where = location(backend, path)
        _check_storable(schema_info, where)
        key_dtype, value_dtype = (
            numpy_dtype(schema_info.key_dtype),
            numpy_dtype(schema_info.value_dtype),
        )
        keys_path, values_path = path + KEYS_SUFFIX, path + VALUES_SUFFIX
        with (
            backend.open_write(keys_path) as keys_raw,
            backend.open_write(values_path) as values_raw,
        ):
            keys_sink, values_sink = ChecksummingWriter(keys_raw), ChecksummingWriter(values_raw)

            def write_part(batch: pa.RecordBatch) -> tuple:
                keys_sink.write(_raw(batch.column(0), key_dtype))
                values_sink.write(_raw(batch.column(1), value_dtype))
                return keys_sink.cut(), values_sink.cut()

            parts = write_parts(write_part, batches, schema_info.arrow_schema(), buffer_size, where)
        files = [
            FileInfo(keys_path, keys_sink.position, keys_sink.crc32c),
            FileInfo(values_path, values_sink.position, values_sink.crc32c),
        ]
        return shard_info(self.name, path, schema_info, parts, files)

    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_verified(backend, expected, request.parts)

    def read_unverified(
        self, backend: Backend, path: str, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        raise ValueError(
            f"binary shard {location(backend, path)} records no dim or dtypes: pass "
            "expected=<its ShardInfo>, or use de_store.formats.tfra.read_table for TFRA folders"
        )


def _read_verified(
    backend: Backend, expected: ShardInfo, parts: Sequence[int] | None
) -> Iterator[pa.RecordBatch]:
    files = expected.files
    for file in files:
        check_size(location(backend, file.path), file.bytes, backend.size(file.path))
    indices = wanted_parts(parts, len(expected.parts), location(backend, expected.path))
    schema = expected.schema.arrow_schema()

    with backend.open_read(files[0].path) as keys_f, backend.open_read(files[1].path) as values_f:
        keys_reader = PartReader(keys_f, location(backend, files[0].path))
        values_reader = PartReader(values_f, location(backend, files[1].path))

        def read(job: tuple[int, int]) -> pa.RecordBatch:
            turn, i = job
            keys_range, values_range = expected.parts[i].ranges
            keys, values = read_together(
                (keys_reader, values_reader), turn, (keys_range, values_range), f"part {i}"
            )
            return decode_pair(keys, values, schema)

        yield from map_ahead(read, enumerate(indices))
    if indices == list(range(len(expected.parts))):
        # Every byte was checked against its part's crc32c; the parts' crc32c combined
        # must then give each whole file's.
        for j, file in enumerate(files):
            found = 0
            for part in expected.parts:
                found = crc32c_combine(found, part.ranges[j].crc32c, part.ranges[j].length)
            check_crc_value(location(backend, file.path), file.crc32c, found)


def decode_pair(keys: bytes, values: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """A batch from raw key bytes and value bytes (sizes already checked), zero-copy."""
    key_type = schema.field("key").type
    value_type: pa.FixedSizeListType = schema.field("value").type
    rows = len(keys) // (key_type.bit_width // 8)
    key_array = pa.Array.from_buffers(key_type, rows, [None, pa.py_buffer(keys)])
    flat = pa.Array.from_buffers(
        value_type.value_type, rows * value_type.list_size, [None, pa.py_buffer(values)]
    )
    value_array = pa.FixedSizeListArray.from_arrays(flat, value_type.list_size)
    return pa.RecordBatch.from_arrays([key_array, value_array], schema=schema)
