"""Freed memory handed back to the system after the steps that read a checkpoint, and
whether TensorFlow's CPU allocator keeps what it frees.

glibc's allocator keeps what a thread frees in that thread's arena for its next
allocations. The buffers a restore or a follower's apply reads shard parts into are freed
when the rows are loaded, but stay in the process: read-ahead windows of hundreds of MiB,
in the arenas of the threads that read them. ``malloc_trim`` hands their whole free pages
back (a few milliseconds); elsewhere than glibc nothing is done.

TensorFlow's default CPU allocator on x86 Linux (oneDNN's) serves buffers of 256 KiB or
more from a BFC allocator that keeps every buffer freed for its later allocations and
never returns it; with ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1``, or without oneDNN, they come
from malloc and go back to it. A growing table picks its row store's growth by which
(:func:`cpu_allocator_keeps_freed`, docs/architecture.md, *The memory of a growing table*).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["cpu_allocator_keeps_freed", "release_freed_memory"]

#: Bytes of the tensor :func:`cpu_allocator_keeps_freed` allocates: past oneDNN's 256 KiB
#: threshold for its BFC allocator.
_PROBE_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Any:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_memory() -> None:
    """Hand the whole free pages malloc holds back to the system (glibc's ``malloc_trim``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def cpu_allocator_keeps_freed() -> bool:
    """Whether TensorFlow's CPU allocator in this process keeps the big buffers it frees.

    Read from the allocator's own statistics while a 1 MiB tensor is alive: a BFC
    allocator counts it in use; TensorFlow's plain CPU allocator has no statistics, and
    oneDNN's with ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1`` counts nothing (malloc holds it).
    Where no tensor can be made at once (a ``tf.compat.v1`` program without eager
    execution), it answers True: tables there grow as under TensorFlow's default.
    TensorFlow is imported here, not with the module: the saver's restore imports this
    module for :func:`release_freed_memory` in processes that only read rows.
    """
    import tensorflow as tf

    with tf.init_scope(), tf.device("/CPU:0"):
        if not tf.executing_eagerly():
            return True
        probe = tf.fill([_PROBE_BYTES // 4], 0.0)
        try:
            in_use = tf.config.experimental.get_memory_info("CPU:0")["current"]
        except ValueError:  # "Allocator stats not available": not a pooling allocator
            return False
        del probe
    return in_use >= _PROBE_BYTES
