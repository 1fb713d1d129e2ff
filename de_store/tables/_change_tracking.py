"""The change-tracking operations of :class:`~de_store.tables._table_ops.TableOps`.

Every row written (insert, accum) is stamped with the table's current epoch in ``stamps``
(parallel to the row store); removed keys go on a log (``removed``, ``removed_at``) with
the epoch of their removal, and the stamps of their freed rows are cleared. A snapshot
mark is an epoch: what changed after it is the rows stamped later (each with the key
written with it, ``row_keys``) and the logged keys removed later that are absent now.
"""

from __future__ import annotations

import tensorflow as tf

from de_store.tables._index import positions
from de_store.tables._types import FindsRows, View
from de_store.tables._variables import count, push, read_shared

#: Row stamps (the epoch of a row's last write) are 4 bytes a row: uint32 has GPU
#: gathers and scatters, int32 does not.
STAMP_DTYPE = tf.uint32


class TrackingOps:
    """Mixed into ``TableOps``: ``self.t`` is the table; ``export_changes`` probes it
    (what it needs of the class it is mixed into: :class:`~._types.FindsRows`)."""

    t: View

    def stamp(self, rows: tf.Tensor) -> None:
        """Stamp ``rows`` with the current epoch (no-op when changes are not tracked)."""
        t = self.t
        if t.track_changes:
            epoch = tf.cast(tf.fill(tf.shape(rows), t.epoch.read_value()), STAMP_DTYPE)
            t.stamps.scatter_update(tf.IndexedSlices(epoch, rows))

    def unstamp(self, rows: tf.Tensor) -> None:
        """Clear the stamps of freed ``rows`` (epochs start at 1): ``export_changes``
        takes every stamped row for live, and a freed row is stamped again when it is
        handed out."""
        t = self.t
        if t.track_changes:
            zeros = tf.cast(tf.zeros(tf.shape(rows), tf.int64), STAMP_DTYPE)
            t.stamps.scatter_update(tf.IndexedSlices(zeros, rows))

    def log_removed(self, keys: tf.Tensor) -> None:
        """Append ``keys`` to the removal log with the current epoch (growing it when full)."""
        t = self.t
        epoch = tf.fill(tf.shape(keys), t.epoch.read_value())
        push(t.num_removed, [(t.removed, keys), (t.removed_at, epoch)])

    def export_changes(self: FindsRows, since: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``(keys, values)`` of the live rows written at an epoch after ``since``, and the
        keys removed after ``since`` that are absent now (possibly repeated)."""
        t = self.t
        # The rows handed out and stamped after ``since`` (one pass over 4 bytes a row),
        # each with the key written with it: a freed row's stamp is cleared, so every
        # stamped row is live (see ``unstamp``). The stamps are read in place and sliced
        # to the rows handed out: a gather of every row by index would first write an index
        # of 8 bytes a row and a copy of the stamps. The slice is of their bits as float32
        # (a copy of the bits; Slice has no GPU kernel for uint32).
        handed_out = tf.reshape(t.next_row.read_value(), [1])
        bits = tf.bitcast(read_shared(t.stamps), tf.float32)
        stamps = tf.bitcast(tf.slice(bits, tf.zeros([1], tf.int64), handed_out), STAMP_DTYPE)
        dirty = positions(stamps > tf.cast(since, STAMP_DTYPE))
        logged = tf.range(t.num_removed.read_value())
        removed_at = tf.gather(t.removed_at, logged)
        removed = tf.gather(tf.gather(t.removed, logged), positions(removed_at > since))
        removed = tf.gather(removed, positions(self.find_rows(removed) < 0))
        return tf.gather(t.row_keys, dirty), tf.gather(t.values, dirty), removed

    def forget_removed(self, upto: tf.Tensor) -> None:
        """Drop the removal records of epochs up to ``upto``."""
        t = self.t
        logged = tf.range(t.num_removed.read_value())
        removed_at = tf.gather(t.removed_at, logged)
        kept = tf.gather(logged, positions(removed_at > upto))
        keys, epochs = tf.gather(t.removed, kept), tf.gather(t.removed_at, kept)
        at = tf.range(count(kept))
        t.removed.scatter_update(tf.IndexedSlices(keys, at))
        t.removed_at.scatter_update(tf.IndexedSlices(epochs, at))
        t.num_removed.assign(count(kept))
