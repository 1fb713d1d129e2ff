"""Barriers: wait until every rank of a save has reached the same point.

Two implementations of one small contract:

- :class:`StorageBarrier` works wherever all ranks see the same storage path: each rank
  writes an arrival file and polls for the others'.
- :class:`CoordinationServiceBarrier` uses TensorFlow's coordination service, available when
  the job runs as a ``tf.distribute`` multi-worker cluster.

Both also let the ranks of one save attempt agree on a value rank 0 drew (:meth:`Barrier.agree`,
the save's attempt id), so that files left by an earlier, dead attempt of the same job are
never taken for this attempt's.
"""

from __future__ import annotations

import abc
import contextlib
import json
import time
import uuid
from collections.abc import Callable

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.retry import NO_RETRY, RetryPolicy, is_transient
from de_store.checkpoint.topology import Topology
from de_store.errors import BarrierTimeoutError

_POLL_START_S = 0.005
_POLL_MAX_S = 0.25
#: Storage requests per second that the waiting ranks of one job make together, at most
#: (once their pauses have grown): polls of many ranks would otherwise crowd out the
#: requests of the commit they wait for, and reach an object store's request rate limit
#: (S3: 5,500 reads a second per prefix) at a few thousand ranks.
JOB_POLLS_PER_S = 100


def job_poll_max_s(proc_size: int, requests_per_poll: int = 1) -> float:
    """The longest pause between two polls of one rank in a job of ``proc_size`` ranks,
    each poll making ``requests_per_poll`` requests."""
    return max(_POLL_MAX_S, proc_size * requests_per_poll / JOB_POLLS_PER_S)


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

    def agree(self, tag: str, proposal: str, timeout_s: float) -> str:
        """Return rank 0's ``proposal`` on every rank, once all ranks of this attempt have it.

        Rank 0 returns only when every rank has taken its proposal; the other ranks return
        rank 0's proposal of this attempt, never a value published by an earlier attempt
        of the same job (a retry after a crash). Multi-process saves call it first.

        Raises
        ------
        de_store.errors.BarrierTimeoutError
            Not all ranks agreed within ``timeout_s``; the message names the missing ones.
        NotImplementedError
            The barrier implements only :meth:`wait` (enough for a single process).
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot agree on a save attempt ({tag!r}): a barrier "
            "of a multi-process save must implement Barrier.agree"
        )


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
        return self._backend.join(self._folder, names.barrier_file(tag, rank))

    def wait(self, tag: str, timeout_s: float) -> None:
        if self._topology.proc_size == 1:
            return  # no one to wait for: no file to write, list and delete
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
            raise self._timeout(tag, missing, timeout_s)

    def agree(self, tag: str, proposal: str, timeout_s: float) -> str:
        """A handshake in the files of ``tag``, safe against files of an earlier attempt.

        Each other rank writes a fresh random nonce; rank 0 answers with its proposal and
        the nonces it read, and again whenever it reads a new one (the first it read may be
        an earlier attempt's). A rank takes the proposal only from an answer that holds its
        own nonce, then notes the proposal in its file; rank 0 returns once every rank did.
        """
        if self._topology.proc_size == 1:
            return proposal
        if self._topology.is_chief:
            self._answer_until_agreed(tag, proposal, timeout_s)
            return proposal
        return self._take_answer(tag, timeout_s)

    def _answer_until_agreed(self, tag: str, proposal: str, timeout_s: float) -> None:
        others = range(1, self._topology.proc_size)
        nonces: dict[str, str] = {}
        answered: dict[str, str] | None = None
        agreed: set[int] = set()

        def everyone_agreed() -> bool:
            nonlocal answered
            for rank in set(others) - agreed:
                note = self._read_note(self._arrival(tag, rank))
                if note is not None and note.get("agreed") == proposal:
                    agreed.add(rank)
                elif note is not None and isinstance(note.get("nonce"), str):
                    nonces[str(rank)] = str(note["nonce"])
            if len(agreed) == len(others):
                return True
            if nonces != answered:
                self._write_note(self._arrival(tag, 0), {"value": proposal, "nonces": nonces})
                answered = dict(nonces)
            return False

        if not poll_until(everyone_agreed, timeout_s, job_poll_max_s(self._topology.proc_size)):
            raise self._timeout(tag, sorted(set(others) - agreed), timeout_s)

    def _take_answer(self, tag: str, timeout_s: float) -> str:
        rank = self._topology.proc_rank
        nonce = uuid.uuid4().hex
        self._write_note(self._arrival(tag, rank), {"nonce": nonce, "agreed": None})
        taken: list[str] = []

        def answered() -> bool:
            answer = self._read_note(self._arrival(tag, 0))
            nonces = answer.get("nonces") if answer is not None else None
            if isinstance(nonces, dict) and nonces.get(str(rank)) == nonce:
                taken.append(str(answer["value"]))  # type: ignore[index]
            return bool(taken)

        if not poll_until(answered, timeout_s, job_poll_max_s(self._topology.proc_size)):
            raise BarrierTimeoutError(
                f"barrier {tag!r} at {self._where}: rank 0 did not answer rank {rank} of "
                f"{self._topology.proc_size} within {timeout_s:g} s (this is rank {rank})"
            )
        self._write_note(self._arrival(tag, rank), {"nonce": nonce, "agreed": taken[0]})
        return taken[0]

    def _write_note(self, path: str, note: dict[str, object]) -> None:
        data = json.dumps(note, sort_keys=True).encode()
        self._retry.call(lambda: self._backend.write_bytes(path, data))

    def _read_note(self, path: str) -> dict[str, object] | None:
        """A rank's note, or None while it is missing, unreadable for now, or not JSON."""
        try:
            note = json.loads(self._backend.read_bytes(path))
        except FileNotFoundError:
            return None
        except ValueError:
            return None
        except Exception as err:
            if not is_transient(err):
                raise
            return None
        return note if isinstance(note, dict) else None

    @property
    def _where(self) -> str:
        return Location(self._backend, self._folder).url

    def _timeout(self, tag: str, missing: list[int], timeout_s: float) -> BarrierTimeoutError:
        return BarrierTimeoutError(
            f"barrier {tag!r} at {self._where}: rank(s) {missing} of "
            f"{self._topology.proc_size} did not arrive within {timeout_s:g} s "
            f"(this is rank {self._topology.proc_rank})"
        )


def poll_until(
    done: Callable[[], bool], timeout_s: float, max_delay_s: float = _POLL_MAX_S
) -> bool:
    """Call ``done`` with growing pauses (up to ``max_delay_s``) until it returns True
    (then True) or the time is up (then False)."""
    deadline = time.monotonic() + timeout_s
    delay = _POLL_START_S
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, max_delay_s)
    return True


def wait_for_paths(backend: Backend, paths: dict[int, str], timeout_s: float) -> list[int]:
    """Poll until every path exists; return the ranks whose path is still missing.

    Where the backend lists, a poll is one listing of the paths' folder (one request per
    thousand files on an object store); otherwise one ``exists`` per missing path, with
    pauses that keep the job's request rate bounded (:func:`job_poll_max_s`)."""
    pending = dict(paths)
    folders = {path.rpartition("/")[0] for path in paths.values()}
    listed = backend.capabilities.supports_listing and len(folders) == 1

    def all_exist() -> bool:
        if listed:
            found = set(_list(backend, next(iter(folders))))
            for rank, path in list(pending.items()):
                if path in found:
                    del pending[rank]
            return not pending
        for rank, path in list(pending.items()):
            if _exists(backend, path):
                del pending[rank]
        return not pending

    poll_until(all_exist, timeout_s, _POLL_MAX_S if listed else job_poll_max_s(len(paths)))
    return sorted(pending)


def _list(backend: Backend, folder: str) -> list[str]:
    """``backend.list``; a transient failure or a missing folder lists nothing (polled
    again)."""
    try:
        return backend.list(folder)
    except FileNotFoundError:
        return []
    except Exception as err:
        if not is_transient(err):
            raise
        return []


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

    def agree(self, tag: str, proposal: str, timeout_s: float) -> str:
        """Through the service's key-value store: rank 0 sets the key before a barrier, the
        others read it after; the service lives as long as the job, so a restarted job
        never sees an earlier attempt's key."""
        from tensorflow.python.eager import context

        service = context.context()
        key = f"{self._prefix}:{tag}"
        chief = self._topology.is_chief
        if chief:
            with contextlib.suppress(Exception):  # left by an attempt that failed in between
                service.delete_config_key_value(key)
            self._call(tag, lambda: service.set_config_key_value(key, proposal))
        self.wait(f"{tag}:published", timeout_s)
        value = proposal
        if not chief:
            value = str(
                self._call(tag, lambda: service.get_config_key_value(key, int(timeout_s * 1e3)))
            )
        self.wait(f"{tag}:taken", timeout_s)  # rank 0 may replace the key once all have it
        if chief:
            self._call(tag, lambda: service.delete_config_key_value(key))
        return value

    def _call(self, tag: str, step: Callable[[], object]) -> object:
        try:
            return step()
        except Exception as err:
            raise BarrierTimeoutError(
                f"coordination-service key {self._prefix}:{tag} failed on rank "
                f"{self._topology.proc_rank} of {self._topology.proc_size}: {err}"
            ) from err
