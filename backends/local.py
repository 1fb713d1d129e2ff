"""Local filesystem backend: temporary name, fsync, atomic rename.

A write goes to a hidden temporary file next to its final name (straight from the writer
to the disk where the filesystem takes ``O_DIRECT``, else flushed to disk in the
background while it is written), is fsynced, renamed over
the final name with ``os.replace`` and the directory is fsynced: after a crash a reader
sees either the old file or the complete new one, never a partial one.

A file open for reading also reads ranges by position (:meth:`LocalReadFile.read_at`),
straight from the disk into the caller's buffer where they are not in the page cache
(``O_DIRECT``): what a restore reads its parts with.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from de_store.errors import AlreadyExistsError

from ._direct_write import WRITE_ALIGNMENT, DirectFile, set_direct
from ._io import CountingFile
from .base import Capabilities, IOStats
from .fsspec_generic import FsspecBackend


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: str) -> None:
    """Make the content of file ``path`` durable, whichever process wrote it."""
    _fsync(path, os.O_RDONLY)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range(2)`` from the C library, or None where there is none:
    it starts the disk write of a byte range of a file and returns without waiting."""
    try:
        function = ctypes.CDLL(None).sync_file_range
    except (AttributeError, OSError, TypeError):  # not Linux's C library
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_WRITEBACK = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


class _SyncingFile(io.RawIOBase):
    """A file being written whose data goes to disk while it is written, so that the disk
    writes overlap with encoding and the final fsync finds little left to do.

    On Linux, the write-out of every ``writeback_every`` bytes starts as they are written
    (``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``: the pages are queued for the disk,
    the writer goes on; durability still comes from the final fsync). Elsewhere, every
    ``sync_every`` bytes an ``fdatasync`` starts in a helper thread (one at a time).
    """

    def __init__(self, raw: BinaryIO, sync_every: int, writeback_every: int) -> None:
        super().__init__()
        self._raw = raw
        self._written = 0
        self._started = 0  # bytes whose write-out has started, or been fdatasynced
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        if _WRITEBACK is not None:
            self._every = writeback_every
        else:
            self._every = sync_every
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="de_store-fsync")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        self._written += n
        if self._written - self._started >= self._every:
            if self._pool is None:
                self._raw.flush()
                size = self._written - self._started
                # Its result is not checked: the final fsync writes whatever it did not.
                _WRITEBACK(self._raw.fileno(), self._started, size, SYNC_FILE_RANGE_WRITE)
                self._started = self._written
            elif self._pending is None or self._pending.done():
                self._check()
                self._raw.flush()
                self._pending = self._pool.submit(os.fdatasync, self._raw.fileno())
                self._started = self._written
        return n

    def _check(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def sync(self) -> None:
        """Wait for the background flush, then flush and fsync everything."""
        self._check()
        self._raw.flush()
        os.fsync(self._raw.fileno())

    def close(self) -> None:
        """Stop the helper thread; the owner closes the underlying file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super().close()


#: What :meth:`LocalReadFile.read_at` asks of a buffer's address, its length and the offset
#: it is read from: the page size, as a direct write asks of its buffers.
READ_ALIGNMENT = WRITE_ALIGNMENT

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: Whether this system reads by position into a buffer (``preadv``): where not, files
#: open for reading have no ``read_at`` and their ranges are read by seeking.
POSITIONAL_READS = hasattr(os, "preadv")


class LocalReadFile(CountingFile):
    """A local file open for reading, which also reads ranges by position
    (:meth:`read_at`), from several threads at once.

    A restore reads each byte of a checkpoint once. Through the page cache the kernel
    first reads it into pages it takes for the cache, then copies it into the reader's
    buffer: CPU time that, on a machine of few cores, the restore's index build waits for,
    and on a virtual machine whose host takes free memory back, pages the host must hand
    out again first (``docs/benchmarks.md``, *Restore against reading and indexing*). With
    ``O_DIRECT`` the disk moves the bytes straight into the buffer, whose memory is reused
    from one part to the next.

    A range still in the page cache (a checkpoint written or read a moment ago) is read
    from it: its last page is asked for with ``RWF_NOWAIT``, which copies what the cache
    holds and never waits for the disk, through a handle whose read-ahead is off (a miss
    then reads that one page, not the next part's pages). Where the filesystem refuses
    ``O_DIRECT`` (its ``open`` fails, or a read fails with ``EINVAL``), or the file's name
    now leads to another file than the one open, every range is read through the page
    cache. The handles :meth:`read_at` opens are closed when the file is and no read is
    running on them, never under one.
    """

    #: See :data:`READ_ALIGNMENT`.
    read_alignment = READ_ALIGNMENT

    def __init__(self, raw: BinaryIO, stats: IOStats, where: str, path: str) -> None:
        super().__init__(raw, stats, where)
        self._raw_fd = raw.fileno()
        self._path = path
        self._size = os.fstat(self._raw_fd).st_size
        self._lock = threading.Lock()
        self._handles: tuple[int, int | None] | None = None  # (page cache, O_DIRECT)
        self._direct_refused = False
        self._running = 0
        self._released = False
        #: Ranges :meth:`read_at` read with ``O_DIRECT``, and through the page cache.
        self.direct_reads = self.cached_reads = 0

    def read_at(self, view: memoryview, offset: int) -> int:
        """Read bytes from ``offset`` on into ``view`` (writable; its address, its length
        and ``offset`` multiples of :data:`READ_ALIGNMENT`); return how many: fewer than
        ``len(view)`` only where the file ends first."""
        n: int = self._call("read", self._read_at, view, offset)
        self._stats.add_read(n)
        return n

    def _read_at(self, view: memoryview, offset: int) -> int:
        cached, direct = self._start()
        try:
            if direct is not None and not self._in_cache(cached, view, offset):
                try:
                    n = _pread_all(direct, view, offset, direct=True)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self._direct_refused = True
                else:
                    self._count(direct=True)
                    return n
            n = _pread_all(cached, view, offset, direct=False)
            self._count(direct=False)
            return n
        finally:
            self._end()

    def _start(self) -> tuple[int, int | None]:
        """The handles for one read (opened at the first), counted as in use."""
        with self._lock:
            if self._released:
                raise ValueError(f"read of {self._where} after it was closed")
            if self._handles is None:
                self._handles = _open_again(self._path, self._raw_fd)
            self._running += 1
            cached, direct = self._handles
            return cached, None if self._direct_refused else direct

    def _end(self) -> None:
        with self._lock:
            self._running -= 1
            closing = self._released and not self._running
        if closing:
            self._close_handles()

    def _count(self, *, direct: bool) -> None:
        with self._lock:
            if direct:
                self.direct_reads += 1
            else:
                self.cached_reads += 1

    def _in_cache(self, fd: int, view: memoryview, offset: int) -> bool:
        """Whether the page cache holds the last page of the range (read into ``view``,
        which the read then fills whole); False where the system cannot tell."""
        last = min(offset + len(view), self._size) - 1
        if last < offset:  # past the end: nothing to read either way
            return True
        if not _RWF_NOWAIT:
            return False
        page = last - last % READ_ALIGNMENT
        probe = view[page - offset : page - offset + READ_ALIGNMENT]
        try:
            return os.preadv(fd, [probe], page, _RWF_NOWAIT) > 0
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: this filesystem cannot tell
            return False

    def release(self) -> None:
        """Close the handles :meth:`read_at` opened, now or when its last running read
        ends (the owning backend closes the file itself)."""
        with self._lock:
            self._released = True
            closing = not self._running
        if closing:
            self._close_handles()

    def _close_handles(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, None
        for fd in handles or ():
            if fd is not None:
                os.close(fd)


def _open_again(path: str, fd: int) -> tuple[int, int | None]:
    """The file open as ``fd``, open again by its ``path``: for reads through the page
    cache with read-ahead off, and with ``O_DIRECT`` (None where refused). Where ``path``
    now leads to another file, a duplicate of ``fd`` and no ``O_DIRECT``."""
    cached = _open_same(path, fd, os.O_RDONLY)
    if cached is None:
        return os.dup(fd), None
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(cached, 0, 0, os.POSIX_FADV_RANDOM)
    return cached, _open_same(path, fd, os.O_RDONLY | _O_DIRECT) if _O_DIRECT else None


def _open_same(path: str, fd: int, flags: int) -> int | None:
    """``path`` open with ``flags``, if it can be and is still the file open as ``fd``."""
    try:
        opened = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    ours, found = os.fstat(fd), os.fstat(opened)
    if (ours.st_dev, ours.st_ino) != (found.st_dev, found.st_ino):
        os.close(opened)
        return None
    return opened


def _pread_all(fd: int, view: memoryview, offset: int, *, direct: bool) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
        if direct and done % READ_ALIGNMENT:  # a direct read ends unaligned at the end only
            break
    return done


def _temp_name(final: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.{uuid.uuid4().hex[:12]}.tmp")


class LocalBackend(FsspecBackend):
    """A directory on a local (POSIX) filesystem; see :class:`FsspecBackend`."""

    protocol = "file"
    capabilities = Capabilities(supports_atomic_rename=True, supports_fsync=True)
    #: Storage options are checked (see :mod:`.options`); none beyond LocalFileSystem's.
    storage_options_extra: tuple[str, ...] = ()
    #: Bytes of a streamed write between the starts of their write-out (Linux; see
    #: ``_SyncingFile``): small enough that the disk writes while the shard is encoded,
    #: big enough that a system call is rare (1 and 16 MiB saved a 1M x 16 shard more
    #: slowly here).
    writeback_every: int = 4 << 20
    #: Bytes written between background ``fdatasync`` calls of a streamed write, where
    #: there is no ``sync_file_range``.
    sync_every: int = 64 << 20
    #: Whether streamed writes go straight to the disk (``O_DIRECT``, Linux) where the
    #: filesystem takes it; see ``_direct_write.DirectFile``.
    direct_writes: bool = True
    #: Bytes of each buffer a direct write fills (a multiple of :data:`WRITE_ALIGNMENT`),
    #: and how many a file has: the disk writes one while the writer fills the next.
    direct_buffer_size: int = 4 << 20
    direct_buffers: int = 4

    def local_path(self, path: str) -> str | None:
        return self._full(path)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        final = self._full(path)
        with self._translating("write", path):
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = _temp_name(final)
            raw = open(tmp, "xb")  # noqa: SIM115  (closed below, after fsync)
        try:
            with raw, contextlib.closing(self._writer(raw, path)) as writer:
                yield self._counting(cast(BinaryIO, writer), path)
                with self._translating("write", path):
                    writer.sync()
            with self._translating("write", path):
                os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with self._translating("write", path):
            fsync_dir(os.path.dirname(final))

    def _writer(self, raw: BinaryIO, path: str) -> DirectFile | _SyncingFile:
        """What a file open for writing writes through: straight to the disk where
        :attr:`direct_writes` and the filesystem allow, else the page cache."""
        if self.direct_writes and _O_DIRECT:
            with self._translating("write", path):
                if set_direct(raw.fileno(), on=True):
                    return DirectFile(raw.fileno(), self.direct_buffer_size, self.direct_buffers)
        return _SyncingFile(raw, self.sync_every, self.writeback_every)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        with self._translating("read", path):
            raw = open(full, "rb")  # noqa: SIM115
        with raw:
            if not POSITIONAL_READS:
                yield self._counting(raw, path)
                return
            f = LocalReadFile(raw, self.stats, self._where(path), full)
            try:
                yield cast(BinaryIO, f)
            finally:
                f.release()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"byte range of {self._where(path)} must be 0 <= start <= end")
        with self._translating("read", path):
            fd = os.open(self._full(path), os.O_RDONLY)
            try:
                data = os.pread(fd, end - start, start)
            finally:
                os.close(fd)
        self.stats.add_read(len(data))
        return data

    def publish(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` (a file or a directory) to ``dst`` and fsync."""
        full_src, full_dst = self._full(src), self._full(dst)
        with self._translating("publish", src):
            os.makedirs(os.path.dirname(full_dst), exist_ok=True)
            os.replace(full_src, full_dst)
            fsync_dir(os.path.dirname(full_dst))
            if os.path.dirname(full_src) != os.path.dirname(full_dst):
                fsync_dir(os.path.dirname(full_src))

    def write_once(self, path: str, data: bytes) -> None:
        """Write a complete temporary file, then hard-link it: exclusive and atomic."""
        final = self._full(path)
        with self._translating("create", path):
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = _temp_name(final)
            try:
                with open(tmp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, final)
                except FileExistsError as err:
                    msg = f"cannot create {self._where(path)}: it already exists"
                    raise AlreadyExistsError(msg) from err
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(os.path.dirname(final))
        self.stats.add_written(len(data))
