"""A direct Parquet writer for shards of fixed-width columns, uncompressed, zstd or lz4.

Arrow's Parquet writer spends much of a shard's write building and RLE-encoding one
repetition and one definition level per element of a ``fixed_size_list`` column
(docs/benchmarks.md, Costs behind the code). For the columns de_store writes those
levels are known in advance: every element is present (definition level 1 throughout)
and every row holds exactly ``width`` elements (repetition levels ``0, 1, ..., 1`` per
row). This writer emits them as two precomputed runs and the values as PLAIN bytes taken
straight from the Arrow buffers, one version-1 data page per column and row group (split
when a page would pass :data:`PAGE_BYTES`), then the footer Thrift-encoded by hand
(:mod:`._thrift`). The file is the one Arrow writes in every respect a reader sees: the
same Parquet schema, ``ARROW:schema`` and key-value metadata, key statistics and column
orders.

:func:`supports` says which schemas it takes: integer keys, float32/float64/int32/int64
and float16 value and extra columns (lists or not) and ``fixed_size_binary`` ones (the
rows of values stored at a lower precision, packed), all non-null. float16 and
``fixed_size_binary`` are Parquet's FIXED_LEN_BYTE_ARRAY (float16 with its FLOAT16 logical
type), as Arrow writes them. The others (string keys, lists of 8- and 16-bit integers,
which Parquet widens to 32 bits) go through Arrow's writer.

With ``compression="zstd"`` or ``"lz4"`` each page (its levels and values) is compressed
with Arrow's codec (lz4: Parquet's LZ4_RAW); the levels cost no more than uncompressed,
so the codec is all a compressed save adds. The codec runs in background threads, beside
the writes: :meth:`PlainParquetWriter.prepare` starts compressing a batch's pages before
its turn comes (the format prepares the next parts while it writes one). The codec
threads run at a lower priority (:data:`CODEC_NICE`): the cores go first to the thread
writing the file, its crc32c and the disk's helper, and to a training loop beside an
async save; compression takes the time they leave, and the disk is not left waiting for
a thread the codec pushed aside. Each codec thread keeps to its own share of the cores
(:func:`de_store._threads.keep_apart`): at their low priority the system would otherwise
let two of them share a core while another idles. A zstd page is compressed as frames
side by side, one after the other in the page (the levels, then the values in frames of
at least :data:`FRAME_BYTES`): a zstd stream may hold several frames, and every zstd
decoder (Arrow's, DuckDB's) reads them as one. A raw LZ4 page is one block: its pages,
and those of the parts prepared ahead, are compressed side by side.

The codec thread that compresses a frame also sums its crc32c, while the frame is still in
that core's cache; the stream combines it into the part's and the file's checksums
(``ChecksummingWriter.write_summed``) instead of reading the frame again. Where the sink
writes straight to the disk (``direct_alignment``: a local file opened ``O_DIRECT``), each
zstd frame of :data:`JOIN_BYTES` or more starts at an offset of that alignment, after a
zstd *skippable frame* of padding where needed (a magic number, a length, that many zero
bytes: every zstd decoder steps over it, and it decompresses to nothing), so the sink
hands the frame to the disk from the codec's memory rather than copying it into its own
buffers (``hand_over``). The padding costs at most one alignment (4 KiB) and 7 bytes a
frame of 1 MiB or more; other sinks (object stores, memory) get the frames without it.
"""

from __future__ import annotations

import base64
import functools
import math
import os
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from de_store._threads import LazyPool

from ._crc32c import crc32c
from ._thrift import (
    BINARY,
    I16,
    I32,
    I64,
    LIST,
    STRUCT,
    binary,
    list_,
    struct,
    varint,
    zigzag,
)

#: Largest data page written; a bigger row group gets several pages (of whole rows).
PAGE_BYTES = 64 << 20
#: Pieces of a row group smaller than this together are joined into one write.
JOIN_BYTES = 1 << 20
MAGIC = b"PAR1"
CREATED_BY = b"de_store plain parquet writer"

# Parquet enums (parquet.thrift).
_PHYSICAL = {pa.int32(): 1, pa.int64(): 2, pa.float32(): 4, pa.float64(): 5}
#: FIXED_LEN_BYTE_ARRAY: a ``fixed_size_binary`` column (each row's bytes, PLAIN: one after
#: the other) and float16 (2 bytes, with the FLOAT16 logical type), as Arrow stores them.
_FIXED_LEN = 7
_REQUIRED, _REPEATED = 0, 2
_CONVERTED_LIST = 3
_PLAIN, _RLE = 0, 3
_DATA_PAGE = 0
#: Uncompressed bytes of a page compressed as one zstd frame, at least: a bigger page is
#: cut into as many frames as threads compress them (:data:`_CODEC_THREADS`).
FRAME_BYTES = 1 << 20
#: Threads compressing pages: one for each core the process may run on, at most 4.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_CODEC_THREADS = max(1, min(4, _CORES or 1))
#: How much lower the compressing threads run than the thread that started them (nice
#: steps, Linux): a frame can wait, the file's writes and the user's training cannot.
CODEC_NICE = 10
#: Codecs this writer and reader handle -> Parquet's CompressionCodec. ``"lz4"`` is
#: LZ4_RAW (one LZ4 block a page), as Arrow's writer writes it: the format deprecated its
#: Hadoop-framed LZ4.
CODECS = {"none": 0, "zstd": 6, "lz4": 7}
#: Arrow's codec of each of ``CODECS``.
_ARROW_CODECS = {"zstd": "zstd", "lz4": "lz4_raw"}


def supports(schema: pa.Schema) -> bool:
    """Whether every column of ``schema`` is a fixed-width type this writer encodes."""
    return all(not field.nullable and _physical(field.type) is not None for field in schema)


def _physical(type_: pa.DataType) -> int | None:
    """The Parquet physical type of a column of ``type_`` (None: not written here)."""
    leaf = _leaf_type(type_)
    if leaf == pa.float16() or pa.types.is_fixed_size_binary(leaf):
        return _FIXED_LEN
    return _PHYSICAL.get(leaf)


def _leaf_type(type_: pa.DataType) -> pa.DataType:
    if pa.types.is_fixed_size_list(type_):
        if type_.value_field.nullable:
            return pa.null()
        return type_.value_type
    return type_


# -- levels ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _repetition_period(width: int) -> tuple[int, bytes]:
    """``(rows, packed)``: the bit-packed repetition levels of the fewest whole rows of
    ``width`` elements that fill whole bytes; every longer run repeats them."""
    rows = 8 // math.gcd(width, 8)
    bits = np.ones(rows * width, dtype=bool)
    bits[::width] = False
    return rows, np.packbits(bits, bitorder="little").tobytes()


@functools.lru_cache(maxsize=4)
def _levels(rows: int, width: int) -> bytes:
    """Length-prefixed repetition then definition levels of ``rows`` full lists (the same
    for every part of a shard but its last: the few latest are kept).

    Repetition: one bit-packed run (bit width 1) of ``0`` then ``width - 1`` ones per row.
    Definition: one RLE run of ``rows * width`` ones.
    """
    values = rows * width
    period_rows, period = _repetition_period(width)
    groups = (values + 7) // 8
    packed = (period * -(-rows // period_rows))[:groups]
    if values % 8:  # the bits past the last value are zero
        packed = packed[:-1] + bytes([packed[-1] & ((1 << values % 8) - 1)])
    repetition = varint(groups << 1 | 1) + packed
    definition = varint(values << 1) + b"\x01"
    return b"".join(len(block).to_bytes(4, "little") + block for block in (repetition, definition))


class Sink(Protocol):
    """Where the file goes: anything with ``write``."""

    def write(self, data: Any) -> int: ...


# -- columns ---------------------------------------------------------------------------
@dataclass
class _Chunk:
    """One column's pages in one row group, as the footer describes them."""

    offset: int
    size: int
    values: int
    statistics: bytes | None
    #: Bytes of its pages uncompressed (headers included).
    uncompressed: int = 0


def _raw_values(array: pa.Array) -> memoryview:
    """The little-endian bytes of a non-null fixed-width (list) array, without copying."""
    if pa.types.is_fixed_size_list(array.type):  # its rows of the unsliced child
        width = array.type.list_size
        array = array.values.slice(array.offset * width, len(array) * width)
    if pa.types.is_fixed_size_binary(array.type):  # numpy has no dtype of its rows
        size, data = array.type.byte_width, array.buffers()[1]
        if data is None:
            return memoryview(b"")
        return memoryview(data.slice(array.offset * size, len(array) * size)).cast("B")
    return memoryview(array.to_numpy(zero_copy_only=True)).cast("B")


def _pages(column: pa.Array) -> list[tuple[int, bytes, memoryview]]:
    """The data pages of ``column`` in one row group: ``(rows, levels, values' bytes)``,
    one a :data:`PAGE_BYTES` of whole rows (one page for an empty column)."""
    width = column.type.list_size if pa.types.is_fixed_size_list(column.type) else None
    data = _raw_values(column)
    row_bytes = data.nbytes // max(len(column), 1)
    rows_per_page = max(1, PAGE_BYTES // max(row_bytes, 1))
    pages = []
    for first in range(0, len(column), rows_per_page) or range(1):
        rows = min(rows_per_page, len(column) - first)
        levels = _levels(rows, width) if width is not None else b""
        pages.append((rows, levels, data[first * row_bytes : (first + rows) * row_bytes]))
    return pages


#: A compressed frame or block, and its crc32c.
_Frame = tuple[memoryview, int]
#: A page of a column chunk: its rows, levels and values' bytes, and the frames of its
#: compressed bytes being compressed (``None``: written uncompressed).
_Page = tuple[int, bytes, memoryview, list[Future[_Frame]] | None]
#: The first bytes of a zstd skippable frame (little-endian; any of 0x184D2A50-5F), and the
#: bytes before its content (the magic and a 4-byte length).
_SKIPPABLE_MAGIC = (0x184D2A50).to_bytes(4, "little")
_SKIPPABLE_HEAD = 8

_CODEC_POOL = LazyPool(_CODEC_THREADS, "de_store-codec", nice=CODEC_NICE, apart=True)


def _compress_frames(codec: Any, levels: bytes, body: memoryview) -> list[Future[_Frame]]:
    """The page ``levels + body`` being compressed by the codec threads: zstd's as the
    levels, then the values cut into frames of :data:`FRAME_BYTES` or more, as many as
    threads; a raw LZ4 page as one block (its pages and the next parts' are compressed
    side by side)."""
    if codec.name != "zstd":
        page = (levels, body) if levels else (body,)
        return [_CODEC_POOL.submit(_compress, codec, *page)]
    frames = max(1, min(_CODEC_THREADS, body.nbytes // FRAME_BYTES))
    step = -(-body.nbytes // frames) if body.nbytes else 1
    pieces: list[Any] = [levels] if levels else []
    pieces += [body[i : i + step] for i in range(0, body.nbytes, step)] or [body]
    return [_CODEC_POOL.submit(_compress, codec, piece) for piece in pieces]


def _compress(codec: Any, *pieces: bytes | memoryview) -> _Frame:
    """``pieces`` joined and compressed as one frame or block, in a buffer of Arrow's
    memory pool (Arrow's codec lets go of the interpreter lock while it compresses), and
    its crc32c, summed while the frame is in this core's cache.

    Every buffer comes from the pool, the compressed frame and the joined page alike: the
    pool hands the memory of the frames a save has written to its next ones. A ``bytes``
    a frame comes from malloc, which hands freed blocks of this size back to the system,
    so each frame was written into pages new to the process, and first touches cost
    more than copying the frame (docs/benchmarks.md, *Fewer bytes*).
    """
    data: Any = pieces[0]
    if len(pieces) > 1:
        views = [memoryview(piece).cast("B") for piece in pieces]
        data = pa.allocate_buffer(sum(v.nbytes for v in views))
        joined, at = memoryview(data).cast("B"), 0
        for view in views:
            joined[at : at + view.nbytes] = view
            at += view.nbytes
    out = codec.compress(data, asbytes=False)
    # The slice: a resizable buffer's memoryview spans its capacity, not its size.
    frame = memoryview(out.slice(0, out.size)).cast("B")
    return frame, crc32c(frame)


def _skippable(size: int) -> bytes:
    """A zstd skippable frame of ``size`` bytes in all (at least :data:`_SKIPPABLE_HEAD`),
    its content zeros."""
    return (
        _SKIPPABLE_MAGIC
        + (size - _SKIPPABLE_HEAD).to_bytes(4, "little")
        + bytes(size - _SKIPPABLE_HEAD)
    )


def _page_header(size: int, values: int, compressed: int | None = None) -> bytes:
    data_page = struct(
        (1, I32, zigzag(values)),
        (2, I32, zigzag(_PLAIN)),
        (3, I32, zigzag(_RLE)),
        (4, I32, zigzag(_RLE)),
    )
    return struct(
        (1, I32, zigzag(_DATA_PAGE)),
        (2, I32, zigzag(size)),
        (3, I32, zigzag(size if compressed is None else compressed)),
        (5, STRUCT, data_page),
    )


def _min_max(array: pa.Array) -> tuple[np.generic, np.generic]:
    values = array.to_numpy(zero_copy_only=True)
    return values.min(), values.max()


def _statistics(low: np.generic, high: np.generic) -> bytes:
    return struct(
        (3, I64, zigzag(0)),  # null_count
        (5, BINARY, binary(high.tobytes())),  # max_value
        (6, BINARY, binary(low.tobytes())),  # min_value
    )


class PlainParquetWriter:
    """Write batches of ``schema`` (see :func:`supports`) as row groups of a Parquet file.

    The same calls as the part of :class:`pyarrow.parquet.ParquetWriter` the format uses:
    the magic is written on construction, :meth:`write_batch` writes one row group,
    :meth:`close` the footer. A row group's pages smaller than :data:`JOIN_BYTES` together
    go to the sink in one write (one crc32c and one system call per part, not six).
    """

    def __init__(
        self,
        sink: Sink,
        schema: pa.Schema,
        statistics: Iterable[str],
        compression: str = "none",
        compression_level: int | None = None,
    ) -> None:
        self._codec_id = CODECS[compression]
        self._codec = (
            None
            if compression == "none"
            else pa.Codec(_ARROW_CODECS[compression], compression_level)
        )
        self._sink = sink
        self._schema = schema
        self._statistics = set(statistics)
        self._position = 0
        self._row_groups: list[tuple[int, list[_Chunk]]] = []
        self._closed = False
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._column_meta = [self._column_meta_head(field) for field in schema]
        # The offsets big zstd frames start at (see the module's docstring); None: anywhere.
        self._alignment: int | None = (
            getattr(sink, "direct_alignment", None) if compression == "zstd" else None
        )
        # How the sink takes a frame with its crc32c (``write_summed``); None: it does not.
        self._write_summed = getattr(sink, "write_summed", None)
        # Batches being compressed ahead (:meth:`prepare`), by id: the batch and its frames.
        self._prepared: dict[int, tuple[pa.RecordBatch, list[list[_Page]]]] = {}
        # The batch written last, and the (min, max) of each of its columns with statistics.
        self._written: pa.RecordBatch | None = None
        self._ranges: dict[str, tuple[np.generic, np.generic]] = {}
        self._write(MAGIC)
        self._flush()

    def _write(self, data: bytes | memoryview) -> None:
        size = len(data) if isinstance(data, bytes) else data.nbytes
        if self._pending_bytes + size > JOIN_BYTES:
            self._flush()
        if size >= JOIN_BYTES:
            self._sink.write(data)
        else:
            self._pending.append(data)
            self._pending_bytes += size
        self._position += size

    def _flush(self) -> None:
        if self._pending:
            pending = self._pending
            self._sink.write(pending[0] if len(pending) == 1 else b"".join(pending))
            self._pending, self._pending_bytes = [], 0

    def prepare(self, batch: pa.RecordBatch) -> None:
        """Start compressing the pages of ``batch`` in the background, for the
        :meth:`write_batch` of it that comes later (nothing to do uncompressed)."""
        if self._codec is not None and id(batch) not in self._prepared:
            # The batch is held until written: its id stays its own.
            self._prepared[id(batch)] = (batch, self._paged(batch))

    def write_batch(self, batch: pa.RecordBatch, row_group_size: int | None = None) -> None:
        """Write ``batch`` as one row group (``row_group_size`` is ignored: one per batch)."""
        prepared = self._prepared.pop(id(batch), None)
        pages = self._paged(batch) if prepared is None else prepared[1]
        self._written, self._ranges = batch, {}
        chunks = [
            self._write_column(field, column, column_pages)
            for field, column, column_pages in zip(self._schema, batch.columns, pages, strict=True)
        ]
        self._flush()
        self._row_groups.append((batch.num_rows, chunks))

    def key_range(self, batch: pa.RecordBatch) -> tuple[np.generic, np.generic] | None:
        """The smallest and largest key of ``batch`` (its first column), as its statistics
        hold them, when ``batch`` is the batch written last and its keys got statistics;
        None otherwise. Spares the part's key range a second pass over the keys
        (``_shard.write_parts``)."""
        if batch is not self._written:
            return None
        return self._ranges.get(self._schema[0].name)  # the keys, as the columns were written

    def _paged(self, batch: pa.RecordBatch) -> list[list[_Page]]:
        """The pages of each column of ``batch``, their frames being compressed when the
        writer has a codec."""
        codec = self._codec

        def page(rows: int, levels: bytes, body: memoryview) -> _Page:
            frames = None if codec is None else _compress_frames(codec, levels, body)
            return rows, levels, body, frames

        return [[page(*p) for p in _pages(column)] for column in batch.columns]

    def _write_column(self, field: pa.Field, column: pa.Array, pages: list[_Page]) -> _Chunk:
        width = column.type.list_size if pa.types.is_fixed_size_list(column.type) else None
        start, uncompressed = self._position, 0
        for rows, levels, body, compressing in pages:
            size = len(levels) + body.nbytes
            if compressing is None:
                header = _page_header(size, rows * (width or 1))
                self._write(header + levels)
                self._write(body)
            else:
                frames = [frame.result() for frame in compressing]
                header, pads = self._compressed_page_head(size, rows * (width or 1), frames)
                self._write(header)
                for pad, (frame, crc) in zip(pads, frames, strict=True):
                    if pad:
                        self._write(_skippable(pad))
                    self._write_frame(frame, crc)
            uncompressed += len(header) + size
        stats = None
        if field.name in self._statistics and len(column):
            low, high = _min_max(column)
            stats = _statistics(low, high)
            self._ranges[field.name] = (low, high)
        values = len(column) * (width or 1)
        return _Chunk(start, self._position - start, values, stats, uncompressed)

    def _compressed_page_head(
        self, size: int, values: int, frames: list[_Frame]
    ) -> tuple[bytes, list[int]]:
        """The header of a compressed page of ``frames``, written next, and the padding
        before each frame (a skippable frame's bytes; 0: none) that starts each big one at
        an offset of :attr:`_alignment`. The header holds the page's compressed size, the
        padding included, and the padding depends on where the header ends: the two are
        settled together (the header's length changes only where that size's varint
        takes one byte more); a page where they do not settle is written without
        padding."""
        body = sum(frame.nbytes for frame, _ in frames)
        header = _page_header(size, values, body)
        if self._alignment is None:
            return header, [0] * len(frames)
        for _ in range(3):
            pads = self._pads(self._position + len(header), frames)
            again = _page_header(size, values, body + sum(pads))
            if len(again) == len(header):
                return again, pads
            header = again
        return _page_header(size, values, body), [0] * len(frames)

    def _pads(self, start: int, frames: list[_Frame]) -> list[int]:
        """The padding before each of ``frames``, written from file offset ``start`` on."""
        align, pads, at = self._alignment or 1, [], start
        for frame, _ in frames:
            pad = 0
            if frame.nbytes >= JOIN_BYTES:
                pad = -at % align
                if pad and pad < _SKIPPABLE_HEAD:  # a skippable frame is no shorter
                    pad += align
            pads.append(pad)
            at += pad + frame.nbytes
        return pads

    def _write_frame(self, frame: memoryview, crc: int) -> None:
        """Write a compressed frame whose crc32c the codec thread summed: a big one on its
        own, its crc32c combined into the sink's rather than summed again where the sink
        takes it (``write_summed``); a small one joined with the writes around it."""
        if frame.nbytes < JOIN_BYTES or self._write_summed is None:
            self._write(frame)
            return
        self._flush()
        self._write_summed(frame, crc)
        self._position += frame.nbytes

    def close(self) -> None:
        """Write the footer (once)."""
        if self._closed:
            return
        self._closed = True
        footer = self._footer()
        self._write(footer + len(footer).to_bytes(4, "little") + MAGIC)
        self._flush()

    # -- footer ------------------------------------------------------------------------
    def _footer(self) -> bytes:
        metadata = dict(self._schema.metadata or {})
        metadata[b"ARROW:schema"] = base64.b64encode(self._schema.serialize().to_pybytes())
        key_values = [
            struct((1, BINARY, binary(k)), (2, BINARY, binary(v))) for k, v in metadata.items()
        ]
        type_order = struct((1, STRUCT, struct()))
        return struct(
            (1, I32, zigzag(2)),  # version
            (2, LIST, list_(STRUCT, self._schema_elements())),
            (3, I64, zigzag(sum(rows for rows, _ in self._row_groups))),
            (4, LIST, list_(STRUCT, [self._row_group(i) for i in range(len(self._row_groups))])),
            (5, LIST, list_(STRUCT, key_values)),
            (6, BINARY, binary(CREATED_BY)),
            (7, LIST, list_(STRUCT, [type_order] * len(self._schema))),
        )

    def _schema_elements(self) -> list[bytes]:
        def element(name: str, repetition: int, **extra: bytes) -> bytes:
            logical = (
                struct((3, STRUCT, struct())) if "list" in extra  # LIST
                else struct((15, STRUCT, struct())) if "float16" in extra  # FLOAT16
                else None
            )  # fmt: skip
            return struct(
                (1, I32, extra["type"]) if "type" in extra else None,
                (2, I32, extra["length"]) if "length" in extra else None,
                (3, I32, zigzag(repetition)),
                (4, BINARY, binary(name.encode())),
                (5, I32, extra["children"]) if "children" in extra else None,
                (6, I32, zigzag(_CONVERTED_LIST)) if "list" in extra else None,
                (10, STRUCT, logical) if logical is not None else None,
            )

        out = [struct((4, BINARY, binary(b"schema")), (5, I32, zigzag(len(self._schema))))]
        for field in self._schema:
            leaf = _leaf_type(field.type)
            physical = _physical(leaf)
            assert physical is not None  # supports(schema)
            typed = {"type": zigzag(physical)}
            if physical == _FIXED_LEN:
                typed["length"] = zigzag(leaf.byte_width)
                if leaf == pa.float16():
                    typed["float16"] = b""
            if pa.types.is_fixed_size_list(field.type):
                out.append(element(field.name, _REQUIRED, children=zigzag(1), list=b""))
                out.append(element("list", _REPEATED, children=zigzag(1)))
                out.append(element(field.type.value_field.name, _REQUIRED, **typed))
            else:
                out.append(element(field.name, _REQUIRED, **typed))
        return out

    def _path(self, field: pa.Field) -> list[bytes]:
        if pa.types.is_fixed_size_list(field.type):
            return [field.name.encode(), b"list", field.type.value_field.name.encode()]
        return [field.name.encode()]

    def _column_meta_head(self, field: pa.Field) -> bytes:
        """The fields 1 to 4 of a ColumnMetaData of ``field`` (the same in every row group),
        encoded as :func:`~._thrift.struct` encodes them, without its stop byte."""
        physical = _physical(field.type)
        assert physical is not None  # supports(schema)
        return struct(
            (1, I32, zigzag(physical)),
            (2, LIST, list_(I32, [zigzag(_RLE), zigzag(_PLAIN)])),
            (3, LIST, list_(BINARY, [binary(p) for p in self._path(field)])),
            (4, I32, zigzag(self._codec_id)),
        )[:-1]

    def _row_group(self, index: int) -> bytes:
        rows, chunks = self._row_groups[index]
        columns = []
        for head, chunk in zip(self._column_meta, chunks, strict=True):
            # fields 5 to 12 follow field 4: their ids go on from there (delta encoding)
            tail = struct(
                (5, I64, zigzag(chunk.values)),
                (6, I64, zigzag(chunk.uncompressed)),
                (7, I64, zigzag(chunk.size)),
                (9, I64, zigzag(chunk.offset)),
                (12, STRUCT, chunk.statistics) if chunk.statistics is not None else None,
                start=4,
            )
            columns.append(struct((2, I64, zigzag(0)), (3, STRUCT, head + tail)))
        first = chunks[0].offset
        size = sum(c.size for c in chunks)
        return struct(
            (1, LIST, list_(STRUCT, columns)),
            (2, I64, zigzag(sum(c.uncompressed for c in chunks))),
            (3, I64, zigzag(rows)),
            (5, I64, zigzag(first)),
            (6, I64, zigzag(size)),
            (7, I16, zigzag(index)),  # ordinal
        )
