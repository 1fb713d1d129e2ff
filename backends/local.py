"""Local filesystem backend: temporary name, fsync, atomic rename.

A write goes to a hidden temporary file next to its final name, is fsynced, renamed over
the final name with ``os.replace`` and the directory is fsynced: after a crash a reader
sees either the old file or the complete new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from de_store.errors import AlreadyExistsError

from .base import Capabilities
from .fsspec_generic import FsspecBackend


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(final: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.{uuid.uuid4().hex[:12]}.tmp")


class LocalBackend(FsspecBackend):
    """A directory on a local (POSIX) filesystem; see :class:`FsspecBackend`."""

    protocol = "file"
    capabilities = Capabilities(supports_atomic_rename=True, supports_fsync=True)

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
            with raw:
                yield self._counting(raw, path)
                with self._translating("write", path):
                    raw.flush()
                    os.fsync(raw.fileno())
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
