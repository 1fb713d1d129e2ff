"""Pieces every format shares: the part-writing loop, ShardInfo assembly, read checks."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar

import pyarrow as pa

from de_store.backends.location import Location
from de_store.errors import DeStoreError, FormatError

from ._stream import (
    check_crc,
    check_frame,
    check_read,
    check_size,
    crc32c_combine,
    read_exact,
)
from .base import (
    ByteRange,
    FileInfo,
    Key,
    PartInfo,
    SchemaInfo,
    ShardInfo,
)
from .batches import conform, key_range, split

if TYPE_CHECKING:
    from de_store.backends import Backend

#: Writes one part and returns its byte range in each file of the shard.
PartWriter = Callable[[pa.RecordBatch], tuple[ByteRange, ...]]
#: Parts read and decoded ahead of the one being returned, in background threads.
READ_AHEAD = 2
#: Bytes a part has at least to be read by position (see :class:`PartReader`): a smaller
#: one is read through the file's stream, whose read-ahead serves small parts better, and
#: the whole pages a positional read takes would be a larger share of its bytes.
POSITIONAL_READ_BYTES = 1 << 20

T = TypeVar("T")
R = TypeVar("R")


def write_parts(
    write_part: PartWriter,
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    buffer_size: int,
    where: str,
    prepare: Callable[[pa.RecordBatch], None] | None = None,
    written_range: Callable[[pa.RecordBatch], tuple[Any, Any] | None] | None = None,
) -> list[PartInfo]:
    """Split each batch at ``buffer_size`` rows, write each piece as a part, describe them.

    ``prepare``, when given, is called with each piece :data:`PREPARE_AHEAD` parts before
    it is written (a writer starting work in the background, such as compression).
    ``written_range``, when given, answers the smallest and largest key of the piece just
    written when the writer found them already (a Parquet writer's column statistics), else
    None: they are then computed here."""
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    parts: list[PartInfo] = []
    row_offset = 0
    pieces = (
        piece for batch in batches for piece in split(_conformed(batch, schema, where), buffer_size)
    )
    for piece in pieces if prepare is None else _prepared_ahead(pieces, prepare):
        ranges = write_part(piece)
        found = None if written_range is None else written_range(piece)
        low, high = _key_range(piece.column(0), found)
        parts.append(PartInfo(piece.num_rows, row_offset, low, high, ranges))
        row_offset += piece.num_rows
    return parts


#: Parts a writer's ``prepare`` sees before the one being written (see write_parts).
PREPARE_AHEAD = 2


def _prepared_ahead(
    pieces: Iterator[pa.RecordBatch], prepare: Callable[[pa.RecordBatch], None]
) -> Iterator[pa.RecordBatch]:
    """``pieces``, each passed to ``prepare`` :data:`PREPARE_AHEAD` pieces before its turn
    (and the first ones at once)."""
    waiting: collections.deque[pa.RecordBatch] = collections.deque()
    for piece in pieces:
        prepare(piece)
        waiting.append(piece)
        if len(waiting) > PREPARE_AHEAD:
            yield waiting.popleft()
    yield from waiting


def _conformed(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """:func:`~.batches.conform`, answered at once for a batch that already has ``schema``
    and no null anywhere in its columns' buffers (slices of one batch the saver built)."""
    if batch.schema.equals(schema, check_metadata=True) and not any(
        map(_may_hold_nulls, batch.columns)
    ):
        return batch
    return conform(batch, schema, where)


def _may_hold_nulls(column: pa.Array) -> bool:
    if pa.types.is_fixed_size_list(column.type):  # ``values``: the whole unsliced child
        return column.null_count > 0 or column.values.null_count > 0
    return column.null_count > 0


def _key_range(keys: pa.Array, found: tuple[Any, Any] | None = None) -> tuple[Key, Key]:
    """:func:`~.batches.key_range`; integer keys through numpy (no compute kernel call), or
    from ``found``, their smallest and largest as a writer found them."""
    if len(keys) and pa.types.is_integer(keys.type) and not keys.null_count:
        if found is None:
            values = keys.to_numpy(zero_copy_only=True)
            found = values.min(), values.max()
        return int(found[0]), int(found[1])
    return key_range(keys)


def shard_info(
    format_name: str,
    path: str,
    schema_info: SchemaInfo,
    parts: Sequence[PartInfo],
    files: Sequence[FileInfo],
) -> ShardInfo:
    """Assemble the :class:`ShardInfo` of a finished write."""
    crc = files[0].crc32c
    for f in files[1:]:
        crc = crc32c_combine(crc, f.crc32c, f.bytes)
    keys = [p for p in parts if p.rows]
    return ShardInfo(
        path=path,
        format=format_name,
        rows=sum(p.rows for p in parts),
        bytes=sum(f.bytes for f in files),
        crc32c=crc,
        min_key=min((p.min_key for p in keys), default=None),  # type: ignore[type-var]
        max_key=max((p.max_key for p in keys), default=None),  # type: ignore[type-var]
        columns=schema_info.columns,
        parts=tuple(parts),
        files=tuple(files),
        schema=schema_info,
    )


def wanted_parts(parts: Sequence[int] | None, count: int, where: str) -> list[int]:
    """The part indices to read (all by default); ValueError naming a bad index."""
    if parts is None:
        return list(range(count))
    bad = [i for i in parts if not 0 <= i < count]
    if bad:
        raise ValueError(f"{where} has {count} parts (0..{count - 1}); cannot read parts {bad}")
    return list(parts)


def read_frame(
    backend: Backend,
    path: str,
    expected: ShardInfo,
    file_index: int = 0,
    f: BinaryIO | None = None,
) -> tuple[bytes, bytes]:
    """Check size, read the header and footer of a file and verify them with its crc32c.

    Returns ``(head, tail)``: the bytes before the first part and after the last one. With
    ``f`` (the file, open for reading at offset 0) the header is read from it, so that a
    streamed read goes on from there to the parts, and the size is the one the open file
    knows (its end): two requests fewer on an object store, which answered the size when
    the file was opened.
    """
    where = Location(backend, path).url
    file = expected.files[file_index]
    check_size(where, file.bytes, backend.size(path) if f is None else _size_of(f))
    ranges = [p.ranges[file_index] for p in expected.parts]
    head_end = ranges[0].offset if ranges else file.bytes
    tail_start = ranges[-1].end if ranges else file.bytes
    tail = backend.read_range(path, tail_start, file.bytes)
    head = backend.read_range(path, 0, head_end) if f is None else read_exact(f, head_end, where)
    check_frame(where, file, ranges, head, tail)
    return head, tail


def _size_of(f: BinaryIO) -> int:
    """The size of the open file ``f`` (its end), left at offset 0."""
    size = f.seek(0, 2)
    f.seek(0)
    return size


class PartReader:
    """One open file of a shard, whose parts threads fetch in a set order and check.

    Parts are decoded by several threads, but each fetch waits for its turn, so the
    backend's streamed read (and its read-ahead on object stores) sees sequential reads.
    A file that reads by position (a local file's ``read_at``) has its parts of
    :data:`POSITIONAL_READ_BYTES` or more read by the threads at once, each part's turn
    passing as its read starts, into buffers of Arrow's memory pool: the pool hands the
    memory of parts already used to the next ones (its pages first touched once, not once
    a part), and frees a buffer only once no array decoded in place from it is left.
    """

    def __init__(self, f: BinaryIO, where: str) -> None:
        self._f = f
        self._where = where
        self._turn = 0
        self._cond = threading.Condition()
        self._read_at: Callable[[memoryview, int], int] | None = getattr(f, "read_at", None)

    def fetch(self, turn: int, r: ByteRange) -> bytes | pa.Buffer:
        """Bytes ``r`` once fetches ``0 .. turn - 1`` are done, or started where the file
        reads by position (unchecked).

        The turn passes on even when the read fails, so later parts never wait forever.
        """
        read_at = self._read_at if r.length >= POSITIONAL_READ_BYTES else None
        with self._cond:
            self._cond.wait_for(lambda: self._turn == turn)
            if read_at is not None:
                self._turn += 1
                self._cond.notify_all()
            else:
                try:
                    self._f.seek(r.offset)
                    return read_exact(self._f, r.length, self._where)
                finally:
                    self._turn += 1
                    self._cond.notify_all()
        return self._read_positioned(read_at, r)

    def _read_positioned(
        self, read_at: Callable[[memoryview, int], int], r: ByteRange
    ) -> pa.Buffer:
        """Bytes ``r``, read with the file's alignment (``read_alignment``) into a buffer
        of Arrow's memory pool."""
        align: int = self._f.read_alignment  # type: ignore[attr-defined]
        start = r.offset - r.offset % align
        end = -(-r.end // align) * align
        buffer = pa.allocate_buffer(end - start + align)
        pad = -buffer.address % align
        found = read_at(memoryview(buffer)[pad : pad + end - start], start) - (r.offset - start)
        check_read(self._where, r.length, min(max(found, 0), r.length))
        return buffer.slice(pad + r.offset - start, r.length)

    def read(self, turn: int, r: ByteRange, what: str) -> bytes | pa.Buffer:
        """:meth:`fetch`, then check the bytes against ``r.crc32c``."""
        data = self.fetch(turn, r)
        check_crc(self._where, what, r.crc32c, data)
        return data


def read_together(
    readers: Sequence[PartReader], turn: int, ranges: Sequence[ByteRange], what: str
) -> list[bytes | pa.Buffer]:
    """One part's bytes from each of its files, each checked against its crc32c.

    Every reader's turn is taken before any check or error, so threads reading later parts
    of the other files never wait for a turn that would not come.
    """
    fetched: list[bytes | pa.Buffer] = []
    failure: BaseException | None = None
    for reader, r in zip(readers, ranges, strict=True):
        try:
            fetched.append(reader.fetch(turn, r))
        except BaseException as err:
            failure = failure or err
            fetched.append(b"")
    if failure is not None:
        raise failure
    for reader, r, data in zip(readers, ranges, fetched, strict=True):
        check_crc(reader._where, what, r.crc32c, data)
    return fetched


def map_ahead(
    fn: Callable[[T], R],
    items: Iterable[T],
    depth: int = READ_AHEAD,
    name: str = "read",
    *,
    limit: int | None = None,
    size: Callable[[R], int] | None = None,
) -> Generator[R, None, None]:
    """``map(fn, items)`` in order, computed ahead of the caller by ``depth`` threads
    (named ``de_store-{name}``), which also draw ``items``: one at a time, in order.

    Reading (I/O) and decoding (Arrow releases the GIL) of the next parts then overlap
    with the caller's use of the current one. Ahead of the caller are at most ``depth``
    results; with ``limit``, results of at most ``limit`` bytes (``size(result)``) wait
    done instead, the one the caller needs next always: a generator given as ``items``
    (``fn`` returning its item) is then run in one thread, ahead by bytes.

    An error of a call, or of drawing an item, is raised at that item's place, after the
    results before it.

    Closing the iterator early stops the drawing (it waits for an item being drawn, then
    closes ``items``) and returns without waiting for the running calls, whose results
    are dropped: an iterator the caller abandoned is closed by the garbage collector, in
    whichever thread it runs, possibly one that holds a lock of :mod:`threading` a
    thread needs to end, so it joins only threads that run no call.
    """
    ahead = _Ahead(fn, items, depth, limit, size)
    threads = [
        threading.Thread(target=ahead.work, name=f"de_store-{name}", daemon=True)
        for _ in range(depth)
    ]
    for thread in threads:
        thread.start()
    try:
        while (result := ahead.take()) is not _END:
            yield result  # type: ignore[misc]
    finally:
        ahead.stop(threads)


#: What :meth:`_Ahead.take` returns once every result was taken.
_END = object()


class _Ahead(Generic[T, R]):
    """What the threads of :func:`map_ahead` and its caller share: the items drawn
    (``drawn``) and taken (``taken``), the results done, by index, and their bytes."""

    def __init__(
        self,
        fn: Callable[[T], R],
        items: Iterable[T],
        depth: int,
        limit: int | None,
        size: Callable[[R], int] | None,
    ) -> None:
        self._fn, self._source = fn, iter(items)
        self._depth, self._limit, self._size = depth, limit, size
        self._cond = threading.Condition()
        self._drawing = threading.Lock()  # one draw at a time, in order
        self._done: dict[int, tuple[object, BaseException | None, int]] = {}
        self._calling: set[threading.Thread] = set()
        self._drawn = self._taken = self._held = 0
        self._end: int | None = None  # items drawn in all, once ``items`` ended or failed
        self._stopped = self._source_closed = False

    def work(self) -> None:
        """A thread's loop: draw an item, call ``fn`` on it, hand the result over."""
        try:
            while (drawn := self._draw()) is not None:
                self._put(drawn[0], *self._call(drawn[1]))
        finally:
            self._close_source()

    def _draw(self) -> tuple[int, T] | None:
        """The next item and its index; None once stopped or ``items`` ended."""
        with self._drawing:
            with self._cond:
                self._cond.wait_for(self._may_draw)
                if self._stopped or self._end is not None:
                    return None
            index = self._drawn
            try:
                item = next(self._source)
            except BaseException as err:  # StopIteration: the end; else raised at ``index``
                with self._cond:
                    ended = isinstance(err, StopIteration)
                    self._end = index if ended else index + 1
                    if not ended:
                        self._done[index] = (None, err, 0)
                    self._cond.notify_all()
                return None
            with self._cond:
                if self._stopped:
                    return None
                self._drawn += 1
                self._calling.add(threading.current_thread())
        return index, item

    def _may_draw(self) -> bool:
        ahead = self._drawn - self._taken
        return self._stopped or self._limit is not None or ahead < self._depth

    def _call(self, item: T) -> tuple[object, BaseException | None, int]:
        try:
            result = self._fn(item)
            return result, None, self._size(result) if self._size is not None else 0
        except BaseException as err:  # handed to the caller
            return None, err, 0
        finally:
            with self._cond:
                self._calling.discard(threading.current_thread())

    def _put(self, index: int, result: object, error: BaseException | None, nbytes: int) -> None:
        """Hand result ``index`` over once there is room for its bytes."""
        limit = self._limit
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._stopped
                    or limit is None
                    or index == self._taken
                    or self._held + nbytes <= limit
                )
            )
            if self._stopped:
                return
            self._done[index] = (result, error, nbytes)
            self._held += nbytes
            self._cond.notify_all()

    def take(self) -> object:
        """The next result in order (its error raised), :data:`_END` after the last."""
        with self._cond:
            self._cond.wait_for(lambda: self._taken in self._done or self._taken == self._end)
            if self._taken not in self._done:
                return _END
            result, error, nbytes = self._done.pop(self._taken)
            self._taken += 1
            self._held -= nbytes
            self._cond.notify_all()
        if error is not None:
            raise error
        return result

    def stop(self, threads: list[threading.Thread]) -> None:
        """Stop drawing, drop the results, wait for the threads that run no call."""
        with self._cond:
            self._stopped = True
            self._done.clear()
            calling = set(self._calling)
            self._cond.notify_all()
        for thread in threads:
            if thread is not threading.current_thread() and thread not in calling:
                thread.join()

    def _close_source(self) -> None:
        with self._drawing:
            if self._source_closed:
                return
            self._source_closed = True
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


def check_rows(where: str, part: int, expected: int, found: int) -> None:
    """FormatError when a decoded part has another row count than recorded."""
    if expected != found:
        raise FormatError(f"part {part} of {where}: expected {expected} rows, found {found}")


def check_columns(where: str, schema: pa.Schema, expected: SchemaInfo | None) -> None:
    """FormatError unless the file has ``key`` and ``value`` (and ``expected``'s columns)."""
    found = [(f.name, f.type) for f in schema]
    if expected is not None:
        wanted = [(f.name, f.type) for f in expected.arrow_schema()]
        if found != wanted:
            raise FormatError(f"{where}: expected columns {wanted}, found {found}")
    elif schema.get_field_index("key") < 0 or schema.get_field_index("value") < 0:
        raise FormatError(
            f"{where} is not a de_store shard: no 'key' and 'value' columns in {schema.names}"
        )


@contextlib.contextmanager
def decoding(where: str) -> Iterator[None]:
    """Turn a decoder's error (Arrow, Parquet, OS) into a FormatError naming the file."""
    try:
        yield
    except DeStoreError:
        raise
    except (pa.ArrowException, OSError, EOFError) as err:
        raise FormatError(f"cannot decode {where}: {type(err).__name__}: {err}") from err
