"""Checksummed streams shared by the formats: crc32c while writing, verification on read."""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any, BinaryIO

import pyarrow as pa

from de_store._threads import LazyPool
from de_store.errors import ChecksumError, FormatError

from ._crc32c import crc32c
from .base import ByteRange, FileInfo

#: Writes at least this big sum their crc32c in a helper thread while the write runs.
OVERLAP_BYTES = 1 << 20


_CRC_POOL = LazyPool(4, "de_store-crc32c")
_POLY = 0x82F63B78  # crc32c polynomial, bit-reversed
_X2N = [1 << 30]  # x^(2^k) mod p for k = 0..31, bit-reversed (bit 31 is x^0)


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo the crc32c polynomial, both bit-reversed."""
    product, mask = 0, 1 << 31
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


for _ in range(31):
    _X2N.append(_multiply(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)
def _shift_operator(length: int) -> int:
    """x^(8 * length) modulo the polynomial: appending ``length`` zero bytes, unconditioned."""
    result, k = 1 << 31, 3
    while length:
        if length & 1:
            result = _multiply(_X2N[k & 31], result)
        length >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """crc32c of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``.

    CRCs are linear over GF(2): ``crc(a + b) = crc(a) * x^(8 len(b)) mod p  ^  crc(b)``
    (the initial and final inversions cancel), as in zlib's ``crc32_combine``.
    """
    return _multiply(_shift_operator(length_b), crc_a) ^ crc_b


class ChecksummingWriter(io.RawIOBase):
    """A write-only stream that sums crc32c over each segment and over everything.

    :meth:`cut` ends the current segment (a part) and returns its byte range and crc32c;
    :meth:`cut_at` schedules a cut at a future offset (Arrow writes its header lazily,
    together with the first batch). Closing does not close the wrapped stream.

    Each byte is summed once, into its segment's crc32c; the segments tile the stream, so
    the whole stream's crc32c (:attr:`crc32c`) is theirs combined, one combination a
    segment (:func:`crc32c_combine`), not a second pass over the bytes.
    """

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.position = 0
        self._segment_start = 0
        self._segment_crc = 0
        # crc32c of the segments before the current one (the bytes before _segment_start).
        self._before_crc = 0
        self._pending: int | None = None

    @property
    def crc32c(self) -> int:
        """crc32c of every byte written so far."""
        return crc32c_combine(
            self._before_crc, self._segment_crc, self.position - self._segment_start
        )

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def write(self, data: Any) -> int:
        buffer = data if isinstance(data, bytes | pa.Buffer) else pa.py_buffer(data)
        size = len(buffer) if isinstance(buffer, bytes) else buffer.size
        if size < OVERLAP_BYTES:
            self._sum_all(buffer, size)
            self._raw.write(data)
        else:  # the crc32c runs beside the write (both let go of the interpreter lock)
            summed = _CRC_POOL.submit(self._sum_all, buffer, size)
            try:
                self._raw.write(data)
            finally:
                summed.result()
        self.position += size
        return size

    def write_summed(self, data: Any, crc: int) -> int:
        """Write ``data`` whose crc32c (``crc``, from 0) the caller summed already: it is
        combined into the sums (one :func:`crc32c_combine`) rather than summed again, and
        ``data`` is handed over to the stream below, which may keep it until written
        (``hand_over``): the caller does not change it afterwards."""
        size = memoryview(data).nbytes
        pending = self._pending
        if pending is not None and self.position <= pending < self.position + size:
            return self.write(data)  # a part ends inside: its two sides summed apart
        hand_over = getattr(self._raw, "hand_over", None)
        (self._raw.write if hand_over is None else hand_over)(data)
        self._segment_crc = crc32c_combine(self._segment_crc, crc, size)
        self.position += size
        return size

    @property
    def direct_alignment(self) -> int | None:
        """The alignment of the file offsets from which the stream below writes data it is
        handed over (``hand_over``) straight to the disk; None where it does not."""
        return getattr(self._raw, "direct_alignment", None)

    def _sum_all(self, buffer: Any, size: int) -> None:
        pending = self._pending
        if pending is not None and self.position <= pending < self.position + size:
            head = pending - self.position
            self._sum(buffer[:head])
            self._start_segment()
            self._sum(buffer[head:])
        else:
            self._sum(buffer)

    def _sum(self, chunk: Any) -> None:
        self._segment_crc = crc32c(chunk, self._segment_crc)

    def _start_segment(self) -> None:
        self._end_segment(self.position if self._pending is None else self._pending)

    def _end_segment(self, end: int) -> None:
        """Fold the current segment, which ends at ``end``, into the crc32c of the bytes
        before it; the next segment starts there."""
        length = end - self._segment_start
        self._before_crc = crc32c_combine(self._before_crc, self._segment_crc, length)
        self._segment_start, self._segment_crc, self._pending = end, 0, None

    def cut_at(self, offset: int) -> None:
        """Start a new segment at ``offset`` (at or after the current position)."""
        self._pending = offset
        if offset == self.position:
            self._start_segment()

    def cut(self) -> ByteRange:
        """End the current segment here and return it; the next one starts here."""
        segment = ByteRange(
            self._segment_start, self.position - self._segment_start, self._segment_crc
        )
        self._end_segment(self.position)
        return segment

    def close(self) -> None:
        """Mark closed; the backend's context manager owns the wrapped stream."""
        super().close()


def read_exact(f: BinaryIO, size: int, where: str) -> bytes:
    """Exactly ``size`` bytes from ``f``; FormatError naming ``where`` if the file ends early."""
    data = f.read(size)
    check_read(where, size, len(data))
    return data


def check_read(where: str, expected: int, found: int) -> None:
    """FormatError naming ``where`` when a read that asked for ``expected`` bytes got
    ``found``: the file ended early."""
    if found != expected:
        raise FormatError(f"{where} is truncated: expected {expected} more bytes, found {found}")


def check_crc(where: str, what: str, expected: int, data: Any) -> None:
    """Raise ChecksumError naming ``where`` when ``crc32c(data) != expected``."""
    found = crc32c(data)
    if found != expected:
        raise ChecksumError(
            f"crc32c mismatch in {what} of {where}: expected {expected:#010x}, found {found:#010x}"
        )


def check_crc_value(where: str, expected: int, found: int) -> None:
    """ChecksumError naming ``where`` when a whole file's crc32c differs from the recorded one."""
    if expected != found:
        raise ChecksumError(
            f"crc32c mismatch in {where}: expected {expected:#010x}, found {found:#010x}"
        )


def check_frame(
    where: str, file: FileInfo, ranges: Sequence[ByteRange], head: bytes, tail: bytes
) -> None:
    """Verify a file's header and footer against its crc32c and the parts' recorded ones.

    ``head`` is the file's content before the first range, ``tail`` after the last one; the
    ranges must tile the space between them.
    """
    crc = crc32c(head)
    position = len(head)
    for r in ranges:
        if r.offset != position:
            raise FormatError(f"parts recorded for {where} do not tile the file at byte {position}")
        crc = crc32c_combine(crc, r.crc32c, r.length)
        position = r.end
    crc = crc32c(tail, crc)
    if crc != file.crc32c:
        raise ChecksumError(
            f"crc32c mismatch in {where}: expected {file.crc32c:#010x}, found {crc:#010x} "
            "(header, footer and recorded part checksums combined)"
        )


def check_size(where: str, expected: int, found: int) -> None:
    """FormatError naming ``where`` when a file's size is not the recorded one."""
    if expected != found:
        raise FormatError(
            f"{where} is truncated or was modified: expected {expected} bytes, found {found}"
        )


class SparseFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes where only some ranges are present.

    Used to decode verified parts with a reader that wants a whole file (Parquet): a read
    outside the present ranges raises FormatError instead of returning unverified bytes.
    """

    def __init__(self, size: int, where: str) -> None:
        super().__init__()
        self._size = size
        self._where = where
        self._pos = 0
        self._ranges: dict[int, pa.Buffer] = {}

    def put(self, offset: int, data: Any) -> None:
        """Make ``data`` present at ``offset``."""
        self._ranges[offset] = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)

    def drop(self, offset: int) -> None:
        """Forget the range starting at ``offset``."""
        self._ranges.pop(offset, None)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        return self.read_buffer(size).to_pybytes()

    def read_buffer(self, size: int = -1) -> pa.Buffer:
        """The next ``size`` bytes without copying (Arrow's Python file adapter uses this)."""
        end = self._size if size is None or size < 0 else min(self._pos + size, self._size)
        for start, data in self._ranges.items():
            if start <= self._pos and end <= start + data.size:
                out = data.slice(self._pos - start, end - self._pos)
                self._pos = end
                return out
        raise FormatError(
            f"{self._where}: a reader asked for bytes [{self._pos}, {end}) outside the "
            "verified parts and footer; the file does not match its recorded parts"
        )
