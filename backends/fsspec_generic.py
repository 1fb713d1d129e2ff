"""A backend over any fsspec filesystem (``hdfs://``, ``abfs://``, ``sftp://``, ...).

:class:`FsspecBackend` is also the base of the local, memory, S3 and GCS backends, which
override only what their store does better (atomic rename, exclusive create).

Without rename, an object appears under its final name when its upload completes, and
``publish`` is a copy followed by a delete: the saver then relies on a write-once commit
marker for visibility. ``write_once`` checks for the object and then writes it with
fsspec's ``mode="create"``; a store that does not honour that precondition leaves a race
between two concurrent writers of the same marker (the check only catches sequential ones).
``size`` and that check ask the store of the one object (``_file_info``): on S3 and GCS
one request, where ``exists`` and ``isdir`` would add a listing.
"""

from __future__ import annotations

import contextlib
import datetime
import posixpath
from collections.abc import Iterator
from typing import IO, Any, BinaryIO, cast

import fsspec
from fsspec.core import url_to_fs
from fsspec.spec import AbstractFileSystem

from de_store.errors import (
    AlreadyExistsError,
    BackendError,
    MissingDependencyError,
    StorageNotFoundError,
    UnknownProtocolError,
)

from ._io import CountingFile, redact_url, translate_error
from .base import Backend, Capabilities, IOStats
from .location import Location


def first_protocol(fs: AbstractFileSystem) -> str:
    """The main protocol name of an fsspec filesystem ("file", "s3", ...)."""
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


class FsspecBackend(Backend):
    """A :class:`Backend` on an fsspec filesystem and a root path inside it.

    Parameters
    ----------
    fs:
        An fsspec filesystem, already configured (credentials, endpoint, ...).
    root:
        The path inside ``fs`` that relative paths are resolved against.
    url:
        The URL shown in messages; built from ``fs`` and ``root`` when omitted. Any
        ``user:password@`` part is removed.
    """

    protocol = "fsspec"
    capabilities = Capabilities(supports_atomic_rename=False)
    #: Native exception types translated into de_store errors at the boundary.
    native_errors: tuple[type[BaseException], ...] = (OSError,)
    #: Create parent directories before a write (false on object stores, where
    #: ``makedirs`` of a bucket path would create the bucket).
    makes_parent_dirs: bool = True

    def __init__(self, fs: AbstractFileSystem, root: str = "", *, url: str | None = None) -> None:
        self.fs = fs
        self.protocol = first_protocol(fs)
        self.root = fs._strip_protocol(root).rstrip("/") if root else ""
        self.url = redact_url(url or fs.unstrip_protocol(self.root))
        self.stats = IOStats()

    @classmethod
    def from_url(
        cls, url: str, storage_options: dict[str, Any], root: str | None = None
    ) -> FsspecBackend:
        """Open ``url`` (joined with ``root``) with fsspec and ``storage_options``."""
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        try:
            fs, path = url_to_fs(url, **storage_options)
        except ImportError as err:
            raise MissingDependencyError(
                f"protocol {protocol!r} of {redact_url(url)} needs a package that is not "
                f"installed: {err}"
            ) from err
        except ValueError as err:
            if "not known" not in str(err).lower():
                raise
            raise UnknownProtocolError(
                f"no fsspec implementation serves protocol {protocol!r} of {redact_url(url)}"
            ) from err
        except cls.native_errors as err:
            first_line = str(err).splitlines()[0] if str(err) else ""
            raise BackendError(
                f"cannot open {redact_url(url)}: {type(err).__name__}: {first_line}"
            ) from err
        if root:
            path = posixpath.join(path, root.strip("/"))
            url = url.rstrip("/") + "/" + root.strip("/")
        return cls(fs, path, url=url)

    def sub(self, path: str) -> FsspecBackend:
        child = type(self)(self.fs, self._full(path), url=self._where(path))
        child.stats = self.stats
        return child

    # --- paths and errors -------------------------------------------------------------
    def _full(self, path: str) -> str:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"path {path!r} must stay inside {self.url}; found '..'")
        rel = "/".join(parts)
        if not self.root:
            return rel
        return f"{self.root}/{rel}" if rel else self.root

    def _rel(self, full: str) -> str:
        full = self.fs._strip_protocol(full)
        return full[len(self.root) + 1 :] if self.root else full.lstrip("/")

    def _where(self, path: str) -> str:
        return Location(self, path).url

    @contextlib.contextmanager
    def _translating(self, op: str, path: str) -> Iterator[None]:
        try:
            yield
        except self.native_errors as err:
            raise translate_error(err, self._where(path), op) from err

    def _counting(self, raw: IO[bytes], path: str) -> BinaryIO:
        return cast(BinaryIO, CountingFile(raw, self.stats, self._where(path), self.native_errors))

    # --- primitives -------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        with self._translating("write", path):
            if self.makes_parent_dirs:
                self.fs.makedirs(self.fs._parent(full), exist_ok=True)
            raw = self._open_upload(full)
        try:
            yield self._counting(raw, path)
        except BaseException:
            self._discard(raw)
            raise
        with self._translating("write", path):
            raw.close()

    def _open_upload(self, full: str) -> Any:
        """The writable file behind ``open_write`` (a store's faster uploader may replace it)."""
        return self.fs.open(full, "wb")

    def _discard(self, raw: Any) -> None:
        """Abandon an unfinished upload so that nothing appears at its final name."""
        with contextlib.suppress(Exception):
            if hasattr(raw, "discard"):
                raw.discard()
        # fsspec files close (and so upload) on garbage collection unless marked closed.
        with contextlib.suppress(Exception):
            raw.closed = True

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        with self._translating("read", path):
            raw = self._open_download(full)
        try:
            yield self._counting(raw, path)
        finally:
            raw.close()

    def _open_download(self, full: str) -> Any:
        """The readable file behind ``open_read`` (a store's streamed reader may replace it)."""
        return self.fs.open(full, "rb")

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"byte range of {self._where(path)} must be 0 <= start <= end")
        if start == end:  # some stores answer an empty HTTP range with the whole object
            self.size(path)  # still raise when the file is missing
            return b""
        with self._translating("read", path):
            data: bytes = self.fs.cat_file(self._full(path), start=start, end=end)
        self.stats.add_read(len(data))
        return data

    def read_bytes(self, path: str) -> bytes:
        with self._translating("read", path):
            data: bytes = self.fs.cat_file(self._full(path))
        self.stats.add_read(len(data))
        return data

    def list(self, prefix: str = "") -> list[str]:
        base = self._full(prefix)
        with self._translating("list", prefix):
            self.fs.invalidate_cache(base)
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
        return sorted(self._rel(p) for p in found)

    def exists(self, path: str) -> bool:
        full = self._full(path)
        with self._translating("check", path):
            self.fs.invalidate_cache(full)
            return bool(self.fs.exists(full))

    def size(self, path: str) -> int:
        full = self._full(path)
        with self._translating("size", path):
            self.fs.invalidate_cache(full)
            return int(self._file_info(full)["size"])

    def _file_exists(self, path: str, full: str) -> bool:
        """Whether a file (or a folder) is at ``full``: :meth:`_file_info`'s requests."""
        with self._translating("check", path):
            self.fs.invalidate_cache(full)
            try:
                self._file_info(full)
            except FileNotFoundError:
                return False
            except IsADirectoryError:
                return True
        return True

    def _file_info(self, full: str) -> dict[str, Any]:
        """What the store says of the file ``full`` (at least its ``size``), in as few
        requests as it allows: FileNotFoundError when there is none, IsADirectoryError
        when ``full`` names a folder."""
        info: dict[str, Any] = self.fs.info(full)
        if info["type"] != "file":
            raise IsADirectoryError(full)
        return info

    def modified(self, path: str) -> float | None:
        full = self._full(path)
        with self._translating("check", path):
            self.fs.invalidate_cache(full)
            try:
                when = self.fs.modified(full)
            except (NotImplementedError, IsADirectoryError, KeyError):
                return None
        if not isinstance(when, datetime.datetime):
            return None
        if when.tzinfo is None:  # fsspec reports UTC
            when = when.replace(tzinfo=datetime.UTC)
        return when.timestamp()

    def delete(self, path: str, *, recursive: bool = False) -> None:
        full = self._full(path)
        with self._translating("delete", path):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(full, recursive=recursive)
            self.fs.invalidate_cache(full)

    def publish(self, src: str, dst: str) -> None:
        """Copy ``src`` (a file or a directory) to ``dst``, then delete ``src``."""
        if not self.exists(src):
            raise StorageNotFoundError(f"cannot publish {self._where(src)}: no such file")
        full_src, full_dst = self._full(src), self._full(dst)
        with self._translating("publish", src):
            if self.fs.isdir(full_src):
                self._copy_tree(full_src, full_dst)
            else:
                self.fs.copy(full_src, full_dst)
            self.fs.rm(full_src, recursive=True)
            self.fs.invalidate_cache(full_dst)

    def _copy_tree(self, full_src: str, full_dst: str) -> None:
        for file in self.fs.find(full_src):
            rel = self.fs._strip_protocol(file)[len(full_src) + 1 :]
            self.fs.copy(file, f"{full_dst}/{rel}")

    def write_once(self, path: str, data: bytes) -> None:
        full = self._full(path)
        if self._file_exists(path, full):
            raise AlreadyExistsError(f"cannot create {self._where(path)}: it already exists")
        with self._translating("create", path):
            self.fs.pipe_file(full, data, mode="create")
            self.fs.invalidate_cache(full)
        self.stats.add_written(len(data))
