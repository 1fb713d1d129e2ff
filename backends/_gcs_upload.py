"""A streamed upload of one GCS object that encodes the next chunk while one uploads.

gcsfs's own file object uploads each chunk when its buffer fills and waits for the answer:
a shard's writer then alternates between encoding and waiting on the network.
:class:`ResumableUpload` hands each full chunk to gcsfs's event loop and goes on filling a
second buffer. A resumable upload session takes its chunks in order, so one chunk is in
flight at a time; the writer waits only when it has filled the next one before the last
has gone. Memory stays at two chunks: the buffer being filled and the one uploading, which
is filled again once its upload is answered. The session request goes out once half of
the first chunk is written, while the rest of it is encoded: the first chunk then goes
without waiting for it.

An object smaller than half a chunk goes as one simple upload; one that started a session
goes as that session's chunks. It appears at its name only when ``close`` sends the last
chunk, which carries the object's total size;
:meth:`discard` cancels the session instead, leaving nothing behind. The requests are
gcsfs's: ``initiate_upload`` and ``simple_upload``, and its ``_call`` for each chunk
(``upload_chunk`` needs the total size, unknown until the last chunk), so its credentials,
retries and checksums (the filesystem's ``consistency``) apply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import mimetypes
from typing import Any

import aiohttp
from fsspec.asyn import sync
from gcsfs.checkers import get_consistency_checker
from gcsfs.core import initiate_upload, simple_upload, upload_chunk
from gcsfs.retry import ChecksumError, HttpError

#: GCS takes the chunks of a session, all but the last, in multiples of this.
CHUNK_GRAIN = 256 << 10


class ResumableUpload(io.RawIOBase):
    """Upload to ``path`` on a gcsfs filesystem, ``chunk_size`` bytes a chunk.

    Parameters
    ----------
    fs:
        A ``gcsfs.GCSFileSystem`` (its event loop, credentials, retries and
        ``consistency`` apply to every request).
    path:
        ``bucket/key`` of the object.
    chunk_size:
        Bytes per chunk, a multiple of 256 KiB.
    """

    def __init__(self, fs: Any, path: str, chunk_size: int) -> None:
        super().__init__()
        if chunk_size <= 0 or chunk_size % CHUNK_GRAIN:
            raise ValueError(f"GCS chunk_size must be a multiple of 256 KiB, got {chunk_size}")
        self._fs = fs
        self._path = path
        self._bucket, self._key, generation = fs.split_path(path)
        if generation:
            raise ValueError(f"cannot write gs://{path}: a write names no generation")
        self._content_type = mimetypes.guess_type(path)[0] or "application/octet-stream"
        self._checker = get_consistency_checker(fs.consistency)
        self._chunk_size = chunk_size
        self._buffer = bytearray(chunk_size)
        self._spare: bytearray | None = None  # the other buffer, once its upload is answered
        self._filled = 0
        self._sent = 0  # bytes of the object before the buffer (uploaded or in flight)
        self._location: str | None = None
        self._in_flight: concurrent.futures.Future[None] | None = None
        self._failed = False
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to the closed upload of gs://{self._path}")
        view = memoryview(data).cast("B")
        size, start = view.nbytes, 0
        while start < size:
            if self._filled == self._chunk_size:  # more is coming: the full chunk is not last
                self._send_chunk()
            n = min(self._chunk_size - self._filled, size - start)
            self._buffer[self._filled : self._filled + n] = view[start : start + n]
            self._filled += n
            start += n
        if self._sent == 0 and self._in_flight is None and self._filled * 2 >= self._chunk_size:
            # Big enough for a session: ask for it now, while the first chunk fills.
            self._in_flight = asyncio.run_coroutine_threadsafe(self._session(), self._fs.loop)
        return size

    def _send_chunk(self) -> None:
        """Hand the full buffer to the event loop and take the other one to fill."""
        self._wait()
        chunk, offset = self._buffer, self._sent
        self._checker.update(chunk)
        self._buffer = self._spare if self._spare is not None else bytearray(self._chunk_size)
        self._spare, self._filled = chunk, 0
        self._sent += len(chunk)
        coro = self._upload(memoryview(chunk), offset)
        self._in_flight = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def _wait(self) -> None:
        """Wait for the chunk in flight, if any (raising its error)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            try:
                _gcs_result(self._path, future.result)
            except BaseException:
                self._failed = True
                raise

    async def _session(self) -> None:
        """Start the upload session (once)."""
        if self._location is None:
            self._location = await initiate_upload(
                self._fs, self._bucket, self._key, self._content_type
            )

    async def _upload(self, chunk: memoryview, offset: int) -> None:
        """Send ``chunk`` at ``offset`` of a session of unknown total size (all of it,
        when the store keeps only part of a request)."""
        await self._session()
        end = offset + len(chunk)
        while offset < end:
            headers = {
                "Content-Range": f"bytes {offset}-{end - 1}/*",
                "Content-Type": self._content_type,
                "Content-Length": str(end - offset),
            }
            answer, _ = await self._fs._call(
                "POST", self._location, headers=headers, data=chunk[offset - end :]
            )
            kept = int(answer["Range"].rpartition("-")[2]) + 1 if "Range" in answer else 0
            if kept <= offset or kept > end:
                raise OSError(
                    f"cannot upload gs://{self._path}: the store kept bytes up to {kept} "
                    f"of a chunk sent for bytes {offset} to {end}"
                )
            offset = kept

    def close(self) -> None:
        """Send the last chunk, which completes the object (or upload a small one whole);
        when that fails, cancel the session. Closing again does nothing."""
        if self._done:
            super().close()
            return
        self._done = True
        try:
            self._finish()
        except BaseException:
            self.discard()
            raise
        self._buffer, self._spare, self._filled = bytearray(), None, 0
        self._fs.invalidate_cache(self._path)
        super().close()

    def _finish(self) -> None:
        if self._failed:
            raise OSError(f"cannot upload gs://{self._path}: a chunk of it failed")
        self._wait()  # the chunk, or the session request, in flight
        last = memoryview(self._buffer)[: self._filled]
        if self._location is None:  # under half a chunk: no session
            _gcs_result(self._path, sync, self._fs.loop, simple_upload, self._fs, self._bucket,
                        self._key, bytes(last), consistency=self._fs.consistency,
                        content_type=self._content_type)  # fmt: skip
        else:
            self._complete(last)

    def _complete(self, last: memoryview) -> None:
        self._wait()
        self._checker.update(last)
        total = self._sent + len(last)
        made = _gcs_result(self._path, sync, self._fs.loop, upload_chunk, self._fs,
                           self._location, last, self._sent, total, self._content_type)  # fmt: skip
        if not made:
            raise OSError(f"cannot upload gs://{self._path}: the store did not complete it")
        _gcs_result(self._path, self._checker.validate_json_response, made)

    def __del__(self) -> None:
        """Never complete an upload left unclosed: its object stays unmade."""
        self._done = True
        super().__del__()

    def discard(self) -> None:
        """Abandon the upload: wait for the chunk in flight, then cancel the session."""
        self._done = True
        self._buffer, self._spare, self._filled = bytearray(), None, 0
        future, self._in_flight = self._in_flight, None
        try:
            if future is not None:
                concurrent.futures.wait([future])
            if self._location is not None:
                sync(self._fs.loop, self._cancel)
        finally:
            super().close()

    async def _cancel(self) -> None:
        """One DELETE of the session, which GCS answers with 499, without gcsfs's retries:
        a store that refuses it (the emulator answers 501, which gcsfs would retry for
        about 30 s) keeps an unfinished session, and that never becomes an object."""
        once = getattr(type(self._fs)._request, "__wrapped__", None)
        if once is None:
            await self._fs._call("DELETE", self._location)
        else:
            await once(self._fs, "DELETE", self._location)


def _gcs_result(path: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with the errors of gcsfs and aiohttp that are no OSError
    raised as one naming the object (the backend translates OSError into its own errors)."""
    try:
        return fn(*args, **kwargs)
    except (HttpError, ChecksumError, ValueError, aiohttp.ClientError) as err:
        raise OSError(f"cannot upload gs://{path}: {type(err).__name__}: {err}") from err
