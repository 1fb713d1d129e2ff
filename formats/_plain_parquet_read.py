"""Reading the files of de_store's Parquet writer (:mod:`._plain_parquet`) in place: each
column chunk one PLAIN page (decompressed first when compressed) whose levels are the runs
that writer writes, its values Arrow arrays over the bytes read. Any other file or page is
left to Arrow's reader (:class:`NotPlain`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ._plain_parquet import _DATA_PAGE, _PLAIN, CREATED_BY, _levels
from ._thrift import ThriftError, read_struct

#: A column chunk's codec as pyarrow names it (LZ4_RAW: "LZ4") -> Arrow's codec that
#: decodes its pages.
_CODEC_NAMES = {"UNCOMPRESSED": "none", "ZSTD": "zstd", "LZ4": "lz4_raw"}


class NotPlain(Exception):
    """A row group this reader does not decode (Arrow's reader does it instead)."""


def written_here(metadata: Any) -> bool:
    """Whether a Parquet footer (``pyarrow.parquet.FileMetaData``) is this writer's."""
    return bool(metadata.created_by == CREATED_BY.decode())


def decode_row_group(
    data: pa.Buffer, offset: int, metadata: Any, index: int, schema: pa.Schema
) -> pa.RecordBatch:
    """Row group ``index`` of a file this writer wrote, from its bytes ``data`` (which start
    at file offset ``offset``), as a batch of ``schema``'s columns, without copying.

    Each column chunk must be one PLAIN page with the levels this writer writes;
    :class:`NotPlain` otherwise.
    """
    group = metadata.row_group(index)
    rows = group.num_rows
    names = [group.column(j).path_in_schema.split(".")[0] for j in range(group.num_columns)]
    arrays = []
    for field in schema:
        if field.name not in names:
            raise NotPlain(field.name)
        chunk = group.column(names.index(field.name))
        start = chunk.data_page_offset - offset
        codec = _CODEC_NAMES.get(chunk.compression)
        if codec is None or start < 0:
            raise NotPlain(field.name)
        body = _page_body(data, start, chunk.total_compressed_size, codec)
        arrays.append(_column(field.type, body, rows))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _column(type_: pa.DataType, body: pa.Buffer, rows: int) -> pa.Array:
    if not pa.types.is_fixed_size_list(type_):
        if body.size != rows * type_.bit_width // 8:
            raise NotPlain("size")
        return pa.Array.from_buffers(type_, rows, [None, body])
    width, leaf = type_.list_size, type_.value_type
    levels = _levels(rows, width)
    if body.size != len(levels) + rows * width * leaf.bit_width // 8:
        raise NotPlain("size")
    if body.slice(0, len(levels)) != pa.py_buffer(levels):
        raise NotPlain("levels")
    flat = pa.Array.from_buffers(leaf, rows * width, [None, body.slice(len(levels))])
    return pa.FixedSizeListArray.from_arrays(flat, type=type_)


def _page_body(data: pa.Buffer, start: int, chunk_size: int, codec: str = "none") -> pa.Buffer:
    """The body of the one data page making up a column chunk at ``start``, decompressed
    with ``codec``."""
    header = memoryview(data).cast("B")[start : start + min(chunk_size, 256)]
    try:
        fields, end = read_struct(header, 0)
    except ThriftError as err:
        raise NotPlain(f"page header: {err}") from err
    plain_size, size = fields.get(2), fields.get(3)
    if fields.get(1) != _DATA_PAGE or (codec == "none" and plain_size != size):
        raise NotPlain("page type or compression")
    page = fields.get(5)
    if not isinstance(size, int) or end + size != chunk_size or not isinstance(page, dict):
        raise NotPlain("one page a chunk")
    if page.get(2) != _PLAIN or not isinstance(plain_size, int):
        raise NotPlain("encoding")
    body = data.slice(start + end, size)
    if codec == "none":
        return body
    return pa.Codec(codec).decompress(body, decompressed_size=plain_size)
