"""The storage backend contract.

A :class:`Backend` is one storage location (a root URL) seen through a handful of primitive
operations on paths relative to that root ("a/b/c.parquet", always with "/"). Everything
else in de_store (shard formats, manifests, commit protocol) is built on these primitives.

Capabilities are declared, not guessed: the saver picks its commit strategy from
:class:`Capabilities` (atomic rename on POSIX, write-once commit marker on object stores).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import BinaryIO


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do natively.

    Attributes
    ----------
    supports_atomic_rename:
        ``rename`` of a file or directory is atomic (POSIX local disk). When false, the
        saver writes under final names and a write-once commit marker decides visibility.
    supports_listing:
        ``list`` returns every object under a prefix.
    supports_byte_ranges:
        ``read_range`` fetches only the requested bytes (no full download).
    supports_fsync:
        Written data is made durable with fsync before ``publish`` returns.
    """

    supports_atomic_rename: bool
    supports_listing: bool = True
    supports_byte_ranges: bool = True
    supports_fsync: bool = False


@dataclasses.dataclass
class IOStats:
    """Bytes moved through one backend, counted at its boundary (thread-safe).

    Attributes
    ----------
    bytes_read:
        Bytes returned by ``open_read`` files, ``read_range`` and ``read_bytes``.
    bytes_written:
        Bytes handed to ``open_write`` files and ``write_once``. Server-side copies made
        by ``publish`` on object stores move no bytes through the client and are not counted.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def add_read(self, n: int) -> None:
        """Count ``n`` bytes read."""
        with self._lock:
            self.bytes_read += n

    def add_written(self, n: int) -> None:
        """Count ``n`` bytes written."""
        with self._lock:
            self.bytes_written += n

    def reset(self) -> None:
        """Set both counters back to zero."""
        with self._lock:
            self.bytes_read = 0
            self.bytes_written = 0


class Backend(abc.ABC):
    """A storage location addressed by relative paths.

    Subclasses implement the abstract primitives; the rest are defaults built on them.
    """

    #: Protocol name, e.g. "file", "memory", "s3", "gs".
    protocol: str
    #: The URL this backend was opened on.
    url: str
    capabilities: Capabilities
    #: Bytes read and written through this backend.
    stats: IOStats

    # --- primitives -----------------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """Open ``path`` for a streamed write; the object appears complete on clean exit.

        On a backend with atomic rename the data goes to a temporary name, is fsynced and
        renamed over ``path`` on exit; on an exception nothing is left at ``path``.
        """

    @abc.abstractmethod
    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """Open ``path`` for a streamed, seekable read."""

    @abc.abstractmethod
    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of ``path``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every file path under ``prefix`` (recursive), relative to the root, sorted."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file (or a directory with content) exists at ``path``."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes."""

    @abc.abstractmethod
    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Delete ``path`` (a file, or with ``recursive`` everything under it). Missing is fine."""

    @abc.abstractmethod
    def publish(self, src: str, dst: str) -> None:
        """Make ``src`` visible as ``dst``: atomic rename where supported, else copy + delete."""

    @abc.abstractmethod
    def write_once(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` only if it does not exist yet.

        Raises :class:`de_store.errors.AlreadyExistsError` when it exists.
        """

    @abc.abstractmethod
    def sub(self, path: str) -> Backend:
        """A backend rooted at ``path`` under this one, sharing its filesystem and stats."""

    # --- defaults built on the primitives --------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` in one go."""
        with self.open_write(path) as f:
            f.write(data)

    def read_bytes(self, path: str) -> bytes:
        """Return the whole content of ``path``."""
        with self.open_read(path) as f:
            return f.read()

    def iter_chunks(self, path: str, chunk_size: int = 8 << 20) -> Iterator[bytes]:
        """Yield the content of ``path`` in chunks of at most ``chunk_size`` bytes."""
        with self.open_read(path) as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def modified(self, path: str) -> float | None:
        """When the file ``path`` was last written, in seconds since the epoch, as the
        store reports it; None when the store does not say (callers that delete by age
        then keep the file)."""
        return None

    def local_path(self, path: str) -> str | None:
        """A local filesystem path for ``path`` (to memory-map it), or None if not local.

        Reads through a memory map bypass :attr:`stats`.
        """
        return None

    def join(self, *parts: str) -> str:
        """Join relative path parts with "/"."""
        return "/".join(p.strip("/") for p in parts if p)
