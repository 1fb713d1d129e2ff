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
nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["release_freed_memory"]


@functools.cache
def _malloc_trim() -> Any:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def release_freed_memory() -> None:
    """Hand the whole free pages malloc holds back to the system (glibc's ``malloc_trim``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
