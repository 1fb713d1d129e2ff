"""Parquet shards: one row group per part, readable by any Parquet reader.

Columns are ``key``, ``value`` (``fixed_size_list<value dtype>[dim]``) and the extra
columns; the file's key-value metadata holds ``de_store.variable``, ``de_store.dim``,
``de_store.key_dtype``, ``de_store.value_dtype``, ``de_store.shard_id`` and
``de_store.format_version`` (plus Arrow's own ``ARROW:schema``, so the fixed-size lists and
the bfloat16 field metadata come back as written). Dictionary encoding is off (keys are
unique, values are noise) and statistics are written for ``key`` only.

Plain pyarrow reads a shard, or a whole variable from its folder of shards::

    import pyarrow.parquet as pq, pyarrow.dataset as ds
    table = pq.read_table("ckpt/emb/shard-00000.parquet")
    table = ds.dataset("ckpt/emb/", format="parquet").to_table()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from de_store.backends.location import Location
from de_store.errors import FormatError

from ._plain_parquet import CODECS as PLAIN_CODECS
from ._plain_parquet import PlainParquetWriter, supports
from ._plain_parquet_read import NotPlain, decode_row_group, written_here
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
from ._stream import ChecksummingWriter, SparseFile
from .base import DEFAULT_BUFFER_SIZE, FileInfo, ReadRequest, SchemaInfo, ShardFormat, ShardInfo

if TYPE_CHECKING:
    from de_store.backends import Backend

MAGIC = b"PAR1"
COMPRESSIONS = ("none", "snappy", "zstd", "lz4")


class ParquetFormat(ShardFormat):
    """Parquet shards.

    Parameters
    ----------
    compression:
        ``"none"`` (default), ``"snappy"``, ``"zstd"`` or ``"lz4"``.
    compression_level:
        Codec level for zstd (None: the codec's default).
    """

    name = "parquet"
    suffix = ".parquet"
    header_bytes = 4  # PAR1
    compressions = COMPRESSIONS

    def __init__(
        self, compression: str | None = "none", compression_level: int | None = None
    ) -> None:
        compression = compression or "none"
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"parquet compression must be one of {COMPRESSIONS}, got {compression!r}"
            )
        self.compression = compression
        self.compression_level = compression_level

    def _writer(
        self, sink: ChecksummingWriter, schema: pa.Schema
    ) -> pq.ParquetWriter | PlainParquetWriter:
        if self.compression in PLAIN_CODECS and supports(schema):
            return PlainParquetWriter(
                sink, schema, ["key"], self.compression, self.compression_level
            )
        return pq.ParquetWriter(
            sink,
            schema,
            compression=self.compression,
            compression_level=self.compression_level,
            use_dictionary=False,
            write_statistics=["key"],
            store_schema=True,
        )

    def write(
        self,
        backend: Backend,
        path: str,
        batches: Iterable[pa.RecordBatch],
        *,
        schema_info: SchemaInfo,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> ShardInfo:
        schema = schema_info.arrow_schema()
        where = Location(backend, path).url
        with backend.open_write(path) as raw:
            sink = ChecksummingWriter(raw)
            writer = self._writer(sink, schema)
            sink.cut()  # the header ("PAR1") is written on open

            def write_part(batch: pa.RecordBatch) -> tuple:
                writer.write_batch(batch, row_group_size=batch.num_rows)
                return (sink.cut(),)

            try:
                plain = isinstance(writer, PlainParquetWriter)
                parts = write_parts(
                    write_part, batches, schema, buffer_size, where,
                    prepare=writer.prepare if plain else None,
                    written_range=writer.key_range if plain else None,
                )  # fmt: skip
            finally:
                writer.close()
        files = [FileInfo(path, sink.position, sink.crc32c)]
        return shard_info(self.name, path, schema_info, parts, files)

    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_verified(backend, path, expected, request)

    def read_unverified(
        self, backend: Backend, path: str, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        return _read_unverified(backend, path, request)


def _metadata(where: str, tail: bytes) -> pq.FileMetaData:
    """Parse the footer (everything after the last row group) of a Parquet file."""
    if tail[-4:] != MAGIC:
        raise FormatError(f"{where} is not a Parquet file: it ends with {tail[-4:]!r}")
    with decoding(where):
        return pq.read_metadata(pa.py_buffer(MAGIC + tail))


def _checked_metadata(where: str, tail: bytes, expected: ShardInfo) -> pq.FileMetaData:
    """The footer's metadata, once its columns and row groups match ``expected``."""
    metadata = _metadata(where, tail)
    check_columns(where, metadata.schema.to_arrow_schema(), expected.schema)
    if metadata.num_row_groups != len(expected.parts):
        raise FormatError(
            f"{where}: expected {len(expected.parts)} row groups, found {metadata.num_row_groups}"
        )
    return metadata


def _read_verified(
    backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
) -> Iterator[pa.RecordBatch]:
    parts, columns, buffer_size = request.parts, request.columns, request.buffer_size
    where = Location(backend, path).url
    with backend.open_read(path) as f:
        head, tail = read_frame(backend, path, expected, f=f)
        if head[:4] != MAGIC:
            raise FormatError(f"{where} is not a Parquet file: it starts with {head[:4]!r}")
        if not expected.parts:
            return
        metadata = _checked_metadata(where, tail, expected)
        size, footer_at = expected.files[0].bytes, expected.parts[-1].ranges[0].end
        reader = PartReader(f, where)
        plain = written_here(metadata)
        schema = expected.schema.arrow_schema()
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)

        def read(job: tuple[int, int]) -> list[pa.RecordBatch]:
            turn, i = job
            part = expected.parts[i]
            r = part.ranges[0]
            data = reader.read(turn, r, f"part {i}")
            if plain:  # our own writer's pages: decoded in place, no Arrow reader
                try:
                    batch = decode_row_group(pa.py_buffer(data), r.offset, metadata, i, schema)
                except NotPlain:
                    pass
                else:
                    check_rows(where, i, part.rows, batch.num_rows)
                    return [batch]
            sparse = SparseFile(size, where)  # one per part: parts decode in parallel
            sparse.put(footer_at, tail)
            sparse.put(r.offset, data)
            with decoding(where):
                file = pq.ParquetFile(sparse, metadata=metadata)
                table = file.read_row_group(i, columns=columns, use_threads=False)
            check_rows(where, i, part.rows, table.num_rows)
            return table.to_batches(max_chunksize=buffer_size)

        jobs = enumerate(wanted_parts(parts, len(expected.parts), where))
        for batches in map_ahead(read, jobs):
            yield from batches


def _read_unverified(backend: Backend, path: str, request: ReadRequest) -> Iterator[pa.RecordBatch]:
    parts, columns, buffer_size = request.parts, request.columns, request.buffer_size
    where = Location(backend, path).url
    with backend.open_read(path) as f:
        if f.read(4) != MAGIC:
            raise FormatError(f"{where} is not a Parquet file: bad magic at its start")
        f.seek(0)
        with decoding(where):
            reader = pq.ParquetFile(f)
        check_columns(where, reader.schema_arrow, None)
        groups = wanted_parts(parts, reader.num_row_groups, where)
        with decoding(where):
            batches = reader.iter_batches(
                batch_size=buffer_size, row_groups=groups, columns=columns, use_threads=False
            )
            yield from batches
