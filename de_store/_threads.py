"""A thread pool that survives ``fork``."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class LazyPool:
    """A thread pool made on first use, and made anew in a child process after ``fork``:
    a pool inherited through ``fork`` has no threads left, and work given to it would
    never run."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = workers, name
        self._pool: ThreadPoolExecutor | None = None
        self._made = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._made:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)

    def _forget(self) -> None:
        self._pool, self._made = None, threading.Lock()
