"""A thread pool that survives ``fork``, its threads at a lower priority when asked."""

from __future__ import annotations

import functools
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class LazyPool:
    """A thread pool made on first use, and made anew in a child process after ``fork``:
    a pool inherited through ``fork`` has no threads left, and work given to it would
    never run.

    ``nice``: how much lower than the thread that starts them the pool's threads run
    (:func:`lower_priority`), for work that may wait while other threads use the cores.
    """

    def __init__(self, workers: int, name: str, *, nice: int = 0) -> None:
        self._workers, self._name, self._nice = workers, name, nice
        self._pool: ThreadPoolExecutor | None = None
        self._made = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._made:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._workers,
                    thread_name_prefix=self._name,
                    initializer=functools.partial(lower_priority, self._nice),
                )
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)

    def _forget(self) -> None:
        self._pool, self._made = None, threading.Lock()


def lower_priority(steps: int) -> None:
    """Lower the calling thread's scheduling priority by ``steps`` nice values (to 19 at
    most), where the system gives each thread its own: Linux, whose ``setpriority`` takes a
    thread's id. Elsewhere it would change the whole process's, so nothing is done; a
    refusal changes nothing either (lowering one's own priority is never refused on Linux)."""
    if not steps or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, now + steps))
    except OSError:
        pass
