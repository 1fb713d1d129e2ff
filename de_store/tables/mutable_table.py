"""A table core over ``tf.lookup.experimental.MutableHashTable`` (CPU, any key dtype).

This is the core for string keys. Each stored row carries one extra column, set to one,
that tells a stored key from a missing one (the hash table's own lookup returns only the
default for a miss). float16 and bfloat16 rows are held as float32, which holds them
exactly; int32 keys are held as int64 (the kernel set lacks most int32-key variants).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from de_store.tables import _checks
from de_store.tables._index import positions
from de_store.tables._locking import TableMutex, locked
from de_store.tables.base import TableCore

_KEY_DTYPES = (tf.string, tf.int64, tf.int32)
_WIDENED = {tf.float16: tf.float32, tf.bfloat16: tf.float32, tf.int32: tf.int32}


class MutableTable(TableCore):
    """Key -> value-row table backed by a ``MutableHashTable`` on the CPU.

    Every method holds the table's mutex while its ops run (:mod:`._locking`), so calls
    from any number of threads and concurrently running ``tf.function`` s are atomic: an
    upsert, an accumulation (a read and a write) or a removal with its change log is
    seen whole or not at all.

    Parameters
    ----------
    key_dtype
        ``tf.string``, ``tf.int64`` or ``tf.int32``.
    value_dtype
        One of float32, float16, bfloat16, float64, int32, int64.
    dim
        Width of each value row, ``>= 1``.
    name
        Names the table in error messages.
    init_size
        Accepted for signature parity with :class:`HashTable`; the hash table sizes itself.
    track_changes
        Keep each key's change epoch and a log of removed keys (two more hash tables) for
        :meth:`export_changes` (incremental checkpoints).
    """

    epoch: tf.Variable  # kept with or without tracking: writes are stamped with it

    def __init__(
        self,
        key_dtype: tf.DType,
        value_dtype: tf.DType,
        dim: int,
        *,
        name: str = "table",
        init_size: int = 0,
        track_changes: bool = True,
    ) -> None:
        key_dtype, value_dtype = tf.as_dtype(key_dtype), tf.as_dtype(value_dtype)
        _checks.check_config(name, key_dtype, value_dtype, dim, _KEY_DTYPES)
        super().__init__(name=_checks.table_name(name))
        self.table_name = name
        self.key_dtype, self.value_dtype, self.dim = key_dtype, value_dtype, dim
        self._stored_key = tf.int64 if key_dtype == tf.int32 else key_dtype
        self._stored_value = _WIDENED.get(value_dtype, value_dtype)
        self._table = tf.lookup.experimental.MutableHashTable(
            key_dtype=self._stored_key,
            value_dtype=self._stored_value,
            default_value=tf.zeros([dim + 1], self._stored_value),
            name=f"{_checks.table_name(name)}_table",
        )
        self.track_changes = bool(track_changes)
        self.epoch = tf.Variable(tf.constant(1, tf.int64), name="epoch", trainable=False)
        if self.track_changes:
            self._stamps, self._removed = (
                tf.lookup.experimental.MutableHashTable(
                    self._stored_key, tf.int64, -1, name=f"{_checks.table_name(name)}_{what}"
                )
                for what in ("stamps", "removed")
            )
        self._mutex = TableMutex(self._table.resource_handle.device)

    # -- helpers -----------------------------------------------------------------------
    def _keys(self, keys: Any) -> tf.Tensor:
        keys = _checks.check_keys(self.table_name, self.key_dtype, keys)
        return tf.cast(keys, self._stored_key) if keys.dtype != self._stored_key else keys

    def _rows(self, values: tf.Tensor) -> tf.Tensor:
        """Stored rows: the values (rounded to the value dtype) plus the present flag."""
        values = tf.cast(tf.cast(values, self.value_dtype), self._stored_value)
        flag = tf.ones([tf.shape(values)[0], 1], self._stored_value)
        return tf.concat([values, flag], axis=1)

    def _read(self, stored_keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        stored = self._table.lookup(stored_keys)
        return stored[:, : self.dim], stored[:, self.dim] > 0

    # -- contract ----------------------------------------------------------------------
    @locked
    def lookup(
        self, keys: tf.Tensor, default_value: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(values [n, dim], exists [n])``; see :meth:`TableCore.lookup`."""
        stored_keys = self._keys(keys)
        values, exists = self._read(stored_keys)
        default = _checks.default_rows(
            self.table_name, self.value_dtype, self.dim, tf.size(stored_keys), default_value
        )
        values = tf.cast(values, self.value_dtype)
        return tf.where(exists[:, None], values, default), exists

    @locked
    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Upsert rows; a key repeated in the batch keeps its last value."""
        stored_keys = self._keys(keys)
        values, checks = _checks.check_rows(
            self.table_name, self.value_dtype, self.dim, stored_keys, values
        )
        with tf.control_dependencies(checks):
            unique, slot = tf.unique(stored_keys, out_idx=tf.int64)
            positions = tf.range(tf.size(stored_keys, out_type=tf.int64))
            last = tf.math.unsorted_segment_max(positions, slot, tf.size(unique))
            self._table.insert(unique, self._rows(tf.gather(values, last)))
            self._stamp(unique)

    @locked
    def accum(self, keys: tf.Tensor, deltas: tf.Tensor, insert_missing: bool = True) -> None:
        """Add deltas (duplicates sum); missing keys are inserted when ``insert_missing``."""
        stored_keys = self._keys(keys)
        deltas, checks = _checks.check_rows(
            self.table_name, self.value_dtype, self.dim, stored_keys, deltas, what="deltas"
        )
        with tf.control_dependencies(checks):
            unique, slot = tf.unique(stored_keys, out_idx=tf.int64)
            sums = tf.math.unsorted_segment_sum(
                tf.cast(deltas, self._stored_value), slot, tf.size(unique)
            )
            current, exists = self._read(unique)
            updated = current + sums
            if not insert_missing:
                unique = tf.boolean_mask(unique, exists)
                updated = tf.boolean_mask(updated, exists)
            self._table.insert(unique, self._rows(updated))
            self._stamp(unique)

    @locked
    def remove(self, keys: tf.Tensor) -> None:
        """Remove keys; missing keys are ignored."""
        stored_keys = self._keys(keys)
        if self.track_changes:
            _, exists = self._read(stored_keys)
            present = tf.gather(stored_keys, positions(exists))
            self._removed.insert(present, tf.fill(tf.shape(present), self.epoch.read_value()))
            self._stamps.remove(present)
        self._table.remove(stored_keys)

    @locked
    def size(self) -> tf.Tensor:
        """Number of keys held (int64 scalar)."""
        return self._table.size()

    @locked
    def clear(self) -> None:
        """Remove every key."""
        keys, _ = self._table.export()
        self._table.remove(keys)
        if self.track_changes:
            for log in (self._stamps, self._removed):
                log.remove(log.export()[0])

    @locked
    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(keys [n], values [n, dim])`` of the whole table, read at once."""
        keys, stored = self._table.export()
        return self._exported(keys), tf.cast(stored[:, : self.dim], self.value_dtype)

    def export(self, batch_size: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Yield snapshot batches of at most ``batch_size`` rows (eager only)."""
        return _checks.snapshot_batches(self.table_name, self.export_all(), batch_size)

    # -- change tracking ---------------------------------------------------------------
    def _stamp(self, stored_keys: tf.Tensor) -> None:
        if self.track_changes:
            epoch = tf.fill(tf.shape(stored_keys), self.epoch.read_value())
            self._stamps.insert(stored_keys, epoch)

    @locked
    def export_changes(self, since: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """See :meth:`TableCore.export_changes`."""
        self._check_tracking()
        keys, stamps = self._stamps.export()
        keys = tf.boolean_mask(keys, stamps > since)
        values, _ = self._read(keys)
        removed, epochs = self._removed.export()
        removed = tf.boolean_mask(removed, epochs > since)
        _, present = self._read(removed)
        removed = tf.boolean_mask(removed, tf.logical_not(present))
        return (
            self._exported(keys),
            tf.cast(values, self.value_dtype),
            self._exported(removed),
        )

    @locked
    def forget_removed(self, upto: int) -> None:
        """Drop the removal records of epochs up to ``upto``."""
        self._check_tracking()
        removed, epochs = self._removed.export()
        self._removed.remove(tf.boolean_mask(removed, epochs <= upto))

    def _exported(self, keys: tf.Tensor) -> tf.Tensor:
        return tf.cast(keys, self.key_dtype) if self.key_dtype != self._stored_key else keys
