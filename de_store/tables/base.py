"""The table core contract.

A :class:`TableCore` maps keys to fixed-width value rows. It is the unit a
``de_store.Variable`` shards over devices: one core per device. All methods take and
return TensorFlow tensors and work eagerly and inside ``tf.function``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class TableSnapshot:
    """A table's content at one moment: ``rows`` keys, read by ``read()`` as
    ``(keys [rows], values [rows, dim])`` whenever it is called; ``lookup(keys)``, where
    the core offers it, gives the rows of any keys as the snapshot holds them (zeros for
    keys it does not hold)."""

    rows: int
    read: Callable[[], tuple[tf.Tensor, tf.Tensor]]
    lookup: Callable[[tf.Tensor], tf.Tensor] | None = None
    #: Where the core offers it (a row store in host memory, holding the values in the
    #: table's value dtype): ``(keys [rows], row_ids [rows], store [n, dim])``, the
    #: value of ``keys[i]`` being ``store[row_ids[i]]``: what ``read`` gives without
    #: gathering the values (a writer that reorders the rows gathers them once, there).
    #: Tensors or numpy arrays; the core's own order (``HashTable``: the store's).
    read_rows: Callable[[], tuple[Any, Any, Any]] | None = None
    #: Where the core offers it (as ``read_rows``): ``(keys [rows], values [rows, dim])``
    #: as numpy arrays in the order the row store holds them, the values a view of the
    #: store, when the live rows are exactly its first ``rows`` (no row freed); None
    #: otherwise. A writer that keeps the table's order then copies no value row.
    read_in_store_order: Callable[[], tuple[np.ndarray, np.ndarray] | None] | None = None


class TableCore(tf.Module, abc.ABC):
    """Key -> value-row storage with upsert, accumulate, remove and batched export.

    Parameters (held as attributes by every implementation)
    ----------
    key_dtype: the dtype of keys (``tf.int64``, ``tf.int32`` or ``tf.string``).
    value_dtype: the dtype of values.
    dim: the width of each value row, ``>= 1``.
    name: used in every error message about this table.

    Threads: every method must be safe under concurrent calls from any number of Python
    threads and from concurrently running ``tf.function`` s, and each call atomic (a
    reader sees a row either before or after a concurrent write; sizes move by whole
    calls). A Python lock alone covers eager calls only: the cores here take a TensorFlow
    mutex resource in every operation (``de_store.tables._locking``).
    """

    key_dtype: tf.DType
    value_dtype: tf.DType
    dim: int

    @abc.abstractmethod
    def lookup(
        self, keys: tf.Tensor, default_value: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(values [n, dim], exists [n] bool)`` for ``keys [n]``.

        Missing keys get ``default_value`` (broadcast from a scalar, a ``[dim]`` row or a
        ``[n, dim]`` block; zeros when ``None``).
        """

    @abc.abstractmethod
    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Upsert ``values [n, dim]`` for ``keys [n]``; a duplicate key keeps the last value."""

    @abc.abstractmethod
    def accum(self, keys: tf.Tensor, deltas: tf.Tensor, insert_missing: bool = True) -> None:
        """Add ``deltas [n, dim]`` to the rows of ``keys``; duplicate keys sum.

        A missing key is inserted with its (summed) delta when ``insert_missing``, else ignored.
        """

    @abc.abstractmethod
    def remove(self, keys: tf.Tensor) -> None:
        """Remove ``keys``; missing keys are ignored."""

    @abc.abstractmethod
    def size(self) -> tf.Tensor:
        """Number of keys held, an int64 scalar tensor."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    @abc.abstractmethod
    def export(self, batch_size: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Yield ``(keys, values)`` batches of at most ``batch_size`` rows.

        The batches are a consistent snapshot taken when the iteration starts: changes made
        to the table while iterating do not show in them.
        """

    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """``(keys [n], values [n, dim])`` of the whole table: every :meth:`export` batch.

        Cores that can read themselves in one go override this.
        """
        batches = list(self.export(1 << 22))
        if not batches:
            return tf.zeros([0], self.key_dtype), tf.zeros([0, self.dim], self.value_dtype)
        return tf.concat([k for k, _ in batches], 0), tf.concat([v for _, v in batches], 0)

    def snapshot(self) -> TableSnapshot:
        """What the table holds now, to be read later (a save reads it in the background).

        Changes made after the call do not show in the snapshot's rows. This default
        exports every row now; cores that can hold their state without copying it
        override it, so that the call returns at once and the rows are read later.
        """
        keys, values = self.export_all()
        return TableSnapshot(int(tf.size(keys)), lambda: (keys, values))

    # -- change tracking (incremental checkpoints) ------------------------------------
    #: Whether this core tracks changes; cores that do implement ``export_changes`` and
    #: ``forget_removed`` and hold their current epoch in :attr:`epoch`.
    track_changes: bool = False
    #: The current change epoch, an int64 scalar variable (None: the core keeps none).
    epoch: tf.Variable | None = None
    #: The name given to the core, for messages.
    table_name: str

    def change_epoch(self) -> int:
        """The current change epoch (from 1): every row written (insert, accum) is stamped
        with it, every removed key is logged with it."""
        return int(self._epoch().numpy())

    def set_change_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current change epoch."""
        self._epoch().assign(epoch)

    def _epoch(self) -> tf.Variable:
        if self.epoch is None:
            raise self._no_tracking()
        return self.epoch

    def _check_tracking(self) -> None:
        """ValueError unless the core was made with ``track_changes=True``."""
        if not self.track_changes:
            raise ValueError(
                f"table {self.table_name!r} does not track changes (track_changes=False)"
            )

    def export_changes(self, since: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``(keys [n], values [n, dim], removed [m])``: the rows written at an epoch after
        ``since``, and the keys removed after ``since`` that are absent now (a key removed
        and inserted again is only in ``keys``). ``clear`` forgets all history."""
        raise self._no_tracking()

    def forget_removed(self, upto: int) -> None:
        """Drop the removal records of epochs up to ``upto`` (no delta needs them)."""
        raise self._no_tracking()

    def _no_tracking(self) -> NotImplementedError:
        return NotImplementedError(
            f"table {self.name!r} ({type(self).__name__}) does not track changes"
        )

    def load_distinct(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Insert keys absent from the table and distinct among themselves (a restore).

        Cores with a faster path for this case override it and raise
        :class:`~de_store.errors.RepeatedKeysError` (after clearing) when the keys were not
        so; by default it is :meth:`insert`.
        """
        self.insert(keys, values)

    def import_batches(self, batches: Iterable[tuple[tf.Tensor, tf.Tensor]]) -> None:
        """Upsert every ``(keys, values)`` batch, in order."""
        for keys, values in batches:
            self.insert(keys, values)
