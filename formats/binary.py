"""Raw binary shards: a ``-keys`` file and a ``-values`` file, TFRA's FileSystemSaver layout.

No header, no metadata: ``{path}-keys`` holds the keys as raw little-endian integers and
``{path}-values`` the values as raw little-endian numbers, ``dim`` a row, row k belonging to
key k. Each extra column (an optimizer slot, say ``adam_m``) is one more such file,
``{path}-adam_m``, in the schema's order. Dim and dtypes live only in the
:class:`ShardInfo` (the manifest), so reading needs ``expected``. Only integer keys are
stored: string keys raise :class:`FormatError`. :mod:`de_store.formats.tfra` reads and
writes whole TFRA folders with the key and value files of this layout.

A shard's files are plain arrays, so a writer that is not Python can produce them: a
table on a parameter server writes them with TensorFlow ops where it lives
(:mod:`de_store.saver.device_shards`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from de_store.backends.location import Location
from de_store.errors import FormatError

from ._schema import PACKED_DTYPES
from ._shard import (
    PartReader,
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
    """Little-endian numpy dtype for a de_store dtype name (bfloat16 as its uint16 bits; a
    packed dtype as its elements')."""
    name = PACKED_DTYPES.get(name, name)
    return np.dtype("<u2" if name == "bfloat16" else name).newbyteorder("<")


#: Characters an extra column's name may hold: it becomes part of a file name.
_COLUMN_NAME = re.compile(r"[A-Za-z0-9_.]+")


def column_paths(path: str, schema_info: SchemaInfo) -> list[str]:
    """The files of a binary shard at ``path``: keys, values, then one per extra column
    (each name ends as :meth:`BinaryFormat.file_name_ends` says: :func:`check_storable`
    refuses a column name that would not)."""
    return [path + KEYS_SUFFIX, path + VALUES_SUFFIX] + [
        f"{path}-{extra.name}" for extra in schema_info.extras
    ]


def check_storable(schema_info: SchemaInfo, where: str) -> None:
    """FormatError when the binary layout cannot hold ``schema_info``'s rows."""
    if schema_info.key_dtype == "string":
        raise FormatError(
            f"binary shard {where} stores integer keys only: got key_dtype='string'; "
            "use the parquet or arrow format"
        )
    for extra in schema_info.extras:
        if not _COLUMN_NAME.fullmatch(extra.name) or extra.name in ("keys", "values"):
            raise FormatError(
                f"binary shard {where}: extra column {extra.name!r} cannot name a file "
                "(expected letters, digits, '_' and '.', not 'keys' or 'values')"
            )


def _raw(array: pa.Array, dtype: np.dtype) -> np.ndarray:
    """The values of a numeric (fixed_size_list, or packed rows) Arrow array as
    little-endian numpy."""
    if pa.types.is_fixed_size_binary(array.type):
        start, length = array.offset * array.type.byte_width, len(array) * array.type.byte_width
        return np.frombuffer(array.buffers()[1], np.uint8, count=length, offset=start)
    if pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


class BinaryFormat(ShardFormat):
    """Raw little-endian ``-keys``/``-values`` file pairs (TFRA 0.8.1's layout)."""

    name = "binary"
    suffix = ""

    @classmethod
    def file_name_ends(cls) -> str:
        """``-keys``, ``-values`` and ``-{column}`` (see :func:`column_paths`)."""
        return f"-{_COLUMN_NAME.pattern}"

    def write(
        self,
        backend: Backend,
        path: str,
        batches: Iterable[pa.RecordBatch],
        *,
        schema_info: SchemaInfo,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> ShardInfo:
        where = Location(backend, path).url
        check_storable(schema_info, where)
        dtypes = [numpy_dtype(d) for d, _ in column_layout(schema_info)]
        paths = column_paths(path, schema_info)
        with contextlib.ExitStack() as stack:
            sinks = [ChecksummingWriter(stack.enter_context(backend.open_write(p))) for p in paths]

            def write_part(batch: pa.RecordBatch) -> tuple:
                for column, sink, dtype in zip(batch.columns, sinks, dtypes, strict=True):
                    sink.write(_raw(column, dtype))
                return tuple(sink.cut() for sink in sinks)

            parts = write_parts(write_part, batches, schema_info.arrow_schema(), buffer_size, where)
        files = [FileInfo(p, s.position, s.crc32c) for p, s in zip(paths, sinks, strict=True)]
        return shard_info(self.name, path, schema_info, parts, files)

    def part_size_problem(
        self, schema: SchemaInfo, rows: int, lengths: Sequence[int]
    ) -> str | None:
        """Each file holds a part's rows at exactly their width: anything else is damage."""
        widths = [numpy_dtype(d).itemsize * n for d, n in column_layout(schema)]
        if list(lengths) != [rows * w for w in widths]:
            return (f"{rows} rows in byte ranges of {list(lengths)} bytes: a binary part "
                    f"of {rows} rows takes {[rows * w for w in widths]}")  # fmt: skip
        return None

    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_verified(backend, expected, request.parts)

    def read_unverified(
        self, backend: Backend, path: str, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        raise ValueError(
            f"binary shard {Location(backend, path).url} records no dim or dtypes: pass "
            "expected=<its ShardInfo>, or use de_store.formats.tfra.read_table for TFRA folders"
        )


def _read_verified(
    backend: Backend, expected: ShardInfo, parts: Sequence[int] | None
) -> Iterator[pa.RecordBatch]:
    files = expected.files
    for file in files:
        check_size(Location(backend, file.path).url, file.bytes, backend.size(file.path))
    indices = wanted_parts(parts, len(expected.parts), Location(backend, expected.path).url)
    schema = expected.schema.arrow_schema()

    with contextlib.ExitStack() as stack:
        readers = [
            PartReader(
                stack.enter_context(backend.open_read(f.path)), Location(backend, f.path).url
            )
            for f in files
        ]

        def read(job: tuple[int, int]) -> pa.RecordBatch:
            turn, i = job
            raw = read_together(readers, turn, expected.parts[i].ranges, f"part {i}")
            return decode_columns(raw, schema)

        yield from map_ahead(read, enumerate(indices))
    if indices == list(range(len(expected.parts))):
        # Every byte was checked against its part's crc32c; the parts' crc32c combined
        # must then give each whole file's.
        for j, file in enumerate(files):
            found = 0
            for part in expected.parts:
                found = crc32c_combine(found, part.ranges[j].crc32c, part.ranges[j].length)
            check_crc_value(Location(backend, file.path).url, file.crc32c, found)


def column_layout(schema_info: SchemaInfo) -> list[tuple[str, int]]:
    """``(dtype, values a row)`` of each file of a binary shard, in file order."""
    return [(schema_info.key_dtype, 1), (schema_info.value_dtype, schema_info.dim)] + [
        (e.dtype, e.width or 1) for e in schema_info.extras
    ]


def decode_pair(keys: bytes, values: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """A batch from raw key bytes and value bytes (sizes already checked), zero-copy."""
    return decode_columns([keys, values], schema)


def decode_columns(raw: Sequence[bytes], schema: pa.Schema) -> pa.RecordBatch:
    """A batch from the raw bytes of each column of ``schema`` (sizes already checked),
    zero-copy."""
    rows = len(raw[0]) // (schema.field("key").type.bit_width // 8)
    arrays = [_decode(data, field.type, rows) for data, field in zip(raw, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _decode(data: bytes, type_: pa.DataType, rows: int) -> pa.Array:
    if not pa.types.is_fixed_size_list(type_):
        return pa.Array.from_buffers(type_, rows, [None, pa.py_buffer(data)])
    width = type_.list_size
    flat = pa.Array.from_buffers(type_.value_type, rows * width, [None, pa.py_buffer(data)])
    return pa.FixedSizeListArray.from_arrays(flat, width)
