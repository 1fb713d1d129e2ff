"""Calls that wait on a store, made side by side in threads.

On an object store each read, size or existence check is a request whose latency the
caller would otherwise pay once per item: a commit's read of the rank manifests, the
size checks of a checkpoint's files (read or verified), the orphan search's reads of a
root's checkpoints.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_in_threads(fn: Callable[[T], R], items: Sequence[T], limit: int, name: str) -> list[R]:
    """``[fn(item) for item in items]``, up to ``limit`` calls at once in threads named
    ``name``; in the calling thread when there is at most one item. The first exception
    raised is raised here, once every call has ended."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(min(limit, len(items)), name) as pool:
        return list(pool.map(fn, items))
