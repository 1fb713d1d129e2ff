"""What the hash table's graph operations work on: the config and variables of one table
(:class:`View`), what a probe that claims slots found (:class:`Claims`), and what an
operation mixin needs of the class it is mixed into (:class:`FindsRows`).

Below :mod:`._probing`, :mod:`._table_ops` and the modules they build on (the operations)
and :mod:`._kernels` (the shared ``tf.function`` s that build them), which all import from
here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Config:
    """What a table's kernels depend on besides its variables (tables alike share kernels)."""

    dim: int
    dtype: tf.DType  # of the stored value rows
    max_load_factor: float
    row_growth: float
    init_capacity: int
    track_changes: bool = True
    init_rows: int = 16  # of the row store
    #: ``scatter_update`` applies its updates one at a time in batch order, as TensorFlow's
    #: CPU kernel does (a memmove loop): the last writer of a slot wins, whole. A GPU
    #: scatter keeps an arbitrary writer and may mix the columns of two, so tables there
    #: confirm races (and pick the last of repeated keys) with extra rounds.
    serial_scatter: bool = False
    #: Whether the kernels hold the table's mutex. Tables always do; kernels without it
    #: exist to measure the lock's cost (``de_store.testing.tables.without_lock``).
    locked: bool = True
    #: Every variable keeps the shape it was created with (see *Fixed shapes* in
    #: :mod:`~de_store.tables.hash_table`): an operation that needs more room than the
    #: table has fails before it writes, instead of growing the variables.
    fixed_shapes: bool = False
    #: How the row store grows (see ``CapacityOps._ensure_rows``): into a store left
    #: unwritten past the rows in use, sized for the keys the index holds (a table on a
    #: CPU: unwritten rows cost no resident memory), or by a gather (on a GPU).
    reserve_rows: bool = False


class State(NamedTuple):
    """A table's variables, passed to the shared kernels as arguments."""

    index: tf.Variable
    values: tf.Variable
    free_rows: tf.Variable
    num_keys: tf.Variable
    num_deleted: tf.Variable
    num_free: tf.Variable
    next_row: tf.Variable
    # change tracking: the epoch of each row's last write, the current epoch, and the log
    # of removed keys with the epoch of their removal
    stamps: tf.Variable
    epoch: tf.Variable
    removed: tf.Variable
    removed_at: tf.Variable
    num_removed: tf.Variable
    #: the key of each row handed out, written with the row: a save reads the rows in
    #: the store's order, and ``export_changes`` the changed rows' keys, without the index
    row_keys: tf.Variable


class View:
    """One table as the kernels see it: its config fields and its variables."""

    def __init__(self, config: Config, state: State) -> None:
        self.__dict__.update(dataclasses.asdict(config))
        self.__dict__.update(state._asdict())
        self.state = state

    def __getattr__(self, name: str) -> tf.Variable:  # for mypy: attributes set above
        raise AttributeError(name)


class Claims(NamedTuple):
    """What :meth:`~._probing.ProbeOps.find_or_claim` found: ``slots`` and ``rows`` of the keys
    resolved at once (``-1`` / ``EMPTY`` for the others), and ``left_slots``,
    ``left_rows`` of the keys at positions ``left``, resolved by the probe loop. A row
    at or above the batch's token base is a claim's token."""

    slots: tf.Tensor
    rows: tf.Tensor
    left: tf.Tensor
    left_slots: tf.Tensor
    left_rows: tf.Tensor
    won: tf.Tensor  # how many of the keys resolved at once won their claim

    def count_fresh(self, base: tf.Tensor) -> tf.Tensor:
        """How many keys won a claim (key ``i`` holds the token ``base + i``)."""
        won_left = tf.equal(self.left_rows, self.left + base)
        return self.won + tf.reduce_sum(tf.cast(won_left, tf.int64))

    def merged(self) -> tuple[tf.Tensor, tf.Tensor]:
        """``(slots, rows)`` of every key."""
        both = tf.stack([self.slots, self.rows], 1)
        left = tf.stack([self.left_slots, self.left_rows], 1)
        both = tf.tensor_scatter_nd_update(both, self.left[:, None], left)
        slots, rows = tf.unstack(both, num=2, axis=1)
        return slots, rows


class FindsRows(Protocol):
    """What :class:`~._change_tracking.TrackingOps` needs of the operations it is mixed
    into (``TableOps``): the table, and the probe that finds the row of each key."""

    t: View

    def find_rows(self, keys: tf.Tensor) -> tf.Tensor:
        """The row of each of ``keys`` (negative: missing)."""
        ...
