"""Arrow IPC file format (Feather v2): the fastest path to restore.

One file, one record batch per part, uncompressed by default so that a reader can
memory-map it (``pyarrow.ipc.open_file(pyarrow.memory_map(path))``) and use the values
without copying. lz4 or zstd buffer compression is optional.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from de_store.backends.location import Location
from de_store.errors import FormatError

from ._shard import (
    PartReader,
    check_columns,
    check_rows,
    decoding,
    map_ahead,
    read_frame,
    shard_info,
    wanted_parts,
    write_parts,
)
from ._stream import ChecksummingWriter
from .base import DEFAULT_BUFFER_SIZE, FileInfo, ReadRequest, SchemaInfo, ShardFormat, ShardInfo

if TYPE_CHECKING:
    from de_store.backends import Backend

MAGIC = b"ARROW1"
COMPRESSIONS = ("none", "lz4", "zstd")


def _header_length(schema: pa.Schema, options: pa.ipc.IpcWriteOptions) -> int:
    """Bytes an IPC file holds before its first record batch (magic, padding, schema)."""
    sink = pa.BufferOutputStream()
    pa.ipc.new_stream(sink, schema, options=options).close()
    end_of_stream = 8
    return 8 + sink.getvalue().size - end_of_stream


class ArrowFormat(ShardFormat):
    """Arrow IPC file shards.

    Parameters
    ----------
    compression:
        ``"none"`` (default, memory-mappable without copies), ``"lz4"`` or ``"zstd"``.
    compression_level:
        Codec level (None: the codec's default).
    """

    name = "arrow"
    suffix = ".arrow"
    header_bytes = 8  # ARROW1 and two bytes of padding
    compressions = COMPRESSIONS

    def __init__(
        self, compression: str | None = "none", compression_level: int | None = None
    ) -> None:
        compression = compression or "none"
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"arrow compression must be one of {COMPRESSIONS}, got {compression!r}"
            )
        self.compression = compression
        self.compression_level = compression_level

    def _options(self) -> pa.ipc.IpcWriteOptions:
        if self.compression == "none":
            return pa.ipc.IpcWriteOptions(compression=None)
        codec = pa.Codec(self.compression, compression_level=self.compression_level)
        return pa.ipc.IpcWriteOptions(compression=codec)

    def write(
        self,
        backend: Backend,
        path: str,
        batches: Iterable[pa.RecordBatch],
        *,
        schema_info: SchemaInfo,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> ShardInfo:
        schema, options = schema_info.arrow_schema(), self._options()
        where = Location(backend, path).url
        with backend.open_write(path) as raw:
            sink = ChecksummingWriter(raw)
            sink.cut_at(_header_length(schema, options))
            with pa.ipc.new_file(sink, schema, options=options) as writer:

                def write_part(batch: pa.RecordBatch) -> tuple:
                    writer.write_batch(batch)
                    return (sink.cut(),)

                parts = write_parts(write_part, batches, schema, buffer_size, where)
        files = [FileInfo(path, sink.position, sink.crc32c)]
        return shard_info(self.name, path, schema_info, parts, files)

    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_verified(backend, path, request.parts, expected)

    def read_unverified(
        self, backend: Backend, path: str, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_unverified(backend, path, request.parts)


def _check_magic(where: str, head: bytes) -> None:
    if head[: len(MAGIC)] != MAGIC:
        raise FormatError(f"{where} is not an Arrow IPC file: it starts with {head[:8]!r}")


def _read_verified(
    backend: Backend, path: str, parts: Sequence[int] | None, expected: ShardInfo
) -> Iterator[pa.RecordBatch]:
    where = Location(backend, path).url
    head, _ = read_frame(backend, path, expected)
    _check_magic(where, head)
    schema = expected.schema.arrow_schema()
    if expected.parts:
        with decoding(where):
            check_columns(where, pa.ipc.read_schema(pa.py_buffer(head[8:])), expected.schema)

    with backend.open_read(path) as f:
        reader = PartReader(f, where)

        def read(job: tuple[int, int]) -> pa.RecordBatch:
            turn, i = job
            part = expected.parts[i]
            data = reader.read(turn, part.ranges[0], f"part {i}")
            with decoding(where):
                message = pa.ipc.read_message(pa.py_buffer(data))
                batch = pa.ipc.read_record_batch(message, schema)
            check_rows(where, i, part.rows, batch.num_rows)
            return batch

        yield from map_ahead(read, enumerate(wanted_parts(parts, len(expected.parts), where)))


def _read_unverified(
    backend: Backend, path: str, parts: Sequence[int] | None
) -> Iterator[pa.RecordBatch]:
    where = Location(backend, path).url
    with backend.open_read(path) as f:
        _check_magic(where, f.read(8))
        f.seek(0)
        with decoding(where):
            reader = pa.ipc.open_file(f)
        check_columns(where, reader.schema, None)
        for i in wanted_parts(parts, reader.num_record_batches, where):
            with decoding(where):
                batch = reader.get_batch(i)
            yield batch
