"""Freed memory handed back to the system after the steps that read a checkpoint or grow
a table, and before a save writes.

glibc's allocator keeps what a thread frees in that thread's arena for its next
allocations. The buffers a restore or a follower's apply reads shard parts into are freed
when the rows are loaded, but stay in the process: read-ahead windows of hundreds of MiB,
in the arenas of the threads that read them. Where TensorFlow allocates with malloc
(``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1``, or no oneDNN), so do the stores a growing table
replaced. A save begins by handing back what ran before it freed (a fill's or a training
loop's temporaries), so that its peak holds the table and not the process's past.
``malloc_trim`` hands the whole free pages back (a few milliseconds); elsewhere than glibc
nothing is done. A restore reads its local parts into buffers of Arrow's memory pool
(mimalloc or jemalloc), which keeps what they freed as well: ``release_unused`` hands it
back after the read (287 MiB after a fresh restore of 10M x 16 keys here).

Where TensorFlow allocates with oneDNN's BFC allocator (its default CPU allocator on x86
Linux), the stores a growth replaced go back to BFC's pool instead, which keeps them for
later allocations and never hands their pages back: a table filled to 50M keys holds GiBs
of them beside it. :func:`release_free_chunks` hands back the pages of the chunks BFC
holds free: it takes each chunk as a tensor of its own (``Empty``, which BFC serves from
its free chunks, best fit), tells the kernel its pages are not needed
(``madvise(MADV_DONTNEED)``) and frees it. Only memory the call holds alone is touched:
the pages of a chunk go while the call holds it out of the pool, and the tensors of a
table, a training step or a save are never in the pool. A page handed back reads as
zeros when BFC next hands out its chunk, and an allocation never relies on what was
there before.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = [
    "buffer_address",
    "collapse_huge_pages",
    "cpu_bytes_in_use",
    "release_free_chunks",
    "release_freed_memory",
]

#: Free chunks smaller than this keep their pages: they serve a training step's own
#: temporaries, and handing back a few MiB is not worth the faults of their next use.
MIN_RELEASE_BYTES = 16 << 20
#: Chunks one :func:`release_free_chunks` takes at most (a bound: each size ends when BFC
#: serves the fallback chunk).
MAX_PROBES = 256
_MADV_DONTNEED = 4
_MADV_COLLAPSE = 25  # Linux 6.1 and later
#: A transparent huge page (x86-64, and arm64 with 4 KiB pages).
HUGE_PAGE = 2 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _malloc_trim() -> Any:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_memory(read_buffers: bool = False) -> None:
    """Hand the whole free pages malloc holds back to the system (glibc's ``malloc_trim``);
    with ``read_buffers`` (after a restore or a follower's apply), also those Arrow's
    memory pool holds free (``release_unused``), where pyarrow is imported: local parts
    are read into buffers of that pool. A save leaves the pool as it is: its compressed
    frames come from it, and the memory of one save's frames serves the next one's."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    arrow = sys.modules.get("pyarrow") if read_buffers else None
    if arrow is not None:
        arrow.default_memory_pool().release_unused()


@functools.cache
def _page_calls() -> Any:
    """libc's ``madvise`` and ``mincore`` and Python's ``PyCapsule_GetPointer`` (None where
    not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "madvise") or not hasattr(libc, "mincore"):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_pointer.restype = ctypes.c_void_p
    capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return libc, capsule_pointer


def cpu_bytes_in_use() -> int | None:
    """Bytes TensorFlow's CPU allocator counts in use; None where it keeps no count (the
    system allocator answers 0 or raises) or the pages cannot be handed back here."""
    if _page_calls() is None:
        return None
    import tensorflow as tf  # the restore flow imports this module without TensorFlow

    try:
        in_use = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    except (ValueError, tf.errors.OpError):
        return None
    return in_use or None


def buffer_address(tensor: tf.Tensor) -> int:
    """The address of a CPU tensor's buffer (through DLPack, without a copy)."""
    import tensorflow as tf

    calls = _page_calls()
    assert calls is not None
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    return int(ctypes.c_void_p.from_address(calls[1](capsule, b"dltensor")).value or 0)


def collapse_huge_pages(tensor: tf.Tensor) -> int:
    """Back the whole 2 MiB spans of a CPU tensor's buffer, every page of which has been
    written, with transparent huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1 and
    later); return the bytes now on huge pages (0 where the kernel refused or cannot).

    The contents do not change, and no page is added (the spans lie inside the buffer,
    all of whose pages are resident): the kernel copies each span's pages into one huge
    page, which a TLB entry covers whole. A table's index is read at random: 256 MiB of
    it on 4 KiB pages cost a TLB miss on almost every probe (docs/architecture.md,
    *Huge pages for the index*).
    """
    calls = _page_calls()
    if calls is None:
        return 0
    import tensorflow as tf

    size = int(tf.size(tensor)) * tensor.dtype.size
    start = buffer_address(tensor)
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + size) // HUGE_PAGE * HUGE_PAGE
    if last <= first or calls[0].madvise(first, last - first, _MADV_COLLAPSE) != 0:
        return 0
    return last - first


def release_free_chunks(freed: list[tuple[int, int]], live: list[tuple[int, int]]) -> int:
    """Hand back the pages of the chunks TensorFlow's CPU allocator holds free, given the
    ``(address, bytes)`` of buffers the caller saw freed into its pool (the arrays a
    growth replaced) and of buffers it holds (the arrays that replaced them); return the
    bytes whose pages went.

    BFC serves the smallest free chunk that fits, the lowest address first among equals,
    and reserves new memory only when no free chunk fits. The biggest freed buffer that
    no live one overlaps (a buffer allocated after it in the same growth may have taken
    its memory) is free, so a chunk of its size is free:

    1. Chunks of that size are taken and held, their pages handed back, until BFC serves
       the buffer itself, or a chunk with no page resident (one handed back before: free
       as well). That last chunk goes back to the pool at once: it stays free, the
       fallback of every request that follows, all smaller.
    2. Then sizes go down by halves to :data:`MIN_RELEASE_BYTES`. At each, chunks are
       taken and held (so that the next request is served another), their resident
       pages handed back, until BFC serves a piece of that fallback: the chunks left that
       fit are no smaller than it.

    At the end every chunk taken goes back to the pool. A chunk whose pages went reads
    as zeros when BFC next serves it. Were the buffer not free after all (another thread
    took its memory in between), BFC would reserve memory for one request of step 1,
    which then serves as the fallback.
    """
    calls = _page_calls()
    targets = [(a, n) for a, n in freed if n >= MIN_RELEASE_BYTES and not _overlaps(a, n, live)]
    if calls is None or not targets:
        return 0
    libc = calls[0]
    target = max(targets, key=lambda t: t[1])
    size = _pages(target[1])
    held: list[tf.Tensor] = []
    released = probes = 0
    try:
        while True:
            probes += 1
            chunk, start = _take(size)
            pages = _hand_back(libc, start, size)
            released += pages
            if not pages or _overlaps(start, size, [target]) or probes >= MAX_PROBES:
                break
            held.append(chunk)
        fallback = [(start, size)]
        chunk = None  # back to the pool
        size = _pages(size // 2)
        while size >= MIN_RELEASE_BYTES and probes < MAX_PROBES:
            while probes < MAX_PROBES:
                probes += 1
                chunk, start = _take(size)
                if _overlaps(start, size, fallback):
                    break
                released += _hand_back(libc, start, size)
                held.append(chunk)
            chunk = None
            size = _pages(size // 2)
    finally:
        held.clear()
    return released


def _pages(size: int) -> int:
    """``size`` rounded down to whole pages: every chunk taken is exactly that big, so
    that no page handed back reaches past it."""
    return size // _PAGE * _PAGE


def _take(size: int) -> tuple[tf.Tensor, int]:
    """A chunk of ``size`` bytes (whole pages) from TensorFlow's CPU allocator, unwritten,
    and its address."""
    import tensorflow as tf

    assert size % _PAGE == 0, size
    with tf.device("/CPU:0"):
        chunk = tf.raw_ops.Empty(shape=[size // _PAGE, _PAGE], dtype=tf.uint8, init=False)
    return chunk, buffer_address(chunk)


def _overlaps(start: int, size: int, buffers: list[tuple[int, int]]) -> bool:
    return any(start < a + n and a < start + size for a, n in buffers)


def _hand_back(libc: Any, start: int, size: int) -> int:
    """``madvise(MADV_DONTNEED)`` the whole pages inside ``[start, start + size)`` when one
    of them is resident; return their bytes (0 when none was resident)."""
    first, last = whole_pages(start, size)
    try:
        if last <= first or not resident_bytes(first, last - first):
            return 0
    except OSError:  # the kernel cannot tell: leave the pages
        return 0
    if libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


def whole_pages(start: int, size: int) -> tuple[int, int]:
    """The first and the end address of the whole pages inside ``[start, start + size)``."""
    return -(-start // _PAGE) * _PAGE, (start + size) // _PAGE * _PAGE


def resident_bytes(start: int, size: int) -> int:
    """The bytes of the resident pages of ``[start, start + size)`` (page-aligned), as
    ``mincore`` reports them; OSError where it cannot tell."""
    calls = _page_calls()
    if calls is None:
        raise OSError("mincore is not available here")
    pages = np.zeros(size // _PAGE, dtype=np.uint8)
    if calls[0].mincore(start, size, pages.ctypes.data) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mincore of {size} bytes at {start:#x}: {os.strerror(error)}")
    return int(np.count_nonzero(pages & 1)) * _PAGE
