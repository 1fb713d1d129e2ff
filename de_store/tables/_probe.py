"""The graph kernels of :class:`~de_store.tables.hash_table.HashTable`.

Every function here builds TensorFlow ops only (no Python control flow on tensor values),
so it traces inside ``tf.function`` and runs on whatever device the table lives on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

if TYPE_CHECKING:
    from de_store.tables.hash_table import HashTable

EMPTY = -1
DELETED = -2
# Claim tokens sit above every real row id, so a token is always the max of a slot.
TOKEN_BASE = 1 << 40
MIN_CAPACITY = 16

_MIX1 = tf.constant(-49064778989728563, tf.int64)  # 0xff51afd7ed558ccd as int64
_MIX2 = tf.constant(-4265267296055464877, tf.int64)  # 0xc4ceb9fe1a85ec53 as int64
_LOW31 = tf.constant(0x7FFFFFFF, tf.int64)


def capacity_for(count: int, max_load_factor: float) -> int:
    """Smallest power-of-two capacity holding ``count`` keys under ``max_load_factor``."""
    capacity = MIN_CAPACITY
    while capacity * max_load_factor < count:
        capacity *= 2
    return capacity


def hash_keys(keys: tf.Tensor) -> tf.Tensor:
    """A 64-bit finalizer (murmur3 fmix64) on int64 keys; shifts masked to be logical."""
    x = tf.bitwise.bitwise_xor(
        keys, tf.bitwise.bitwise_and(tf.bitwise.right_shift(keys, 33), _LOW31)
    )
    x = x * _MIX1
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, 33), _LOW31))
    x = x * _MIX2
    return tf.bitwise.bitwise_xor(x, tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, 33), _LOW31))


def variable_length(var: tf.Variable) -> tf.Tensor:
    """Leading dimension of a variable, without reading its value."""
    return tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64)[0]


def _count(x: tf.Tensor) -> tf.Tensor:
    return tf.size(x, out_type=tf.int64)


class TableOps:
    """Graph operations over one table's variables."""

    def __init__(self, table: HashTable) -> None:
        self.t = table
        spec = [tf.TensorSpec([None], tf.int64)]
        # Traced once each and called from every kernel (smaller graphs, faster tracing).
        self.find = tf.function(
            lambda k: self.probe(k, False), autograph=False, input_signature=spec
        )
        self.find_or_claim = tf.function(
            lambda k: self.probe(k, True), autograph=False, input_signature=spec
        )

    # -- probing -----------------------------------------------------------------------
    def probe(self, keys: tf.Tensor, claim: bool) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(slots, rows)`` for each key.

        ``slots[i]`` is the slot holding ``keys[i]``; a missing key gets ``-1``, or, when
        ``claim``, an empty slot it (or a duplicate of it) claimed with a token. ``rows[i]`` is
        the slot's row id as seen when the key was found (a token for a fresh claim).
        """
        t = self.t
        n = _count(keys)
        mask = variable_length(t.slot_rows) - 1
        positions = tf.bitwise.bitwise_and(hash_keys(keys), mask)
        found_idx = tf.TensorArray(
            tf.int64, size=0, dynamic_size=True, infer_shape=False, element_shape=[None]
        )
        found_pos, found_row = found_idx, found_idx

        def body(step, idx, ks, pos, fi, fp, fr):
            rows = tf.gather(t.slot_rows, pos)
            hit = tf.logical_and(rows >= 0, tf.equal(tf.gather(t.slot_keys, pos), ks))
            empty = tf.equal(rows, EMPTY)
            if claim:
                won = self._claim(idx, ks, pos, empty)
                done = tf.logical_or(hit, won)
                move = tf.logical_not(tf.logical_or(done, empty))
            else:
                done = tf.logical_or(hit, empty)
                move = tf.logical_not(done)
            rows = tf.where(
                hit,
                rows,
                idx + TOKEN_BASE
                if claim
                else tf.fill(tf.shape(rows), tf.constant(EMPTY, tf.int64)),
            )
            fi = fi.write(step, tf.boolean_mask(idx, done))
            fp = fp.write(step, tf.boolean_mask(tf.where(hit, pos, -1) if not claim else pos, done))
            fr = fr.write(step, tf.boolean_mask(rows, done))
            pos = tf.where(move, tf.bitwise.bitwise_and(pos + 1, mask), pos)
            keep = tf.logical_not(done)
            return (
                step + 1,
                tf.boolean_mask(idx, keep),
                tf.boolean_mask(ks, keep),
                tf.boolean_mask(pos, keep),
                fi,
                fp,
                fr,
            )

        loop = tf.while_loop(
            lambda step, idx, *_: _count(idx) > 0,
            body,
            (
                tf.constant(0, tf.int32),
                tf.range(n),
                keys,
                positions,
                found_idx,
                found_pos,
                found_row,
            ),
            shape_invariants=(
                tf.TensorShape([]),
                *[tf.TensorShape([None])] * 3,
                *[tf.TensorShape(None)] * 3,
            ),
        )
        order = loop[4].concat()[:, None]
        slots = tf.scatter_nd(order, loop[5].concat(), tf.reshape(n, [1]))
        rows = tf.scatter_nd(order, loop[6].concat(), tf.reshape(n, [1]))
        return slots, rows

    def _claim(
        self, idx: tf.Tensor, keys: tf.Tensor, pos: tf.Tensor, empty: tf.Tensor
    ) -> tf.Tensor:
        """Race for empty slots; return which keys won theirs (their key is then written)."""
        t = self.t
        tokens = idx + TOKEN_BASE
        t.slot_rows.scatter_max(
            tf.IndexedSlices(tf.boolean_mask(tokens, empty), tf.boolean_mask(pos, empty))
        )
        won = tf.logical_and(empty, tf.equal(tf.gather(t.slot_rows, pos), tokens))
        written = t.slot_keys.scatter_update(
            tf.IndexedSlices(tf.boolean_mask(keys, won), tf.boolean_mask(pos, won))
        )
        # The next probe round must see the written keys: make its inputs wait for them.
        with tf.control_dependencies([written.op] if hasattr(written, "op") else []):
            return tf.identity(won)

    def last_occurrence(self, slots: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """Mark, among keys resolved to the same slot, the last one in the batch.

        Tokens are scattered (max) into the slots and read back, then the row ids restored.
        """
        t = self.t
        tokens = tf.range(_count(slots)) + TOKEN_BASE
        t.slot_rows.scatter_max(tf.IndexedSlices(tokens, slots))
        last = tf.equal(tf.gather(t.slot_rows, slots), tokens)
        t.slot_rows.scatter_update(tf.IndexedSlices(rows, slots))
        return last

    # -- capacity ----------------------------------------------------------------------
    def reserve(self, incoming: tf.Tensor) -> None:
        """Rehash into a bigger index first when ``incoming`` new keys could overflow it."""
        t = self.t
        capacity = variable_length(t.slot_rows)
        used = t.num_keys + t.num_deleted + incoming
        limit = tf.cast(tf.cast(capacity, tf.float64) * t.max_load_factor, tf.int64)

        def grow() -> tf.Tensor:
            target = t.num_keys + incoming
            new_capacity = tf.while_loop(
                lambda c: tf.cast(c, tf.float64) * t.max_load_factor < tf.cast(target, tf.float64),
                lambda c: c * 2,
                [capacity],
            )
            self.rehash(new_capacity)
            return tf.constant(True)

        tf.cond(used > limit, grow, lambda: tf.constant(False))

    def rehash(self, capacity: tf.Tensor) -> None:
        """Rebuild the index at ``capacity``, dropping tombstones; rows do not move."""
        t = self.t
        occupied = tf.where(t.slot_rows.read_value() >= 0)[:, 0]
        keys = tf.gather(t.slot_keys, occupied)
        rows = tf.gather(t.slot_rows, occupied)
        t.slot_keys.assign(tf.zeros(tf.reshape(capacity, [1]), tf.int64))
        t.slot_rows.assign(tf.fill(tf.reshape(capacity, [1]), tf.constant(EMPTY, tf.int64)))
        t.num_deleted.assign(0)
        slots, _ = self.find_or_claim(keys)
        t.slot_rows.scatter_update(tf.IndexedSlices(rows, slots))

    def allocate_rows(self, count: tf.Tensor) -> tf.Tensor:
        """Take ``count`` row ids: freed rows first, then fresh ones (growing the store)."""
        t = self.t
        reused = tf.minimum(count, t.num_free)
        top = t.num_free.read_value()
        from_free = tf.gather(t.free_rows, tf.range(top - reused, top))
        fresh_start = t.next_row.read_value()
        fresh = tf.range(fresh_start, fresh_start + count - reused)
        self._ensure_rows(fresh_start + count - reused)
        t.num_free.assign_sub(reused)
        t.next_row.assign_add(count - reused)
        return tf.concat([from_free, fresh], axis=0)

    def _ensure_rows(self, needed: tf.Tensor) -> None:
        t = self.t

        def grow() -> tf.Tensor:
            have = variable_length(t.values)
            bigger = tf.cast(tf.math.ceil(tf.cast(have, tf.float64) * t.row_growth), tf.int64)
            extra = tf.maximum(needed, bigger) - have
            t.values.assign(
                tf.concat([t.values, tf.zeros(tf.stack([extra, t.dim]), t.values.dtype)], axis=0)
            )
            return tf.constant(True)

        have = variable_length(t.values)
        tf.cond(needed > have, grow, lambda: tf.constant(False))

    def free(self, rows: tf.Tensor) -> None:
        """Push row ids on the free list (growing it when full)."""
        t = self.t
        top = t.num_free.read_value()
        needed = top + _count(rows)

        def grow() -> tf.Tensor:
            have = variable_length(t.free_rows)
            t.free_rows.assign(
                tf.concat(
                    [
                        t.free_rows,
                        tf.zeros(tf.reshape(tf.maximum(needed, 2 * have) - have, [1]), tf.int64),
                    ],
                    axis=0,
                )
            )
            return tf.constant(True)

        have = variable_length(t.free_rows)
        tf.cond(needed > have, grow, lambda: tf.constant(False))
        t.free_rows.scatter_update(tf.IndexedSlices(rows, tf.range(top, needed)))
        t.num_free.assign(needed)

    # -- operations --------------------------------------------------------------------
    def lookup(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Rows of present keys (zeros for missing ones) and the exists mask."""
        t = self.t
        slots, rows = self.find(keys)
        exists = slots >= 0
        values = tf.gather(t.values, tf.where(exists, rows, 0))
        return tf.where(exists[:, None], values, tf.zeros_like(values)), exists

    def _resolve(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Find or claim a slot per key; give claimed slots fresh rows.

        Returns ``(slots, rows, fresh)``; ``fresh`` marks the keys that were new.
        """
        t = self.t
        self.reserve(_count(keys))
        slots, rows = self.find_or_claim(keys)
        fresh = tf.equal(rows, tf.range(_count(keys)) + TOKEN_BASE)
        fresh_rows = self.allocate_rows(tf.reduce_sum(tf.cast(fresh, tf.int64)))
        t.slot_rows.scatter_update(tf.IndexedSlices(fresh_rows, tf.boolean_mask(slots, fresh)))
        t.num_keys.assign_add(_count(fresh_rows))
        return slots, tf.gather(t.slot_rows, slots), fresh

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Upsert; the last of duplicated keys wins."""
        with tf.control_dependencies([_same_length(self.t, keys, values)]):
            slots, rows, _ = self._resolve(keys)
        last = self.last_occurrence(slots, rows)
        self.t.values.scatter_update(
            tf.IndexedSlices(tf.boolean_mask(values, last), tf.boolean_mask(rows, last))
        )

    def accum_insert(self, keys: tf.Tensor, deltas: tf.Tensor) -> None:
        """Add deltas, inserting missing keys at zero first."""
        t = self.t
        with tf.control_dependencies([_same_length(t, keys, deltas)]):
            _, rows, fresh = self._resolve(keys)
        new_rows = tf.boolean_mask(rows, fresh)
        t.values.scatter_update(
            tf.IndexedSlices(
                tf.zeros(tf.stack([_count(new_rows), t.dim]), t.values.dtype), new_rows
            )
        )
        t.values.scatter_add(tf.IndexedSlices(deltas, rows))

    def accum_existing(self, keys: tf.Tensor, deltas: tf.Tensor) -> None:
        """Add deltas to present keys; missing keys are ignored."""
        t = self.t
        with tf.control_dependencies([_same_length(t, keys, deltas)]):
            slots, rows = self.find(keys)
        exists = slots >= 0
        t.values.scatter_add(
            tf.IndexedSlices(tf.boolean_mask(deltas, exists), tf.boolean_mask(rows, exists))
        )

    def remove(self, keys: tf.Tensor) -> None:
        """Tombstone the slots of present keys and free their rows."""
        t = self.t
        slots, rows = self.find(keys)
        exists = slots >= 0
        slots, rows = tf.boolean_mask(slots, exists), tf.boolean_mask(rows, exists)
        last = self.last_occurrence(slots, rows)
        slots, rows = tf.boolean_mask(slots, last), tf.boolean_mask(rows, last)
        t.slot_rows.scatter_update(
            tf.IndexedSlices(tf.fill(tf.shape(slots), tf.constant(DELETED, tf.int64)), slots)
        )
        self.free(rows)
        t.num_keys.assign_sub(_count(rows))
        t.num_deleted.assign_add(_count(rows))

    def clear(self) -> None:
        """Empty the table: the index goes back to its initial capacity, rows are released."""
        t = self.t
        t.slot_keys.assign(tf.zeros([t.init_capacity], tf.int64))
        t.slot_rows.assign(tf.fill([t.init_capacity], tf.constant(EMPTY, tf.int64)))
        t.values.assign(tf.zeros([16, t.dim], t.values.dtype))
        t.free_rows.assign(tf.zeros([16], tf.int64))
        for counter in (t.num_keys, t.num_deleted, t.num_free, t.next_row):
            counter.assign(0)

    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """``(keys, values)`` of every live slot, read in one pass."""
        t = self.t
        occupied = tf.where(t.slot_rows.read_value() >= 0)[:, 0]
        rows = tf.gather(t.slot_rows, occupied)
        return tf.gather(t.slot_keys, occupied), tf.gather(t.values, rows)


def _same_length(t: HashTable, keys: tf.Tensor, rows: tf.Tensor) -> tf.Operation:
    return tf.debugging.assert_equal(
        _count(keys),
        tf.shape(rows, out_type=tf.int64)[0],
        message=f"table {t.table_name!r}: expected as many value rows as keys",
    )
