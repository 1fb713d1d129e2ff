"""Fixed-shape tables: growth into new variables, and kernels that read the current ones.

Used by :class:`~de_store.tables.hash_table.HashTable` when ``fixed_shapes`` (see *Fixed
shapes* there). The kernels themselves only check room (``CapacityOps.room_check``); this
module grows the table eagerly, before an eager operation that needs room, in ``reserve``
and when :mod:`._ps_growth` keeps it ahead of the steps a ``ClusterCoordinator``
schedules, and hands kernels inside a ``tf.function`` the table's variables as call-time
captures, read when the function runs.

Inside a step, every call that may add keys (or log removals) also counts, on the table's
device, the keys it was passed: the most one call passed and the sum (``Growth.demand``).
:func:`read_loads` reads those and the room left, for all tables of a task in one call.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from de_store.tables import _change_tracking, _demand, _index, _key_bounds, _types, _variables
from de_store.tables._placement import fixed_variable

#: Kernels that may add keys (their first argument holds the keys, or for ``prepare``
#: the count) and the one that logs removals.
_ADDING = ("insert", "load_distinct", "accum_insert", "prepare")
#: The table's variables :func:`read_loads` reads, in its order.
_LOAD_FIELDS = ("index", "values", "removed", "num_keys", "num_free", "next_row", "num_removed")
#: No limit (the removal log of a table that keeps none).
UNLIMITED = 1 << 62


class Growth:
    """Runs the kernels of one fixed-shape table and grows it into new variables.

    Eager calls hold a Python lock, so that a growth and the operations of other Python
    threads do not interleave; kernels inside a ``tf.function`` read the variables at
    each call of the function.
    """

    def __init__(self, table: Any) -> None:
        self.table = table
        self._lock = threading.Lock()
        self._label = tf.constant(f"table {table.table_name} on {table._device}")
        with tf.init_scope(), tf.device(table._device):
            #: keys passed to the calls of steps: [most in one adding call, sum of adding
            #: calls, most in one remove call, sum of remove calls] (never replaced)
            self.demand = fixed_variable("demand", tf.zeros([4], tf.int64))
        _demand.register(self)

    def run(self, kernel: str, args: tuple[tf.Tensor, ...]) -> Any:
        """Run ``kernel``: eagerly, after making room for its keys; in a graph, on the
        variables the table holds when the graph runs."""
        t = self.table
        if not tf.executing_eagerly():
            kind = self._demand_kind(kernel)
            if kind is not None and tf.compat.v1.get_default_graph().building_function:
                self._count_demand(kernel, kind, args[0])
            return self._call(kernel, self._state(), *args)
        with self._lock:
            if kernel in _ADDING:
                count = int(args[0]) if kernel == "prepare" else int(tf.size(args[0]))
                self._make_room_locked(count, 0)
            elif kernel == "remove" and t.track_changes:
                self._make_room_locked(0, int(tf.size(args[0])))
            return self._call(kernel, t._state, *args)

    def _call(self, kernel: str, state: _types.State, *args: tf.Tensor) -> Any:
        """Kernel ``kernel`` of the table on ``state``, on the table's device."""
        t = self.table
        with tf.device(t._device):
            return t._kernels.run(kernel, t._mutex.resource_handle, state, *args, self._label)

    def _demand_kind(self, kernel: str) -> int | None:
        """Which room ``kernel`` takes: ``_demand.ADD``, ``REMOVE`` or none."""
        if kernel in _ADDING:
            return _demand.ADD
        if kernel == "remove" and self.table.track_changes:
            return _demand.REMOVE
        return None

    def _count_demand(self, kernel: str, kind: int, first: tf.Tensor) -> None:
        """Note the call in the graph being traced (with a bound of its keys when the graph
        gives one) and count its keys on the table's device when it runs."""
        bound: _key_bounds.Bound | None
        if kernel == "prepare":
            static, count = tf.get_static_value(first), tf.cast(first, tf.int64)
            bound = None if static is None else _key_bounds.Bound(int(static))
        else:
            bound, count = _key_bounds.element_bound(first), tf.size(first, out_type=tf.int64)
        function = getattr(self.table._kernels, kernel).get_concrete_function()
        _demand.note_call(self, kind, bound, function.name.decode())
        with tf.device(self.table._device):
            handle, count = self.demand.handle, tf.reshape(count, [1])
            tf.raw_ops.ResourceScatterMax(resource=handle, indices=[2 * kind], updates=count)
            tf.raw_ops.ResourceScatterAdd(resource=handle, indices=[2 * kind + 1], updates=count)

    def make_room(self, count: int, removals: int = 0) -> None:
        """Grow, when needed, so that ``count`` new keys and ``removals`` logged removals
        fit without growing."""
        with self._lock:
            self._make_room_locked(count, removals)

    def load_handles(self) -> list[tf.Tensor]:
        """The handles :func:`read_loads` reads (the table's current variables)."""
        t = self.table
        return [getattr(t, field).handle for field in _LOAD_FIELDS] + [self.demand.handle]

    def load_from(self, row: list[int]) -> Load:
        """The :class:`Load` of one row :func:`read_loads` read."""
        capacity, rows, log, keys, free, next_row, removed, *demand = row
        t = self.table
        room = min(int(capacity * t.max_load_factor) - keys, rows - next_row + free)
        log_room = log - removed if t.track_changes else UNLIMITED
        return Load(
            free=(room, log_room),
            used=(keys, removed),
            peak=(demand[0], demand[2]),
            passed=(demand[1], demand[3]),
            capacity=capacity,
            rows=rows,
        )

    def _state(self) -> _types.State:
        """The table's variables as call-time captures of the graph being built (its
        variables themselves in a ``tf.compat.v1`` graph, where they never change)."""
        t = self.table
        graph = tf.compat.v1.get_default_graph()
        if not graph.building_function:
            return t._state
        spec = tf.TensorSpec([], tf.resource)
        handles = [
            graph.capture_call_time_value(
                lambda field=field: getattr(t, field).handle, spec, key=(id(t), field)
            )
            for field in _types.State._fields
        ]
        return _types.State(*(_Handle(h) for h in handles))

    def _make_room_locked(self, count: int, removals: int) -> None:
        t = self.table
        with tf.device(t._device):
            held = tf.stack(
                [t.num_keys, t.num_free, t.next_row, t.num_removed]
                + [_variables.variable_length(v) for v in (t.index, t.values, t.removed)]
            ).numpy()
        num_keys, num_free, next_row, num_removed, capacity, rows, log = map(int, held)
        if num_keys + count > int(capacity * t.max_load_factor):
            self._grow_index(_index.capacity_for(num_keys + count, t.max_load_factor))
        needed = next_row + max(count - num_free, 0)
        if needed > rows:
            self._grow_rows(math.ceil(max(needed, rows) * t.row_growth), rows)
        if t.track_changes and num_removed + removals > log:
            self._grow_log(max(2 * log, num_removed + removals), log)

    def _grow_index(self, capacity: int) -> None:
        t = self.table
        with tf.device(t._device):
            old = t.index.read_value()  # the live (key, row) entries move; rows stay
            live = _index.live_entries(old)
            t.index = fixed_variable("index", _index.empty_index(tf.constant(capacity, tf.int64)))
        self._call("place_entries", t._state, live)

    def _grow_rows(self, rows: int, have: int) -> None:
        t = self.table
        with tf.device(t._device):
            extra = rows - have
            t.values = fixed_variable(
                "values", tf.concat([t.values, tf.zeros([extra, t.dim], t.values.dtype)], 0)
            )
            t.free_rows = fixed_variable(
                "free_rows", tf.concat([t.free_rows, tf.zeros([extra], tf.int64)], 0)
            )
            t.row_keys = fixed_variable(
                "row_keys", tf.concat([t.row_keys, tf.zeros([extra], tf.int64)], 0)
            )
            if t.track_changes:  # stamps are as long as the row store
                zeros = tf.cast(tf.zeros([extra], tf.int64), _change_tracking.STAMP_DTYPE)
                t.stamps = fixed_variable("stamps", tf.concat([t.stamps, zeros], 0))

    def _grow_log(self, length: int, have: int) -> None:
        t = self.table
        with tf.device(t._device):
            zeros = tf.zeros([length - have], tf.int64)
            t.removed = fixed_variable("removed", tf.concat([t.removed, zeros], 0))
            t.removed_at = fixed_variable("removed_at", tf.concat([t.removed_at, zeros], 0))


@dataclass(frozen=True)
class Load:
    """What a fixed-shape table holds and has room for, as :func:`read_loads` found it.

    Pairs are ``(new keys, logged removals)``, the two kinds of room a step can run out
    of (``_demand.ADD`` and ``REMOVE``).
    """

    #: how many more fit without growing (UNLIMITED: no removal log)
    free: tuple[int, int]
    #: keys held, removals logged
    used: tuple[int, int]
    #: the most keys one call of a step passed (``Growth.demand``)
    peak: tuple[int, int]
    #: the keys every call of every step passed, summed
    passed: tuple[int, int]
    #: index slots and value rows, for the log
    capacity: int
    rows: int


def read_loads(growths: list[Growth]) -> list[Load]:
    """The loads of ``growths``' tables: one function call per device (a small remote
    read for tables on a parameter server), not under the tables' mutexes: a call
    running meanwhile is seen before, after, or partly done."""
    by_device: dict[str, list[int]] = defaultdict(list)
    for position, growth in enumerate(growths):
        by_device[growth.table._device].append(position)
    loads: list[Load | None] = [None] * len(growths)
    for device, positions in by_device.items():
        handles = [h for p in positions for h in growths[p].load_handles()]
        with tf.device(device):
            raw = _reader(device, len(positions))(*handles).numpy()
        for position, row in zip(positions, raw.tolist(), strict=True):
            loads[position] = growths[position].load_from(row)
    return loads  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _reader(device: str, count: int) -> Any:
    """A function reading ``count`` tables' lengths, counters and demand on ``device``
    (from handles: a capture would keep the variables it was traced with)."""
    width = len(_LOAD_FIELDS) + 1

    def read(*handles: tf.Tensor) -> tf.Tensor:
        rows = []
        with tf.device(device):
            for start in range(0, len(handles), width):
                index, values, removed, *counters, demand = handles[start : start + width]
                lengths = [
                    tf.raw_ops.VariableShape(input=h, out_type=tf.int64)[0]
                    for h in (index, values, removed)
                ]
                scalars = [tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.int64) for h in counters]
                read_demand = tf.raw_ops.ReadVariableOp(resource=demand, dtype=tf.int64)
                rows.append(tf.concat([tf.stack(lengths + scalars), read_demand], 0))
            return tf.stack(rows)

    specs = [tf.TensorSpec([], tf.resource)] * (width * count)
    return tf.function(read, input_signature=specs, autograph=False)


class _Handle:
    """A resource handle standing in for a variable in :class:`_types.State`: the kernels
    take ``.handle`` of each."""

    def __init__(self, handle: tf.Tensor) -> None:
        self.handle = handle
