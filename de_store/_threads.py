"""A thread pool that survives ``fork``, its threads at a lower priority and kept apart on
the cores when asked."""

from __future__ import annotations

import functools
import itertools
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
    ``apart``: each thread keeps to its own share of the cores (:func:`keep_apart`), for
    work that keeps every thread busy at once.
    """

    def __init__(self, workers: int, name: str, *, nice: int = 0, apart: bool = False) -> None:
        self._workers, self._name, self._nice, self._apart = workers, name, nice, apart
        self._pool: ThreadPoolExecutor | None = None
        self._made = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._made:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._workers,
                    thread_name_prefix=self._name,
                    initializer=functools.partial(
                        _start_worker, self._nice, self._apart, self._workers, itertools.count()
                    ),
                )
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)

    def _forget(self) -> None:
        self._pool, self._made = None, threading.Lock()


def _start_worker(nice: int, apart: bool, workers: int, started: itertools.count[int]) -> None:
    """Set up the pool thread that calls it: its priority, and its share of the cores
    (``started``: the pool's count of threads started, read once by each)."""
    lower_priority(nice)
    if apart:
        keep_apart(next(started), workers)


def keep_apart(index: int, workers: int) -> None:
    """Keep the calling thread, the ``index``-th of ``workers`` threads that work side by
    side, to its own share of the cores it may run on: every ``workers``-th of them, from
    the ``index``-th on. Only where the system sets the cores of each thread (Linux's
    ``sched_setaffinity`` takes a thread's id) and there are at least as many cores as
    threads; a refusal changes nothing.

    Why: Linux balances the cores by the weight of what runs on them, and a thread at a
    lower priority (:func:`lower_priority`) weighs a tenth of one at the normal priority
    or less. Two such threads can then share one core while a thread of normal priority
    holds the other, and when that thread waits for their work its core idles (what it
    cost a zstd save on two cores: ``docs/benchmarks.md``, *Fewer bytes*). Each in its own
    share, every core has one of them to run whenever the threads above them wait."""
    if workers < 2 or not hasattr(os, "sched_setaffinity"):
        return
    thread = threading.get_native_id()
    try:
        cores = sorted(os.sched_getaffinity(thread))
        if len(cores) >= workers:
            os.sched_setaffinity(thread, cores[index % workers :: workers])
    except OSError:
        pass


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
