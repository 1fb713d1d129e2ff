"""Fixed-shape tables: growth into new variables, and kernels that read the current ones.

Used by :class:`~de_store.tables.hash_table.HashTable` when ``fixed_shapes`` (see *Fixed
shapes* there). The kernels themselves only check room (``CapacityOps.room_check``); this
module grows the table eagerly, before an eager operation that needs room and in
``reserve``, and hands kernels inside a ``tf.function`` the table's variables as
call-time captures, read when the function runs.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops

from de_store.tables import _index, _tracking, _types

#: Kernels that may add keys (their first argument holds the keys, or for ``prepare``
#: the count) and the one that logs removals.
_ADDING = ("insert", "load_distinct", "accum_insert", "prepare")


def in_remote_scope() -> bool:
    """Whether the device scope in effect eagerly belongs to another job or task than this
    process (False without one, and in a graph)."""
    if not tf.executing_eagerly():
        return False
    device = tf.DeviceSpec.from_string(context.context().device_name or "")
    if device.job is None:
        return False
    local = tf.DeviceSpec.from_string(context.context().host_address_space())
    return (device.job, device.task or 0) != (local.job, local.task or 0)


def fixed_variable(name: str, initial: tf.Tensor) -> tf.Variable:
    """A variable of ``initial``'s shape on the device in scope.

    Built as a plain ``ResourceVariable``, past any distribution strategy's variable
    creator: ``ParameterServerStrategy`` places each new variable on the next parameter
    server in turn, which would spread one table over several tasks.
    """
    return resource_variable_ops.ResourceVariable(
        initial, name=name, trainable=False, shape=initial.shape
    )


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

    def run(self, kernel: str, args: tuple[tf.Tensor, ...]) -> Any:
        """Run ``kernel``: eagerly, after making room for its keys; in a graph, on the
        variables the table holds when the graph runs."""
        t = self.table
        if not tf.executing_eagerly():
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

    def make_room(self, count: int, removals: int = 0) -> None:
        """Grow, when needed, so that ``count`` new keys and ``removals`` logged removals
        fit without growing."""
        with self._lock:
            self._make_room_locked(count, removals)

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
                + [_tracking.variable_length(v) for v in (t.index, t.values, t.removed)]
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
            live = tf.gather(old, tf.where(old[:, 1] >= 0)[:, 0])
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
                zeros = tf.cast(tf.zeros([extra], tf.int64), _tracking.STAMP_DTYPE)
                t.stamps = fixed_variable("stamps", tf.concat([t.stamps, zeros], 0))

    def _grow_log(self, length: int, have: int) -> None:
        t = self.table
        with tf.device(t._device):
            zeros = tf.zeros([length - have], tf.int64)
            t.removed = fixed_variable("removed", tf.concat([t.removed, zeros], 0))
            t.removed_at = fixed_variable("removed_at", tf.concat([t.removed_at, zeros], 0))


class _Handle:
    """A resource handle standing in for a variable in :class:`_types.State`: the kernels
    take ``.handle`` of each."""

    def __init__(self, handle: tf.Tensor) -> None:
        self.handle = handle
