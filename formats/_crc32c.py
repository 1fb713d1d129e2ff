"""crc32c (Castagnoli), the checksum of every byte de_store writes and reads back.

Computed by the AWS Common Runtime's checksums (``awscrt``): with the processor's crc32
instruction, carry-less multiplication where the processor has it, and the interpreter
lock let go while it sums, so a thread summing a part runs beside the threads writing,
reading and compressing. The same value as any crc32c (RFC 3720), google-crc32c's
included.
"""

from __future__ import annotations

from typing import Any

from awscrt import checksums


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c of the bytes already summed into ``crc`` followed by ``data`` (any contiguous
    buffer: bytes, memoryview, numpy array, Arrow buffer)."""
    return int(checksums.crc32c(data, crc))
