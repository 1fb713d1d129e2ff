"""A write-only S3 object that uploads its multipart parts concurrently while it is written.

s3fs's own file object uploads one block at a time, waiting for each: a shard's writer then
alternates between encoding and waiting on the network. :class:`MultipartUpload` instead
hands each full part to s3fs's event loop and goes on encoding, with at most
``concurrency`` parts in flight, so its memory stays bounded by
``(concurrency + 1) * part_size``. The object appears at its key only when ``close``
completes the upload; :meth:`discard` aborts it, leaving nothing behind. An object smaller
than one part is sent with a single ``put_object``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import threading
from typing import Any

from fsspec.asyn import sync


class MultipartUpload(io.RawIOBase):
    """Upload to ``path`` on an s3fs filesystem, ``part_size`` bytes a part, parts in parallel.

    Parameters
    ----------
    fs:
        An ``s3fs.S3FileSystem`` (its event loop, retries and extra request arguments,
        e.g. server-side encryption, apply to every request).
    path:
        ``bucket/key`` of the object.
    part_size:
        Bytes per part (S3 requires at least 5 MiB for all parts but the last).
    concurrency:
        Most parts uploading at once; a write blocks while that many are in flight.
    """

    def __init__(self, fs: Any, path: str, part_size: int, concurrency: int) -> None:
        super().__init__()
        if part_size < 5 << 20:
            raise ValueError(f"S3 part_size must be >= 5 MiB, got {part_size}")
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = part_size
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[Any]] = []
        self._slots = threading.Semaphore(concurrency)
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        while view.nbytes:
            room = self._part_size - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) == self._part_size:
                self._send_part()
        return size

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, **kwargs)

    def _send_part(self) -> None:
        self._raise_failed()
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", Key=self._key)["UploadId"]
        part, self._buffer = self._buffer, bytearray()
        self._slots.acquire()
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=len(self._parts) + 1,
            Body=bytes(part),
        )
        future = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)
        future.add_done_callback(lambda _: self._slots.release())
        self._parts.append(future)

    def _raise_failed(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                future.result()

    def close(self) -> None:
        """Send the last part and complete the upload (or put a small object whole)."""
        if self.closed:
            return
        try:
            if not self._done:
                self._finish()
        finally:
            super().close()

    def _finish(self) -> None:
        self._done = True
        if self._upload_id is None:
            self._call("put_object", Key=self._key, Body=bytes(self._buffer))
        else:
            try:
                self._complete()
            except BaseException:
                self.discard()
                raise
        self._buffer = bytearray()
        self._fs.invalidate_cache(self._path)

    def _complete(self) -> None:
        if self._buffer:
            self._send_part()
        etags = [future.result()["ETag"] for future in self._parts]
        parts = [{"PartNumber": i, "ETag": etag} for i, etag in enumerate(etags, 1)]
        self._call(
            "complete_multipart_upload",
            Key=self._key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )

    def discard(self) -> None:
        """Abandon the upload: wait for parts in flight, then abort it; nothing appears."""
        self._done = True
        self._buffer = bytearray()
        concurrent.futures.wait(self._parts)
        try:
            if self._upload_id is not None:
                self._call("abort_multipart_upload", Key=self._key, UploadId=self._upload_id)
        finally:
            super().close()
