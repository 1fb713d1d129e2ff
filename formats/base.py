"""The shard format contract and the records a format returns about what it wrote.

A :class:`ShardFormat` turns a stream of Arrow record batches (columns ``key``, ``value`` and
optional extra columns of the same rows) into one shard on a :class:`~de_store.backends.Backend`
and back. Writing returns a :class:`ShardInfo`: rows, bytes, crc32c checksums, key range and
one :class:`PartInfo` per part (each input batch, split at ``buffer_size`` rows, is one part:
a Parquet row group, an Arrow IPC record batch, a row range of a binary pair). A reader given
that ``ShardInfo`` verifies every byte it decodes and can read only some parts.

Checksums
---------
``FileInfo.crc32c`` is the crc32c of a whole file. Each part also records the crc32c of its
byte range in every file. The bytes before the first part (header) and after the last part
(footer) are read in full on every verified read and checked, together with the recorded
part checksums, against the file's crc32c; each part read is checked against its own
crc32c before it is decoded. A full read therefore verifies every byte of every file; a read
of some parts verifies the header, the footer and those parts.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa

from de_store.backends.location import Location
from de_store.errors import FormatError

from ._schema import FORMAT_VERSION, ExtraColumn, Key, SchemaInfo, column_row_bytes
from .batches import select, split

if TYPE_CHECKING:
    from de_store.backends import Backend

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "FORMAT_VERSION",
    "ByteRange",
    "ExtraColumn",
    "FileInfo",
    "Key",
    "PartInfo",
    "SchemaInfo",
    "ShardFormat",
    "ShardInfo",
]

#: Rows per part on write and at most per batch on read, unless told otherwise.
DEFAULT_BUFFER_SIZE = 65536
#: About the bytes of a part the saver writes when not told how many rows a part has
#: (:func:`part_rows`).
PART_BYTES = 16 << 20


def part_rows(info: SchemaInfo) -> int:
    """Rows per part of a shard of ``info`` when the writer chooses: the multiple of
    :data:`DEFAULT_BUFFER_SIZE` rows (at least one) whose bytes (uncompressed,
    :func:`~de_store.formats._schema.column_row_bytes`) come nearest :data:`PART_BYTES`;
    :data:`DEFAULT_BUFFER_SIZE` for string keys, whose bytes vary.

    Every part costs the writer the same work besides its bytes (its batch, pages,
    frames and checksums, each a step of Python), and a compressed save's codec threads
    wait for that work: the thread writing a 10M x 16 zstd shard used 0.12 s of CPU in
    parts of 65,536 rows (4.5 MiB) and 0.045 s in parts of 16 MiB, and the save ran at
    0.65x-0.77x and 0.87x-0.93x the uncompressed save's speed (docs/benchmarks.md, *Fewer
    bytes*).
    """
    if info.key_dtype == "string":
        return DEFAULT_BUFFER_SIZE
    row_bytes = sum(column_row_bytes(info))
    return DEFAULT_BUFFER_SIZE * max(1, round(PART_BYTES / (DEFAULT_BUFFER_SIZE * row_bytes)))


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """A part's bytes in one file: ``[offset, offset + length)`` and their crc32c."""

    offset: int
    length: int
    crc32c: int

    @property
    def end(self) -> int:
        """Offset one past the last byte."""
        return self.offset + self.length


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """One part of a shard (row group, record batch, row range).

    Attributes
    ----------
    rows:
        Rows in the part.
    row_offset:
        Index of the part's first row in the shard.
    min_key, max_key:
        Smallest and largest key (None for an empty part).
    ranges:
        The part's bytes in each of :attr:`ShardInfo.files`, in the same order.
    """

    rows: int
    row_offset: int
    min_key: Key
    max_key: Key
    ranges: tuple[ByteRange, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartInfo:
        """Inverse of ``dataclasses.asdict``."""
        ranges = tuple(ByteRange(**r) for r in data["ranges"])
        return cls(**{**data, "ranges": ranges})


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One file of a shard: backend path, size in bytes and crc32c of its content."""

    path: str
    bytes: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a :meth:`ShardFormat.write` wrote; goes into the checkpoint manifest.

    Attributes
    ----------
    path:
        The path given to ``write`` (for ``binary``, the prefix of the ``-keys``/``-values``
        pair).
    format:
        Format name (``"parquet"``, ``"arrow"``, ``"binary"``).
    rows:
        Rows written.
    bytes:
        Bytes of all files together.
    crc32c:
        crc32c of the files' contents concatenated in order (the file's crc32c when there
        is one file).
    min_key, max_key:
        Smallest and largest key (None when empty).
    columns:
        Column names written.
    parts:
        One entry per part, in file order.
    files:
        Every file written, with its own size and crc32c.
    schema:
        The :class:`SchemaInfo` the shard was written with.
    """

    path: str
    format: str
    rows: int
    bytes: int
    crc32c: int
    min_key: Key
    max_key: Key
    columns: tuple[str, ...]
    parts: tuple[PartInfo, ...]
    files: tuple[FileInfo, ...]
    schema: SchemaInfo

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardInfo:
        """Inverse of :meth:`to_dict`."""
        return cls(
            **{
                **data,
                "columns": tuple(data["columns"]),
                "parts": tuple(PartInfo.from_dict(p) for p in data["parts"]),
                "files": tuple(FileInfo(**f) for f in data["files"]),
                "schema": SchemaInfo.from_dict(data["schema"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """What :meth:`ShardFormat.read` asks of a format's own read steps.

    Attributes
    ----------
    parts:
        Indices of the parts to read, in that order; None: all.
    columns:
        The columns the caller keeps (None: all). A hint: ``read`` selects them from
        what the step yields.
    buffer_size:
        Most rows per batch the caller gets. A hint: ``read`` cuts what the step yields.
    """

    parts: Sequence[int] | None = None
    columns: list[str] | None = None
    buffer_size: int = DEFAULT_BUFFER_SIZE


class ShardFormat(abc.ABC):
    """A way to lay out a shard's rows in files on a backend.

    Implementations stream: they hold the batch in hand plus at most ``buffer_size`` rows,
    whatever the shard's size.
    """

    #: Registry name.
    name: ClassVar[str]
    #: Suggested file name suffix (".parquet", ".arrow", "" for binary).
    suffix: ClassVar[str]
    #: The codec this instance writes with ("none": rows stored at their full width).
    compression: str = "none"
    #: The codecs the format offers (its constructor takes ``compression`` and
    #: ``compression_level`` when there is more than "none").
    compressions: ClassVar[tuple[str, ...]] = ("none",)
    #: Bytes every file of the format holds before its first part (its magic number).
    header_bytes: ClassVar[int] = 0

    @classmethod
    def file_name_ends(cls) -> str:
        """A regular expression for what each file of a shard adds to the path ``write``
        was given: ``re.escape(suffix)`` for a format of one file per shard.

        ``de-store gc`` recognises a save's shard files by it (a format writing several
        files, such as ``binary`` with one per column, says so here), so cleanup knows
        every file a format writes, whatever its columns.
        """
        return re.escape(cls.suffix)

    def min_part_bytes(self, schema: SchemaInfo, rows: int) -> int:
        """The fewest bytes, over all its files, that a part of ``rows`` rows of ``schema``
        takes in this format as this instance writes it.

        Uncompressed: the rows at fixed width (see
        :func:`~de_store.formats._schema.column_row_bytes`); compressed: one bit a row,
        since every row holds a distinct key.
        """
        if self.compression != "none":
            return (rows + 7) // 8
        return rows * sum(column_row_bytes(schema))

    def part_size_problem(
        self, schema: SchemaInfo, rows: int, lengths: Sequence[int]
    ) -> str | None:
        """What is wrong with a part recorded as ``rows`` rows in byte ranges of
        ``lengths`` (one per file), or None: a manifest's row counts are checked by it
        before anything is sized from them."""
        least = self.min_part_bytes(schema, rows)
        if sum(lengths) < least:
            return (
                f"{rows} rows in {sum(lengths)} bytes: a {self.name} part of {rows} rows "
                f"takes at least {least} bytes"
            )
        return None

    @abc.abstractmethod
    def write(
        self,
        backend: Backend,
        path: str,
        batches: Iterable[pa.RecordBatch],
        *,
        schema_info: SchemaInfo,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> ShardInfo:
        """Write ``batches`` as one shard at ``path`` and describe what was written.

        Parameters
        ----------
        backend:
            Where to write.
        path:
            Path of the shard, relative to the backend's root.
        batches:
            Record batches with the columns of ``schema_info`` (see ``batches``).
        schema_info:
            Variable name, dim, dtypes and extra columns.
        buffer_size:
            Each batch is split into parts of at most this many rows.

        Raises
        ------
        FormatError
            A batch does not match ``schema_info``, or the format cannot store it.
        """

    def read(
        self,
        backend: Backend,
        path: str,
        *,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        columns: Sequence[str] | None = None,
        parts: Sequence[int] | None = None,
        expected: ShardInfo | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Read a shard back as record batches of at most ``buffer_size`` rows.

        The format's own steps are :meth:`read_verified` (given ``expected``, once it is
        known to describe a shard of this format) and :meth:`read_unverified`; their
        batches are then cut to ``columns`` and ``buffer_size``.

        Parameters
        ----------
        backend, path:
            Where the shard is.
        buffer_size:
            Most rows per yielded batch.
        columns:
            Columns to return (default: all), in the order given.
        parts:
            Indices of the parts to read (default: all), in the order given.
        expected:
            What ``write`` returned. When given, sizes, row counts, schema and crc32c
            checksums are verified before rows are returned.

        Raises
        ------
        ChecksumError
            A checksum does not match the one recorded in ``expected``.
        FormatError
            The file is truncated, foreign, or does not match ``expected``.
        """
        where = Location(backend, path).url
        names = list(columns) if columns is not None else None
        request = ReadRequest(parts, names, buffer_size)
        if expected is None:
            batches = self.read_unverified(backend, path, request)
        else:
            check_expected(expected, self.name, where)
            batches = self.read_verified(backend, path, expected, request)
        yield from rebatch(batches, buffer_size, names, where)

    @abc.abstractmethod
    def read_verified(
        self, backend: Backend, path: str, expected: ShardInfo, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        """The rows of the parts ``request`` names of the shard ``expected`` describes,
        each byte checked against the crc32c recorded there before it is decoded."""

    def read_unverified(
        self, backend: Backend, path: str, request: ReadRequest
    ) -> Iterator[pa.RecordBatch]:
        """The rows of the parts ``request`` names of a shard read without its
        ``ShardInfo``: for formats whose files record their schema. This default refuses.

        Raises
        ------
        ValueError
            The format needs ``expected`` to read the shard.
        """
        raise ValueError(
            f"{self.name} shard {Location(backend, path).url} records no schema: pass "
            "expected=<its ShardInfo>"
        )


def location(backend: Backend, path: str) -> str:
    """``path`` as a URL on ``backend``, for messages: ``Location(backend, path).url``."""
    return Location(backend, path).url


def check_expected(expected: ShardInfo, format_name: str, where: str) -> None:
    """FormatError when ``expected`` describes a shard of another format."""
    if expected.format != format_name:
        raise FormatError(
            f"{where}: expected describes a {expected.format!r} shard, read as {format_name!r}"
        )


def rebatch(
    batches: Iterable[pa.RecordBatch], buffer_size: int, columns: Sequence[str] | None, where: str
) -> Iterator[pa.RecordBatch]:
    """Select ``columns`` and cut batches to at most ``buffer_size`` rows."""
    names = list(columns) if columns is not None else None
    for batch in batches:
        yield from split(select(batch, names, where), buffer_size)
