"""A streamed read of one object from an HTTP object store: one GET per sequential run.

fsspec's file objects read in blocks, one ranged GET each (s3fs: ``block_size`` plus the
bytes asked for; gcsfs: 5 MiB blocks read ahead). :class:`StreamingDownload` reads a
sequential run of reads from a single GET of the rest of the object, holding no buffer of
its own: a store then serves the object once, not once per block, and each request's
latency is paid once. A seek elsewhere (backwards, or further forwards than
``skip_limit``) starts a new GET from there. Between reads the open GET holds one
connection of the filesystem's pool until the file is closed, as ``open_read``'s context
does on exit.

A backend gives the GET (:data:`Opener`): an awaitable that starts a GET of the object
from a byte offset to its end and answers a :class:`Body` to read the response from.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from fsspec.asyn import sync


class Body(Protocol):
    """The body of an open GET."""

    async def read(self, size: int) -> bytes:
        """At most ``size`` next bytes; ``b""`` at its end."""

    def close(self) -> None:
        """Drop the response and its connection."""


#: Starts a GET of the object from a byte offset to its end.
Opener = Callable[[int], Awaitable[Body]]


class StreamingDownload(io.RawIOBase):
    """Read an object of ``size`` bytes: seekable, one streamed GET per sequential run.

    Parameters
    ----------
    loop:
        The filesystem's event loop, where ``open_get`` and the reads run.
    open_get:
        Starts a GET from an offset (:data:`Opener`); a missing object raises there.
    url:
        The object's URL, for messages.
    size:
        The object's size in bytes.
    transient:
        Errors of the store's client that a stale open GET raises (besides timeouts,
        aiohttp's errors and OSError): a read that meets one on a GET it reused tries
        once more on a new GET.
    skip_limit:
        Most bytes a forward seek reads and drops from the open GET instead of starting
        a new one.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        open_get: Opener,
        url: str,
        size: int,
        transient: tuple[type[BaseException], ...] = (),
        skip_limit: int = 1 << 20,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._open_get = open_get
        self._url = url
        self._size = size
        self._transient: tuple[type[BaseException], ...] = (
            TimeoutError, aiohttp.ClientError, OSError, *transient
        )  # fmt: skip
        self._skip_limit = skip_limit
        self._pos = 0
        self._body: Body | None = None
        self._body_pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        try:
            data: bytes = sync(self._loop, self._read, self._pos, end - self._pos)
        except (TimeoutError, aiohttp.ClientError) as err:
            raise OSError(f"cannot read {self._url}: {err!r}") from err
        self._pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    async def _read(self, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)``, from the open GET when it can serve them."""
        reused = self._body is not None
        try:
            return await self._take_from(start, length)
        except self._transient:
            if not reused:
                raise
            # The open GET went stale (a long pause, a dropped connection): once more anew.
            self._close_body()
            return await self._take_from(start, length)

    async def _take_from(self, start: int, length: int) -> bytes:
        gap = start - self._body_pos
        if self._body is None or not 0 <= gap <= self._skip_limit:
            self._close_body()
            self._body, self._body_pos = await self._open_get(start), start
        elif gap:
            await self._take(gap)
        return await self._take(length)

    async def _take(self, length: int) -> bytes:
        """The next ``length`` bytes of the open GET (OSError if it ends before)."""
        assert self._body is not None
        chunks, missing = [], length
        try:
            while missing:
                chunk = await self._body.read(missing)
                if not chunk:
                    at, wanted = self._body_pos + length - missing, self._body_pos + length
                    raise OSError(f"{self._url} ended at byte {at}, before byte {wanted}")
                chunks.append(chunk)
                missing -= len(chunk)
        except BaseException:
            self._close_body()
            raise
        self._body_pos += length
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _close_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        """Drop the open GET, if any."""
        if not self.closed:
            self._close_body()
        super().close()
