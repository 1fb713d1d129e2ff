"""Barriers: wait until every rank of a save has reached the same point.

Two implementations of one small contract:

- :class:`StorageBarrier` works wherever all ranks see the same storage path: each rank
  writes an arrival file and polls for the others'.
- :class:`CoordinationServiceBarrier` uses TensorFlow's coordination service, available when
  the job runs as a ``tf.distribute`` multi-worker cluster.
"""

from __future__ import annotations

import abc
import time

from de_store.backends.base import Backend
from de_store.errors import BarrierTimeoutError
from de_store.saver.retry import NO_RETRY, RetryPolicy, is_transient
from de_store.saver.topology import Topology

BARRIER_DIR = "_barrier"
_POLL_START_S = 0.005
_POLL_MAX_S = 0.25


class Barrier(abc.ABC):
    """Gathers the ranks of a save at rank 0.

    Rank 0 returns from :meth:`wait` only once every rank has called it with the same tag;
    other ranks may return as soon as they have arrived (they then wait for rank 0's commit,
    which they see in the storage itself).
    """

    @abc.abstractmethod
    def wait(self, tag: str, timeout_s: float) -> None:
        """Arrive at ``tag``; on rank 0, return once every rank has arrived.

        Raises
        ------
        de_store.errors.BarrierTimeoutError
            Some ranks did not arrive within ``timeout_s``; the message names them.
        """


class StorageBarrier(Barrier):
    """Arrival files under ``folder`` of a shared backend; rank 0 polls for all of them."""

    def __init__(
        self, backend: Backend, folder: str, topology: Topology, retry: RetryPolicy = NO_RETRY
    ) -> None:
        self._backend = backend
        self._folder = folder
        self._topology = topology
        self._retry = retry

    def _arrival(self, tag: str, rank: int) -> str:
        return self._backend.join(self._folder, BARRIER_DIR, tag, f"rank-{rank:05d}")

    def wait(self, tag: str, timeout_s: float) -> None:
        arrival = self._arrival(tag, self._topology.proc_rank)
        self._retry.call(lambda: self._backend.write_bytes(arrival, b""))
        if not self._topology.is_chief:
            return  # rank 0 may commit (and rename the folder) as soon as all have arrived
        missing = wait_for_paths(
            self._backend,
            {r: self._arrival(tag, r) for r in range(self._topology.proc_size)},
            timeout_s,
        )
        if missing:
            raise BarrierTimeoutError(
                f"barrier {tag!r} at {self._backend.url}/{self._folder}: rank(s) "
                f"{missing} of {self._topology.proc_size} did not arrive within "
                f"{timeout_s:g} s (this is rank {self._topology.proc_rank})"
            )


def wait_for_paths(backend: Backend, paths: dict[int, str], timeout_s: float) -> list[int]:
    """Poll until every path exists; return the ranks whose path is still missing."""
    deadline = time.monotonic() + timeout_s
    pending = dict(paths)
    delay = _POLL_START_S
    while True:
        pending = {r: p for r, p in pending.items() if not _exists(backend, p)}
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, _POLL_MAX_S)


def _exists(backend: Backend, path: str) -> bool:
    """``backend.exists``; a transient failure counts as "not yet" (polled again)."""
    try:
        return backend.exists(path)
    except Exception as err:
        if not is_transient(err):
            raise
        return False


class CoordinationServiceBarrier(Barrier):
    """A barrier through TensorFlow's coordination service (multi-worker clusters)."""

    def __init__(self, topology: Topology, prefix: str = "de_store") -> None:
        self._topology = topology
        self._prefix = prefix

    def wait(self, tag: str, timeout_s: float) -> None:
        from tensorflow.python.eager import context

        barrier_id = f"{self._prefix}:{tag}"
        try:
            context.context().wait_at_barrier(barrier_id, int(timeout_s * 1000))
        except Exception as err:  # the service reports missing tasks in its message
            raise BarrierTimeoutError(
                f"coordination-service barrier {barrier_id!r} failed on rank "
                f"{self._topology.proc_rank} of {self._topology.proc_size}: {err}"
            ) from err
