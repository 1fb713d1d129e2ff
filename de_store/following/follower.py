"""A serving process follows training: each newly committed checkpoint is applied to its
live tables while lookups go on.

:class:`Follower` polls a checkpoint root (any URL de_store saves to) from a background
thread. When a checkpoint newer than the one its tables hold is committed, it reads all
of it, checked, and then applies it in small steps (see :mod:`._apply`): a delta as
removals and upserts, a full checkpoint as upserts and then removals of the keys it no
longer holds. The tables are never emptied and never half-loaded to readers: a lookup
sees each key's row from the checkpoint held before or from the new one.

- A checkpoint that cannot be applied (a link of its chain gc'd or rewritten, a file
  damaged, a variable missing) changes nothing: the follower logs a WARNING, keeps
  serving what it holds and waits for the next checkpoint. A delta on a checkpoint it
  never applied is applied from its chain's full checkpoint when that is still there.
- Each checkpoint applied is logged at INFO with its rows and its lag (apply time minus
  commit time).
- Only the ``value`` column is applied: a serving table needs no optimizer slots.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from de_store._memory import release_freed_memory
from de_store.backends import Backend, Location, open_backend
from de_store.checkpoint.commit import commit_time
from de_store.checkpoint.retry import RetryPolicy
from de_store.errors import DeStoreError
from de_store.following import _apply, _targets, _watch
from de_store.saver.core import IOOptions

logger = logging.getLogger("de_store.follow")


@dataclasses.dataclass(frozen=True)
class AppliedCheckpoint:
    """One checkpoint a follower applied.

    Attributes
    ----------
    url: the checkpoint's URL.
    kind: "delta" (its links applied on what the tables held) or "full" (for at least
        one variable, a full load and the deltas after it).
    upserted, removed: rows upserted and keys removed, over all variables.
    committed: its commit time (seconds since the epoch, the saver's clock).
    applied: when the last of it was applied (this process's clock).
    """

    url: str
    kind: str
    upserted: int
    removed: int
    committed: float
    applied: float

    @property
    def lag_s(self) -> float:
        """Seconds from its commit to the end of its apply."""
        return self.applied - self.committed


class Follower:
    """Applies each newly committed checkpoint under ``url`` to live tables.

    Parameters
    ----------
    variables
        What to keep up to date: a de_store ``Variable``, a list of them, a Keras model
        or ``tf.Module`` holding them, or a SavedModel exported by de_store and loaded
        with ``tf.saved_model.load`` (its tables are found by their saved names). Each
        is matched to the checkpoints' variable of the same name.
    url
        The checkpoint root the trainer saves into (``file://``, ``s3://``, ``gs://``,
        any fsspec URL); its committed checkpoints at any depth are followed.
    storage_options
        fsspec options for ``url`` (credentials, endpoint).
    poll_interval_s
        Seconds between two listings of the root.
    full_load
        How a full checkpoint is applied: ``"staged"`` reads it whole into host memory,
        checked (a copy of its rows beside the tables while it applies); ``"streamed"``
        reads it once to check it, keeping only its keys (8 bytes a key), and again while
        applying it. Either way its keys are looked up in the tables and only the rows the
        tables do not hold with the same values are written (a streamed load looks each
        batch up twice), and the tables keep serving throughout; a streamed load whose
        second read fails leaves some keys at the new checkpoint and the others at the old
        one, logs a WARNING and loads the next checkpoint whole.
    chunk_rows
        Most keys one table operation applies: lookups wait at most one such step. The
        default stays below the batch size from which an insert runs XLA-compiled
        (16,384 keys), whose steps took 7-10 ms on a 10M-key table and doubled the lookup
        p99 of ``benchmarks/follow_bench.py``.
    retry
        Retries of each storage step.
    on_apply
        Called with each :class:`AppliedCheckpoint` right after it is applied, in the
        thread that applied it, before the next poll (a serving cache to refresh, a
        metric to export); an exception it raises is logged at ERROR.
    start
        Start the background thread now; else call :meth:`start` or :meth:`poll`.
    """

    def __init__(
        self,
        variables: Any,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        poll_interval_s: float = 0.1,
        full_load: str = "staged",
        chunk_rows: int = 4096,
        retry: RetryPolicy | None = None,
        on_apply: Callable[[AppliedCheckpoint], object] | None = None,
        start: bool = True,
    ) -> None:
        if full_load not in _apply.FULL_LOADS:
            raise ValueError(
                f"full_load must be one of {list(_apply.FULL_LOADS)}, got {full_load!r}"
            )
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.targets = _targets.find_variables(variables)
        self.url = url
        self._backend: Backend = open_backend(url, storage_options)
        self.poll_interval_s = float(poll_interval_s)
        self.full_load = full_load
        self.chunk_rows = chunk_rows
        self._options = IOOptions(retry=retry or RetryPolicy())
        self.on_apply = on_apply
        self._times: dict[tuple[str, int], float] = {}
        self._refused: set[tuple[str, int]] = set()
        self._held: _watch.Held | None = None
        self._mixed = False
        self._prepared = False
        self.history: collections.deque[AppliedCheckpoint] = collections.deque(maxlen=1000)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        if start:
            self.start()

    # -- control ---------------------------------------------------------------------
    def start(self) -> Follower:
        """Start following in a background thread (once)."""
        if self._thread is not None:
            raise RuntimeError(f"the follower of {self.url} was started already")
        self._thread = threading.Thread(target=self._run, name="de_store-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop following: the checkpoint being applied is finished first. Returns when the
        thread has ended (or after ``timeout_s``)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def applied(self) -> str | None:
        """The URL of the checkpoint the tables hold, or None before the first one."""
        held = self._held
        return None if held is None else Location(self._backend, held.folder).url

    def wait_for(self, check: Callable[[Follower], bool], timeout_s: float) -> bool:
        """Wait until ``check(self)`` holds after an apply (or now); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not check(self):
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return check(self)
                self._changed.wait(left)
        return True

    # -- following ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # a listing that failed: the next poll tries again
                logger.warning("following %s: polling failed", self.url, exc_info=True)
            self._stop.wait(self.poll_interval_s)

    def poll(self) -> AppliedCheckpoint | None:
        """One round: list the root and apply its newest committed checkpoint if the tables
        do not hold it. Returns what was applied, or None."""
        with self._poll_lock:
            newest = self._newest()
            if newest is None:
                return None
            key, held = (newest.folder, newest.generation), self._held
            if key in self._refused or (held is not None and key == (held.folder, held.generation)):
                return None
            applied = self._apply(newest)
            if applied is not None and not self._prepared:
                self._prepare_writes()
            release_freed_memory(read_buffers=True)  # what was read for it is freed by now
            return applied

    def _newest(self) -> _watch.Committed | None:
        found = _watch.committed_generations(self._backend)
        present = set(found.items())  # what is remembered of checkpoints gone goes too
        self._times = {key: at for key, at in self._times.items() if key in present}
        self._refused &= present
        newest: _watch.Committed | None = None
        for folder, generation in found.items():
            key = (folder, generation)
            if key in self._refused:
                continue
            if key not in self._times:
                try:
                    self._times[key] = commit_time(self._backend, folder, generation)
                except (DeStoreError, OSError) as err:  # gc'd meanwhile, or damaged
                    logger.warning("following %s: skipping %s: %s", self.url, folder, err)
                    self._refused.add(key)
                    continue
            at = self._times[key]
            if newest is None or (at, folder) > (newest.committed, newest.folder):
                newest = _watch.Committed(folder, generation, at)
        held = self._held
        if newest is not None and held is not None and newest.committed < held.committed:
            return None  # nothing newer than what the tables hold
        return newest

    def _apply(self, target: _watch.Committed) -> AppliedCheckpoint | None:
        where = Location(self._backend, target.folder).url
        try:
            update = _watch.plan_update(self._backend, target, list(self.targets),
                                        None if self._mixed else self._held,
                                        self._options.retry)  # fmt: skip
            _apply.check_update(self._backend, update, self.targets)
            read = _apply.read_update(self._backend, update, self._options, self.full_load)
        except Exception as err:  # damaged, gc'd, not for these tables, or unreadable
            serving = self.applied or "what the tables held"
            self._refuse(target, err, f"not applied, still serving {serving}")
            return None
        try:
            done = _apply.apply_update(self._backend, update, read, self.targets,
                                       self._options, self.chunk_rows)  # fmt: skip
        except Exception as err:  # a streamed full load's second read, a table that failed
            self._mixed = True
            self._refuse(target, err, "failed while applied; its keys are partly applied, "
                         "the next checkpoint is loaded whole")  # fmt: skip
            return None
        self._mixed = False
        applied = AppliedCheckpoint(where, "full" if update.full else "delta", done.upserted,
                                    done.removed, target.committed, time.time())  # fmt: skip
        with self._changed:
            self._held = _watch.Held(target.folder, target.generation, target.committed,
                                     update.manifest.created)  # fmt: skip
            self.history.append(applied)
            self._changed.notify_all()
        logger.info("following %s: applied %s (%s): %s rows upserted, %s keys removed, lag %.3f s",
                    self.url, where, applied.kind, f"{applied.upserted:,}", f"{applied.removed:,}",
                    applied.lag_s)  # fmt: skip
        if self.on_apply is not None:
            try:
                self.on_apply(applied)
            except Exception:
                logger.exception("following %s: on_apply failed for %s", self.url, where)
        return applied

    def _prepare_writes(self) -> None:
        """Set up the write steps of deltas once the first checkpoint is in (see
        :func:`._apply.prepare_writes`); should that fail, the first delta sets them up."""
        self._prepared = True
        try:
            _apply.prepare_writes(self.targets)
        except Exception:
            logger.debug("following %s: preparing the write steps failed", self.url,
                         exc_info=True)  # fmt: skip

    def _refuse(self, target: _watch.Committed, err: Exception, what: str) -> None:
        """Log why ``target`` is not applied (a WARNING, with the traceback of an error
        that is not a storage or checkpoint one) and never try it again."""
        self._refused.add((target.folder, target.generation))
        where = Location(self._backend, target.folder).url
        logger.warning("following %s: checkpoint %s %s: %s", self.url, where, what, err,
                       exc_info=not isinstance(err, (DeStoreError, OSError)))  # fmt: skip


def follow(variables: Any, url: str, **kwargs: Any) -> Follower:
    """Start a :class:`Follower` of the checkpoints under ``url`` (see there); call its
    ``stop()`` to end it."""
    return Follower(variables, url, **kwargs)
