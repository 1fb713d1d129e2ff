"""A streamed upload of one S3 object: a concurrent multipart upload.

s3fs's own file object uploads one block at a time, waiting for each: a shard's writer then
alternates between encoding and waiting on the network. :class:`MultipartUpload` instead
hands each full part to s3fs's event loop and goes on encoding, with at most
``concurrency`` parts in flight, so its memory stays bounded by
``(concurrency + 1) * part_size``. Each part is sent as a ``bytes`` copy of the buffer it
was filled in, which is filled again at once: botocore checksums and sends a ``bytes``
body for about half the CPU time a ``bytearray`` body costs it, the copy included. The
object appears at its key only when ``close`` completes the upload; :meth:`discard` aborts
it, leaving nothing behind.

An object smaller than ``whole_parts + 1`` parts goes as one ``put_object``: its first
``whole_parts`` full parts are held, not sent, until the object outgrows them (then the
multipart upload starts with them). One request instead of a create, the parts and a
complete, and a store that writes the object once instead of joining its parts (moto
reads them all back to do it); but nothing is sent before the object is complete, and one
request moves the whole of it, where parts go side by side while the object is still being
written. ``whole_parts=0`` sends every object of a full part or more in parts. Memory:
``(max(concurrency, whole_parts) + 1) * part_size``, and a whole object is briefly held
twice, joined for its PUT.
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
    whole_parts:
        Full parts held before the multipart upload starts: an object smaller than
        ``whole_parts + 1`` parts goes as one PUT.
    """

    def __init__(
        self, fs: Any, path: str, part_size: int, concurrency: int, whole_parts: int = 0
    ) -> None:
        super().__init__()
        if part_size < 5 << 20:
            raise ValueError(f"S3 part_size must be >= 5 MiB, got {part_size}")
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_size = part_size
        self._buffer = bytearray(part_size)  # filled by writes, copied out per part
        self._filled = 0
        self._upload_id: str | None = None
        self._held: list[bytes] = []  # full parts not sent while the object may go whole
        self._whole_parts = whole_parts
        self._parts: list[concurrent.futures.Future[Any]] = []
        self._slots = threading.Semaphore(concurrency)
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, start = view.nbytes, 0
        while start < size:
            n = min(self._part_size - self._filled, size - start)
            self._buffer[self._filled : self._filled + n] = view[start : start + n]
            self._filled += n
            start += n
            if self._filled == self._part_size:
                self._send_part()
        return size

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, **kwargs)

    def _send_part(self, last: bool = False) -> None:
        self._raise_failed()
        if self._upload_id is None:
            if len(self._held) < self._whole_parts:
                self._held.append(self._taken())  # the object may still go whole
                return
            self._upload_id = self._call("create_multipart_upload", Key=self._key)["UploadId"]
            held, self._held = self._held, []
            for part in held:
                self._slots.acquire()
                self._submit(part)
        self._slots.acquire()  # before the copy: at most ``concurrency`` copies in flight
        part = self._taken()
        if last:
            self._buffer = bytearray()
        self._submit(part)

    def _submit(self, part: bytes) -> None:
        """Hand ``part`` to the event loop as the next part (its slot is taken)."""
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=len(self._parts) + 1,
            Body=part,
        )

        def release(_: concurrent.futures.Future[Any]) -> None:
            self._slots.release()

        future = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)
        future.add_done_callback(release)
        self._parts.append(future)

    def _taken(self) -> bytes:
        """The bytes written since the last part, copied out; the buffer is empty again."""
        part = bytes(memoryview(self._buffer)[: self._filled])
        self._filled = 0
        return part

    def _raise_failed(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                future.result()

    def close(self) -> None:
        """Send the last part and complete the upload, or put an object smaller than
        ``whole_parts + 1`` parts whole."""
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
            body = b"".join([*self._held, memoryview(self._buffer)[: self._filled]])
            self._buffer, self._filled, self._held = bytearray(), 0, []
            self._call("put_object", Key=self._key, Body=body)
        else:
            try:
                self._complete()
            except BaseException:
                self.discard()
                raise
        self._buffer, self._filled = bytearray(), 0
        self._fs.invalidate_cache(self._path)

    def _complete(self) -> None:
        if self._filled:
            self._send_part(last=True)
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
        self._buffer, self._filled, self._held = bytearray(), 0, []
        concurrent.futures.wait(self._parts)
        try:
            if self._upload_id is not None:
                self._call("abort_multipart_upload", Key=self._key, UploadId=self._upload_id)
        finally:
            super().close()
