"""Fixed-shape tables that grow like TFRA's: the chief grows them between the steps a
``ClusterCoordinator`` schedules.

A fixed-shape table (a table on a parameter server) can only grow eagerly, on the chief,
while no step runs (see *Fixed shapes* in :mod:`.hash_table`), and a call inside a step
that brings more new keys than the table has room for fails before it writes. When the
first such table is created, :func:`install` wraps ``ClusterCoordinator.schedule`` (the
class's method, once per process; ``model.fit`` schedules through it too). Before a step
is handed to the coordinator, the wrapper makes sure that every table the step writes has
room for it on top of the room promised to the steps queued or running:

- *What a step asks*, per table, comes from its traced graph (:mod:`._demand`): the
  calls that add keys (or log removals) and a bound of the keys they pass together,
  static (ids drawn in the step, a dataset batched with ``drop_remainder=True``) or in
  terms of the step's tensor arguments, whose sizes are known when it is scheduled.
  Without such a bound (a batch of unknown size from an iterator, a loop in the step, a
  call in a nested ``tf.function``) the step is asked ``OBSERVED_MARGIN`` times what the
  steps before passed: the most keys one call passed times the calls, or the mean a
  step passed if more (the calls count their keys on the table's device).
- *The room* is read from the tables (:func:`._fixed_growth.read_loads`: one call per PS task)
  only when the room promised since the last reading could run out. The steps in flight
  then are each counted at the most a step has asked, so a step that is queued, running
  or partly done holds its room until the next reading after it finished.
- *When the room could run out*: if each table has room for the step and one step of
  the most a step asks on each worker, the chief waits until half the steps in flight
  have finished. If not, it waits for every step in flight (``coordinator.join()``),
  grows each table with less room than ``WINDOW_STEPS`` steps of the most asked (two a
  worker if more), companion (optimizer slot) tables included, to the keys it holds
  plus that window (twice its keys, at least), then schedules. With no step in flight
  (the first steps) it grows at once.
- *A step of unknown demand* on a table no step has passed keys to runs alone: after the
  steps before it, and before the steps after it, which are then bounded by what it
  passed. Before it runs, each such table is given room for ``FIRST_STEP_ROOM`` more
  keys, as TFRA's tables start with, whatever ``init_size`` said.

What is guaranteed: a step whose keys have a bound before it runs never finds a table
short of room, whatever its keys. A step with an observed bound finds room for up to
``OBSERVED_MARGIN`` times what the steps before it passed, and the first such step for
up to ``FIRST_STEP_ROOM`` new keys a table. A step that passes more than that fails at
its first call without room, which writes nothing (the step's calls before it have
written). ``model.fit`` and a loop over a batched dataset pass at most a batch of keys a
step, which their first step shows unless it is a short batch. A coordinator whose steps
write no fixed-shape table schedules as before. Growths are logged under ``de_store`` at
INFO, with their time.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator
from tensorflow.python.util import nest

from de_store.tables import _demand
from de_store.tables._fixed_growth import UNLIMITED, Growth, Load, read_loads

log = logging.getLogger("de_store")

#: A growth leaves room for at least this many steps of the most a step asks of the table
#: (two a worker if more), and for as many keys more as the table holds, so that steps
#: go on without growing again soon.
WINDOW_STEPS = 8
#: A bound observed from the steps before (no static bound) is taken this many times over.
OBSERVED_MARGIN = 2
#: Seconds between looks at the coordinator's queue while steps in flight finish, at most.
POLL_S = 0.05
#: Before the first step of unknown demand runs alone, each table it writes without a
#: bound is given room for at least this many more keys (and removals): TFRA's tables
#: start with room for 8,192 keys, whatever ``init_size``.
FIRST_STEP_ROOM = 8192


@dataclass(frozen=True)
class Need:
    """What one step asks of one table, by kind of room: its calls, and the most keys
    they pass together when that is known before the step runs (None: observed)."""

    calls: tuple[int, int]
    bounds: tuple[int | None, int | None]


#: What a step whose graph is not known may ask: a call of each kind, of unknown size.
_UNKNOWN = Need((1, 1), (None, None))
_install_lock = threading.Lock()
_schedule: Any = None  # ClusterCoordinator.schedule as TensorFlow defines it
_keepers: weakref.WeakKeyDictionary[Any, Keeper] = weakref.WeakKeyDictionary()


def install() -> None:
    """Wrap ``ClusterCoordinator.schedule`` (once per process) so that fixed-shape tables
    grow ahead of the steps it schedules."""
    global _schedule
    with _install_lock:
        if _schedule is not None:
            return
        coordinator_class = cluster_coordinator.ClusterCoordinator
        original = coordinator_class.schedule

        @functools.wraps(original)
        def schedule(self: Any, fn: Any, args: Any = None, kwargs: Any = None) -> Any:
            with _install_lock:
                keeper = _keepers.get(self)
                if keeper is None:
                    keeper = _keepers[self] = Keeper()
            return keeper.schedule(self, fn, args, kwargs)

        _schedule = original
        coordinator_class.schedule = schedule


class Keeper:
    """Keeps the fixed-shape tables ahead of the steps one coordinator schedules."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: weakref.WeakKeyDictionary[Growth, Load] = weakref.WeakKeyDictionary()
        #: room promised since the last reading, and the most one step asked, by table
        self._promised: weakref.WeakKeyDictionary[Growth, list[int]] = weakref.WeakKeyDictionary()
        self._largest: weakref.WeakKeyDictionary[Growth, list[int]] = weakref.WeakKeyDictionary()
        self._probed: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Growth]] = (
            weakref.WeakKeyDictionary()
        )
        self._scheduled = 0  # steps handed to the coordinator
        self._finished = 0  # of those, finished at the last reading
        self._in_flight = 0  # queued or running at the last reading
        self._fresh = False  # no step was scheduled since the last reading
        self._unfinished: deque[threading.Event] = deque()  # of the steps scheduled here

    def schedule(self, coordinator: Any, fn: Any, args: Any, kwargs: Any) -> Any:
        """``coordinator.schedule(fn, args, kwargs)``, after making sure the tables the
        step writes have room for it."""
        plan, key = _plan(fn, args, kwargs)
        with self._lock:
            if plan:
                if any(t not in self._loads for t in plan):
                    self._refresh(coordinator)
                first = self._unobserved(plan, key)
                if first:
                    return self._run_alone(coordinator, plan, key, first, (fn, args, kwargs))
                self._admit(coordinator, plan)
            return self._dispatch(coordinator, fn, args, kwargs)

    # -- admission ---------------------------------------------------------------------
    def _admit(self, coordinator: Any, plan: dict[Growth, Need], skip: Any = ()) -> None:
        """Wait, or grow tables, until the step of ``plan`` fits in the room not promised
        yet; then promise it its room (tables in ``skip`` excepted)."""
        while True:
            asks = {t: self._ask(s, self._loads[t]) for t, s in plan.items() if t not in skip}
            short = {t: ask for t, ask in asks.items() if self._short(t, ask, coordinator)}
            idle = self._fresh and not self._in_flight
            if short and idle:  # nothing to wait for: grow now rather than later
                self._grow(coordinator, short)
            elif all(self._fits(t, ask) for t, ask in asks.items()):
                for table, ask in asks.items():
                    self._promise(table, ask)
                return
            elif not self._fresh:
                self._refresh(coordinator)
            elif short:
                self._grow(coordinator, short)
            else:  # the steps in flight hold the room: let some finish
                started = time.perf_counter()
                self._wait_for_steps(coordinator, self._in_flight // 2)
                log.debug("waited %.3f s for steps in flight to free table room", _since(started))
                self._refresh(coordinator)

    def _ask(self, need: Need, load: Load) -> tuple[int, int]:
        """The most room of each kind one step of ``need`` may take."""
        asks = []
        for kind in _demand.KINDS:
            bound = need.bounds[kind]
            if not need.calls[kind] or bound is not None:
                asks.append(bound or 0)
                continue
            mean = math.ceil(load.passed[kind] / max(self._finished, 1))
            asks.append(OBSERVED_MARGIN * max(load.peak[kind] * need.calls[kind], mean))
        return asks[0], asks[1]

    def _fits(self, table: Growth, ask: tuple[int, int]) -> bool:
        promised, free = self._promised.get(table, [0, 0]), self._loads[table].free
        return all(promised[k] + ask[k] <= free[k] for k in _demand.KINDS)

    def _short(self, table: Growth, ask: tuple[int, int], coordinator: Any) -> bool:
        """Whether ``table`` lacks room for this step and one step of the most asked on
        each worker: waiting for steps in flight would leave workers idle."""
        free, workers = self._loads[table].free, _workers(coordinator)
        return any(free[k] < self._steps(table, ask, k, workers) for k in _demand.KINDS)

    def _steps(self, table: Growth, ask: tuple[int, int], kind: int, count: int) -> int:
        """Room for this step's ``ask`` and ``count`` steps of the most asked."""
        largest = self._largest.get(table, [0, 0])[kind]
        return ask[kind] + count * max(largest, ask[kind])

    def _promise(self, table: Growth, ask: tuple[int, int]) -> None:
        promised = self._promised.setdefault(table, [0, 0])
        largest = self._largest.setdefault(table, [0, 0])
        for kind in _demand.KINDS:
            promised[kind] += ask[kind]
            largest[kind] = max(largest[kind], ask[kind])

    # -- steps of unknown demand -------------------------------------------------------
    def _unobserved(self, plan: dict[Growth, Need], key: Any) -> list[Growth]:
        """The tables ``plan`` writes without a static bound that no step has passed keys
        to yet, and no step of ``key`` ran alone on."""
        probed = self._probed.get(key, ())
        return [
            table
            for table, need in plan.items()
            if table not in probed
            and any(self._unbounded(need, self._loads[table], k) for k in _demand.KINDS)
        ]

    @staticmethod
    def _unbounded(need: Need, load: Load, kind: int) -> bool:
        """Whether ``need`` takes room of ``kind``, limited, with no bound known yet."""
        return bool(
            need.calls[kind]
            and need.bounds[kind] is None
            and not load.passed[kind]
            and load.free[kind] < UNLIMITED
        )

    def _run_alone(
        self, coordinator: Any, plan: Any, key: Any, first: list[Growth], call: tuple
    ) -> Any:
        """Schedule a step that writes ``first`` (tables of unknown demand) after the steps
        in flight, and wait for it: what it passed bounds the steps after it."""
        coordinator.join()
        self._refresh(coordinator)
        self._make_first_room(plan, first)
        self._admit(coordinator, plan, skip=first)
        names = ", ".join(sorted(t.table.table_name for t in first))
        log.info("the first step writing %s without a static bound runs alone", names)
        result = self._dispatch(coordinator, *call)
        coordinator.join()
        self._refresh(coordinator)
        if key is not None:
            self._probed.setdefault(key, weakref.WeakSet()).update(first)
        return result

    def _make_first_room(self, plan: dict[Growth, Need], first: list[Growth]) -> None:
        """Grow each table of ``first`` to room for ``FIRST_STEP_ROOM`` more keys (and
        removals) of each kind the step asks without a bound (no step runs now)."""
        for table in first:
            load = self._loads[table]
            counts = [
                load.used[k] + FIRST_STEP_ROOM
                if self._unbounded(plan[table], load, k) and load.free[k] < FIRST_STEP_ROOM
                else 0
                for k in _demand.KINDS
            ]
            if any(counts):
                self._loads[table] = _grow_table(table, load, counts, 0.0)

    # -- readings, waits and growth ----------------------------------------------------
    def _dispatch(self, coordinator: Any, fn: Any, args: Any, kwargs: Any) -> Any:
        result = _schedule(coordinator, fn, args=args, kwargs=kwargs)
        self._scheduled += 1
        self._fresh = False
        finished = getattr(result, "_status_available_event", None)  # set when it ends
        if isinstance(finished, threading.Event):
            self._forget_finished()
            self._unfinished.append(finished)
        return result

    def _refresh(self, coordinator: Any) -> None:
        """Read every table's load; the steps in flight are counted first (a step that
        finishes meanwhile is counted twice: room kept, never missed)."""
        in_flight = _in_flight(coordinator)
        tables = _demand.live()
        self._loads = weakref.WeakKeyDictionary(zip(tables, read_loads(tables), strict=True))
        self._in_flight, self._finished = in_flight, self._scheduled - in_flight
        self._promised = weakref.WeakKeyDictionary(
            (t, [in_flight * most for most in self._largest.get(t, [0, 0])]) for t in tables
        )
        self._fresh = True

    def _grow(self, coordinator: Any, asks: dict[Growth, tuple[int, int]]) -> None:
        """Wait for every step in flight, then grow each table with less room than a
        window of ``WINDOW_STEPS`` steps, or two a worker if more (``asks``: what the
        step being scheduled asks):
        those short now, and those that would be soon (one growth, which instantiates the
        steps again on the workers, instead of two), to the keys each holds plus a window."""
        started = time.perf_counter()
        coordinator.join()
        waited = _since(started)
        self._refresh(coordinator)
        steps = max(WINDOW_STEPS, 2 * _workers(coordinator))  # more than a worker each
        for table, load in list(self._loads.items()):
            ask = asks.get(table, (0, 0))
            windows = [self._steps(table, ask, k, steps) for k in _demand.KINDS]
            counts = [
                load.used[k] + windows[k] if load.free[k] < windows[k] else 0 for k in _demand.KINDS
            ]
            if any(counts):
                _grow_table(table, load, counts, waited)
        self._refresh(coordinator)

    def _wait_for_steps(self, coordinator: Any, at_most: int) -> None:
        """Wait until at most ``at_most`` steps are in flight: on the oldest unfinished
        step this keeper scheduled (a timed wait: steps scheduled otherwise count too)."""
        while _in_flight(coordinator) > at_most:
            self._forget_finished()
            if self._unfinished:
                self._unfinished[0].wait(POLL_S)
            else:
                time.sleep(POLL_S)

    def _forget_finished(self) -> None:
        while self._unfinished and self._unfinished[0].is_set():
            self._unfinished.popleft()


def _grow_table(table: Growth, load: Load, counts: list[int], waited: float) -> Load:
    """Grow ``table`` for ``counts`` more keys and removals, log it; its load after."""
    started = time.perf_counter()
    table.make_room(counts[0], counts[1])
    (after,) = read_loads([table])
    log.info(
        "grew table %s on %s for %d more keys (%d removals): index %d -> %d slots, "
        "rows %d -> %d, holding %d keys; %.3f s, after %.3f s waiting for the steps in flight",
        table.table.table_name,
        table.table._device,
        counts[0],
        counts[1],
        load.capacity,
        after.capacity,
        load.rows,
        after.rows,
        load.used[0],
        _since(started),
        waited,
    )
    return after


def _plan(fn: Any, args: Any, kwargs: Any) -> tuple[dict[Growth, Need] | None, Any]:
    """What a step of ``fn`` on these arguments asks of each fixed-shape table (None: it
    writes none), and the key its first runs are known by."""
    tables = _demand.live()
    if not tables:
        return None, None
    try:
        concrete = _traced(fn, args, kwargs)
    except Exception:  # the coordinator traces it again and reports it
        concrete = None
    if concrete is None:  # a Python function (or one not traced): it may write any table
        return dict.fromkeys(tables, _UNKNOWN), fn
    sites = _demand.sites_of(concrete.graph)
    if sites:
        counts = _argument_sizes(concrete, args, kwargs)
        return {table: _need(found, counts) for table, found in sites.items()}, concrete.graph
    if _demand.calls_kernels(concrete.graph):
        return dict.fromkeys(tables, _UNKNOWN), concrete.graph
    return None, None


def _need(sites: _demand.Sites, counts: dict[str, int | None]) -> Need:
    bounds = [None if b is None else b.value(counts) for b in sites.bounds]
    return Need((sites.calls[0], sites.calls[1]), (bounds[0], bounds[1]))


def _traced(fn: Any, args: Any, kwargs: Any) -> Any:
    """The concrete function the coordinator will run for ``fn``, traced as the
    coordinator traces it (None for a Python function)."""
    coordinator = cluster_coordinator
    if isinstance(fn, coordinator.tf_function.ConcreteFunction):
        return fn
    if not isinstance(fn, coordinator.def_function.Function):
        return None
    args, kwargs = coordinator._select_worker_slice(0, (args or (), kwargs or {}))
    specs = nest.map_structure(coordinator._maybe_as_type_spec, (args, kwargs))
    return fn.get_concrete_function(*specs[0], **specs[1])


def _argument_sizes(concrete: Any, args: Any, kwargs: Any) -> dict[str, int | None]:
    """The element count of each argument of ``concrete`` that is a tensor of known
    shape (an iterator, a value of another step: unknown), by placeholder name."""
    args, kwargs = cluster_coordinator._select_worker_slice(0, (args or (), kwargs or {}))
    function_type = concrete.function_type
    try:
        flat = function_type.unpack_inputs(function_type.bind(*args, **kwargs))
    except Exception:  # arguments it cannot bind: sizes unknown
        return {}
    return {
        placeholder.name: _elements(value)
        for placeholder, value in zip(concrete.graph.inputs, flat, strict=False)
    }


def _elements(value: Any) -> int | None:
    """The elements of a tensor or array argument (None: another kind of value)."""
    if isinstance(value, np.ndarray):
        return int(value.size)
    known = value.shape.num_elements() if isinstance(value, tf.Tensor) else None
    return None if known is None else int(known)


def _workers(coordinator: Any) -> int:
    """The coordinator's workers: how many steps run at once."""
    return max(len(getattr(coordinator._cluster, "workers", ())), 1)


def _in_flight(coordinator: Any) -> int:
    """Closures queued or running on the coordinator's workers."""
    queue = coordinator._cluster.closure_queue
    return int(queue._queue.qsize() + queue.inflight_closure_count)


def _since(started: float) -> float:
    return time.perf_counter() - started
