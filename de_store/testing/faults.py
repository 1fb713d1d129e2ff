"""A fault-injecting fsspec filesystem: a real wrapper around a real filesystem.

:class:`FaultyFileSystem` passes every call through to the filesystem it wraps, after asking
its :class:`FaultPlan` whether to fail the call (a seeded share of the calls of chosen kinds
raises a transient ``OSError``) or to ``SIGKILL`` the process at the k-th call (for crash
tests, in a subprocess). Open it like any filesystem::

    plan = FaultPlan(fail={"write": 0.1, "read": 0.1}, seed=3)
    backend = open_backend(FaultyFileSystem(fsspec.filesystem("s3", ...), plan), root="b/p")

Kinds of calls: ``write`` (open for write, close/complete of a written file, put, create),
``chunk`` (one ``write``/``read`` on an open stream), ``read`` (open for read, whole and
ranged reads), ``rename`` (move, copy, publish), ``rm`` and ``meta`` (exists, info, list).

The local backend writes with ``os`` calls (temporary file, fsync, atomic rename) rather
than through fsspec; a wrapped local filesystem therefore opens as
:class:`FaultyLocalBackend`, the local backend with the same plan consulted before each of
those calls (and no memory-mapped reads, which would bypass it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from de_store.backends.local import LocalBackend
from de_store.backends.registry import BackendSpec, register_backend, registry

KINDS = ("write", "chunk", "read", "rename", "rm", "meta")
LOCAL_PROTOCOL = "faulty-file"
_S3_KINDS = {
    "put_object": "write",
    "create_multipart_upload": "write",
    "upload_part": "chunk",
    "complete_multipart_upload": "write",
    "get_object": "read",
    "copy_object": "rename",
    "delete_object": "rm",
    "delete_objects": "rm",
}


class InjectedFault(ConnectionResetError):
    """A transient error raised by a :class:`FaultPlan` (an ``OSError``, like a reset)."""


@dataclasses.dataclass
class FaultPlan:
    """Which calls fail, and where the process dies.

    Attributes
    ----------
    fail: kind -> share of its calls that raise :class:`InjectedFault` (seeded).
    seed: seed of the random draws; the same seed and calls give the same faults.
    kill_at: ``(kind, k)``: ``SIGKILL`` this process at the k-th call (1-based) of ``kind``
        (``"any"`` counts every call); only ever use it in a subprocess.
    active: calls are counted and faults injected only while true.
    """

    fail: dict[str, float] = dataclasses.field(default_factory=dict)
    seed: int = 0
    kill_at: tuple[str, int] | None = None
    active: bool = True
    trace: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    injected: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.fail) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def hit(self, kind: str, op: str, path: str) -> None:
        """Count one call; kill the process or raise if the plan says so."""
        if not self.active:
            return
        with self._lock:
            self.trace.append((kind, op, path))
            count = self._counts[kind] = self._counts.get(kind, 0) + 1
            total = self._counts["any"] = self._counts.get("any", 0) + 1
            if self.kill_at is not None:
                kill_kind, k = self.kill_at
                if (kill_kind == "any" and total == k) or (kill_kind == kind and count == k):
                    os.kill(os.getpid(), signal.SIGKILL)
            rate = self.fail.get(kind, 0.0)
            if rate and self._rng.random() < rate:
                self.injected += 1
                raise InjectedFault(errno.ECONNRESET, f"injected fault: {op} {path}")


class _FaultyStream(io.RawIOBase):
    """An open file whose reads and writes are ``chunk`` calls and whose close is a call."""

    def __init__(self, raw: Any, plan: FaultPlan, path: str, writing: bool) -> None:
        super().__init__()
        self._raw = raw
        self._plan = plan
        self._path = path
        self._writing = writing

    def readable(self) -> bool:
        return not self._writing

    def writable(self) -> bool:
        return self._writing

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def read(self, size: int = -1) -> bytes:
        self._plan.hit("chunk", "read", self._path)
        return bytes(self._raw.read(size))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def write(self, data: Any) -> int:
        self._plan.hit("chunk", "write", self._path)
        return int(self._raw.write(data))

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def discard(self) -> None:
        if hasattr(self._raw, "discard"):
            self._raw.discard()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._writing:
                self._plan.hit("write", "close", self._path)
            self._raw.close()
        finally:
            super().close()


class _ChunkWriter(io.BufferedIOBase):
    """The local backend's open file with each ``write`` counted; its owner closes it."""

    def __init__(self, raw: BinaryIO, plan: FaultPlan, path: str) -> None:
        super().__init__()
        self._raw = raw
        self._plan = plan
        self._path = path

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._plan.hit("chunk", "write", self._path)
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()


class FaultyFileSystem(AbstractFileSystem):
    """Wraps ``fs``: every call goes through to it after ``plan`` had its say.

    The wrapper reports ``fs``'s protocol, so ``open_backend`` picks the backend of the
    wrapped store (S3, GCS, ...); a wrapped local filesystem reports ``faulty-file``.
    """

    cachable = False

    def __init__(self, fs: AbstractFileSystem, plan: FaultPlan) -> None:
        super().__init__()
        self.inner = fs
        self.plan = plan
        local = isinstance(fs, LocalFileSystem)
        self.protocol = LOCAL_PROTOCOL if local else fs.protocol  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)  # store specifics: s3fs' loop, split_path, ...

    # --- paths ------------------------------------------------------------------------
    def _strip_protocol(self, path: Any) -> Any:  # type: ignore[override]
        if isinstance(path, str) and path.startswith(LOCAL_PROTOCOL + "://"):
            path = path[len(LOCAL_PROTOCOL) + 3 :]
        return self.inner._strip_protocol(path)

    def _parent(self, path: str) -> str:  # type: ignore[override]
        return str(self.inner._parent(path))

    def unstrip_protocol(self, name: str) -> str:
        return str(self.inner.unstrip_protocol(name))

    def invalidate_cache(self, path: str | None = None) -> None:
        self.inner.invalidate_cache(path)

    # --- calls --------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:  # type: ignore[override]
        writing = any(c in mode for c in "wxa")
        self.plan.hit("write" if writing else "read", "open", path)
        raw = self.inner.open(path, mode, **kwargs)
        return _FaultyStream(raw, self.plan, path, writing)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):  # type: ignore[no-untyped-def]
        self.plan.hit("read", "cat", path)
        return self.inner.cat_file(path, start=start, end=end, **kw)

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self.plan.hit("read", "cat", str(path))
        return self.inner.cat(path, *args, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        self.plan.hit("write", "pipe", path)
        self.inner.pipe_file(path, value, mode=mode, **kw)

    def _meta(self, op: str, path: Any, *args: Any, **kwargs: Any) -> Any:
        self.plan.hit("meta", op, str(path))
        return getattr(self.inner, op)(path, *args, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._meta("find", path, *args, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._meta("ls", path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self._meta("info", path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self._meta("exists", path, **kwargs))

    def isdir(self, path: str) -> bool:
        return bool(self._meta("isdir", path))

    def isfile(self, path: str) -> bool:
        return bool(self._meta("isfile", path))

    def size(self, path: str) -> Any:
        return self._meta("size", path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._meta("makedirs", path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._meta("mkdir", path, create_parents=create_parents, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.plan.hit("rm", "rm", str(path))
        self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self.plan.hit("rm", "rm_file", path)
        self.inner.rm_file(path)

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> None:
        self.plan.hit("rename", "mv", str(path1))
        self.inner.mv(path1, path2, *args, **kwargs)

    def copy(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> None:
        self.plan.hit("rename", "copy", str(path1))
        self.inner.copy(path1, path2, *args, **kwargs)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.plan.hit("rename", "cp_file", path1)
        self.inner.cp_file(path1, path2, **kwargs)

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """s3fs' request entry point, used directly by de_store's multipart uploads."""
        self.plan.hit(_S3_KINDS.get(method, "meta"), method, str(kwargs.get("Key", "")))
        return await self.inner._call_s3(method, *args, **kwargs)


class FaultyLocalBackend(LocalBackend):
    """The local backend on a :class:`FaultyFileSystem`: its ``os``-level writes, reads and
    renames consult the same plan as the wrapped filesystem's calls."""

    protocol = LOCAL_PROTOCOL

    @property
    def plan(self) -> FaultPlan:
        return cast(FaultyFileSystem, self.fs).plan

    def local_path(self, path: str) -> str | None:
        return None  # memory-mapped reads would bypass the plan

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self._translating("write", path):
            self.plan.hit("write", "open", path)
        with super().open_write(path) as f:
            yield cast(BinaryIO, _ChunkWriter(f, self.plan, path))
            with self._translating("write", path):
                self.plan.hit("write", "close", path)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._translating("read", path):
            self.plan.hit("read", "open", path)
        with super().open_read(path) as f:
            yield cast(BinaryIO, io.BufferedReader(_FaultyStream(f, self.plan, path, False)))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with self._translating("read", path):
            self.plan.hit("read", "range", path)
        return super().read_range(path, start, end)

    def publish(self, src: str, dst: str) -> None:
        with self._translating("publish", src):
            self.plan.hit("rename", "publish", src)
        super().publish(src, dst)

    def write_once(self, path: str, data: bytes) -> None:
        with self._translating("create", path):
            self.plan.hit("write", "create", path)
        super().write_once(path, data)


if LOCAL_PROTOCOL not in registry:
    register_backend(LOCAL_PROTOCOL, BackendSpec("de_store.testing.faults.FaultyLocalBackend"))
