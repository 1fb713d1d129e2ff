"""Local filesystem backend: temporary name, fsync, atomic rename.

A write goes to a hidden temporary file next to its final name (flushed to disk in the
background while it is written), is fsynced, renamed over
the final name with ``os.replace`` and the directory is fsynced: after a crash a reader
sees either the old file or the complete new one, never a partial one.
"""

from __future__ import annotations

import contextlib
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


class _SyncingFile(io.RawIOBase):
    """A file being written whose data is flushed to disk in the background as it grows.

    Every ``sync_every`` bytes an ``fdatasync`` starts in a helper thread (one at a time),
    so the disk writes overlap with encoding and the final fsync finds little left to do.
    """

    def __init__(self, raw: BinaryIO, sync_every: int) -> None:
        super().__init__()
        self._raw = raw
        self._sync_every = sync_every
        self._unsynced = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="de_store-fsync")
        self._pending: Future[None] | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        self._unsynced += n
        if self._unsynced >= self._sync_every and (self._pending is None or self._pending.done()):
            self._check()
            self._raw.flush()
            self._pending = self._pool.submit(os.fdatasync, self._raw.fileno())
            self._unsynced = 0
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
    #: Bytes written between background ``fdatasync`` calls of a streamed write.
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
            with raw, contextlib.closing(_SyncingFile(raw, self.sync_every)) as syncing:
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
