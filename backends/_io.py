"""Helpers shared by the backends: error translation, byte counting, URL redaction."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import IO, Any

from de_store.errors import AlreadyExistsError, BackendError, DeStoreError, StorageNotFoundError

from .base import IOStats

_USERINFO = re.compile(r"^([a-zA-Z][\w+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """Drop any ``user:password@`` part of ``url`` so it can appear in messages."""
    return _USERINFO.sub(r"\1", url)


def translate_error(err: BaseException, where: str, op: str) -> DeStoreError:
    """Map a native storage error to the de_store error a caller should catch.

    Parameters
    ----------
    err:
        The error raised by fsspec, the OS or a cloud SDK.
    where:
        The redacted URL of the file or object concerned.
    op:
        What was attempted ("read", "write", "list", ...).
    """
    if isinstance(err, DeStoreError):
        return err
    if isinstance(err, FileNotFoundError):
        return StorageNotFoundError(f"cannot {op} {where}: no such file or object")
    if isinstance(err, FileExistsError):
        return AlreadyExistsError(f"cannot {op} {where}: it already exists")
    if isinstance(err, PermissionError):
        return BackendError(
            f"cannot {op} {where}: permission denied (check the credentials "
            f"and access rights for this location): {type(err).__name__}"
        )
    return BackendError(f"cannot {op} {where}: {type(err).__name__}: {err}")


class CountingFile(io.BufferedIOBase):
    """A file-like proxy that counts bytes into :class:`IOStats` and translates errors.

    Parameters
    ----------
    raw:
        The underlying binary file (a local file, an fsspec file, a BytesIO).
    stats:
        Counters to update.
    where:
        Redacted URL of the file, for error messages.
    native_errors:
        Exception types to translate with :func:`translate_error`.
    """

    def __init__(
        self,
        raw: IO[bytes],
        stats: IOStats,
        where: str,
        native_errors: tuple[type[BaseException], ...] = (OSError,),
    ) -> None:
        super().__init__()
        self._raw = raw
        self._stats = stats
        self._where = where
        self._native_errors = native_errors

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._native_errors as err:
            raise translate_error(err, self._where, op) from err

    def read(self, size: int | None = -1) -> bytes:
        data: bytes = self._call("read", self._raw.read, -1 if size is None else size)
        self._stats.add_read(len(data))
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        readinto = getattr(self._raw, "readinto", None)
        if readinto is None:
            data = self.read(len(view))
            view[: len(data)] = data
            return len(data)
        n: int = self._call("read", readinto, view) or 0
        self._stats.add_read(n)
        return n

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._call("write", self._raw.write, data)
        self._stats.add_written(n)
        return n

    def hand_over(self, data: Any) -> int:
        """Write ``data``, which the caller does not change afterwards: a file writing
        straight to the disk may write it from where it is rather than copy it."""
        hand_over = getattr(self._raw, "hand_over", None)
        if hand_over is None:
            return self.write(data)
        n = memoryview(data).nbytes
        self._call("write", hand_over, data)
        self._stats.add_written(n)
        return n

    @property
    def direct_alignment(self) -> int | None:
        """The file's ``direct_alignment`` (see ``hand_over``), None where it has none."""
        return getattr(self._raw, "direct_alignment", None)

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._call("seek", self._raw.seek, offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        if not self.closed:
            self._call("flush", self._raw.flush)

    def readable(self) -> bool:
        return bool(self._raw.readable())

    def writable(self) -> bool:
        return bool(self._raw.writable())

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def close(self) -> None:
        """Mark this proxy closed; the owning backend closes (or discards) the raw file."""
        super().close()
