"""In-process memory backend (``memory://``), for tests and small experiments.

fsspec's memory filesystem is one dictionary shared by the whole process, so a module lock
makes ``write_once`` genuinely exclusive and a streamed write appears only when complete.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from typing import BinaryIO

from de_store.errors import AlreadyExistsError

from .base import Capabilities
from .fsspec_generic import FsspecBackend

_CREATE_LOCK = threading.Lock()


class MemoryBackend(FsspecBackend):
    """A prefix of fsspec's process-wide memory filesystem; see :class:`FsspecBackend`."""

    protocol = "memory"
    capabilities = Capabilities(supports_atomic_rename=False)
    #: Storage options are checked (see :mod:`.options`); none beyond MemoryFileSystem's.
    storage_options_extra: tuple[str, ...] = ()

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        full = self._full(path)
        buffer = io.BytesIO()
        yield self._counting(buffer, path)
        with self._translating("write", path):
            self.fs.pipe_file(full, buffer.getvalue())

    def write_once(self, path: str, data: bytes) -> None:
        full = self._full(path)
        with _CREATE_LOCK, self._translating("create", path):
            if self.fs.exists(full):
                raise AlreadyExistsError(f"cannot create {self._where(path)}: it already exists")
            self.fs.pipe_file(full, data)
        self.stats.add_written(len(data))
