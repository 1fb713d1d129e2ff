"""Local filesystem backend: temporary name, fsync, atomic rename.

A write goes to a hidden temporary file next to its final name (flushed to disk in the
background while it is written), is fsynced, renamed over
the final name with ``os.replace`` and the directory is fsynced: after a crash a reader
sees either the old file or the complete new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from de_store.errors import AlreadyExistsError

from .base import Capabilities
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
            with (
                raw,
                contextlib.closing(
                    _SyncingFile(raw, self.sync_every, self.writeback_every)
                ) as syncing,
            ):
                yield self._counting(cast(BinaryIO, syncing), path)
                with self._translating("write", path):
                    syncing.sync()
            with self._translating("write", path):
                os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with self._translating("write", path):
            fsync_dir(os.path.dirname(final))

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._translating("read", path):
            raw = open(self._full(path), "rb")  # noqa: SIM115
        with raw:
            yield self._counting(raw, path)

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
