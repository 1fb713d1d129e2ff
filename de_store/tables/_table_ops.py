"""The graph operations of :class:`~de_store.tables.hash_table.HashTable`.

Every function here builds TensorFlow ops only (no Python control flow on tensor values),
so it traces inside ``tf.function`` and runs on whatever device the table lives on.
:class:`TableOps` builds the ops of one operation over one table's variables; the shared
``tf.function`` s that call it are in :mod:`._kernels`, the probes it builds on in
:mod:`._probing`, the index layout and the compiled first probe rounds in :mod:`._index`,
the growth of the index and the row store in :mod:`._capacity`, change tracking in
:mod:`._change_tracking`.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any

import tensorflow as tf

from de_store._threads import LazyPool
from de_store.tables import _xla
from de_store.tables._capacity import BATCHES_AHEAD, CapacityOps
from de_store.tables._change_tracking import STAMP_DTYPE, TrackingOps
from de_store.tables._claim_loop import race_waits
from de_store.tables._index import (
    COMPILED_MIN_KEYS,
    DELETED,
    EMPTY,
    empty_index,
    entry_columns,
    load_race_args,
    positions,
    race_from,
)
from de_store.tables._locking import needs_eager_lock
from de_store.tables._types import Claims
from de_store.tables._variables import count as _count
from de_store.tables._variables import eager_length, read_shared, replace, variable_length

#: A batch keeps its claim tokens as rows when at most ``1/KEPT_TOKENS_DIV`` of its keys
#: are present or repeated.
KEPT_TOKENS_DIV = 16


class TableOps(CapacityOps, TrackingOps):
    """Graph operations over one table's variables (built while tracing a kernel): the
    probes of :class:`~._probing.ProbeOps`, the growth of :class:`~._capacity.CapacityOps`
    and the change tracking of :class:`~._change_tracking.TrackingOps` make them."""

    def lookup(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Rows of present keys (zeros for missing ones) and the exists mask."""
        t = self.t
        rows = self.find_rows(keys)
        exists = rows >= 0
        values = tf.gather(t.values, tf.where(exists, rows, 0))
        values = tf.cond(
            tf.reduce_all(exists),
            lambda: values,
            lambda: tf.where(exists[:, None], values, tf.zeros_like(values)),
        )
        return values, exists

    def _resolve(
        self,
        keys: tf.Tensor,
        pick_last: bool,
        early: _EarlyRows | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
        """Find or claim a slot per key and give claimed slots fresh rows.

        Returns ``(rows, fresh_rows, last)``: ``fresh_rows`` are the rows given to the new
        keys, ``last`` (when ``pick_last``, else ``None``) marks the last occurrence of each
        key. ``early``: the rows of the batch, written beside the claims (eagerly).
        """
        t = self.t
        n = _count(keys)
        # A fixed-shape table reserves for the keys absent now (its room check counted
        # them): the whole batch could ask a full table for a rehash it cannot grow into.
        if t.fixed_shapes:
            self.reserve(self._incoming("insert", keys))
        else:
            self.reserve(n, BATCHES_AHEAD, compiled_rehash=True)
        # Key ``i`` claims with the token ``base + i`` (rows held now are below ``base``).
        base = t.next_row.read_value()
        if early is None:
            claims = self.find_or_claim(keys, base)
        else:
            early.start(base)
            try:
                claims = self.find_or_claim(keys, base)
            except BaseException:
                early.join(quiet=True)
                raise
            early.join()
        num_fresh = claims.count_fresh(base)
        t.num_keys.assign_add(num_fresh)
        # A batch of (nearly) all new keys keeps its claim tokens as rows when no freed row
        # waits: the claims then wrote the final index entries, but for the few new keys
        # whose token lies past the batch's new rows (see ``_tokens_as_rows``).
        tokens_kept = tf.logical_and(
            tf.equal(t.num_free, 0), KEPT_TOKENS_DIV * (n - num_fresh) <= n
        )
        if pick_last:  # the last of repeated keys is found by _resolve_found
            tokens_kept = tf.logical_and(tokens_kept, tf.equal(num_fresh, n))

        def kept() -> Any:
            rows = self._tokens_as_rows(keys, base, claims, num_fresh)
            fresh_rows = tf.range(num_fresh) + base
            if pick_last:  # every key new, each one its own last
                return rows, fresh_rows, tf.ones(tf.reshape(n, [1]), tf.bool)
            return rows, fresh_rows

        def given() -> Any:
            fresh_rows = self.allocate_rows(num_fresh)
            rows, last = self._resolve_found(keys, base, claims, fresh_rows, num_fresh, pick_last)
            return (rows, fresh_rows, last) if pick_last else (rows, fresh_rows)

        resolved = tf.cond(tokens_kept, kept, given)
        return resolved if pick_last else (*resolved, None)

    def _tokens_as_rows(
        self, keys: tf.Tensor, base: tf.Tensor, claims: Claims, num_fresh: tf.Tensor
    ) -> tf.Tensor:
        """The rows of a batch whose new keys take the rows ``base ..`` in order of
        their tokens, ``base + i`` for key ``i``: the row of each key.

        The new keys get the rows ``base .. base + num_fresh - 1``. A new key whose token
        lies past them takes the row of a key found (present, or repeating a new key) in
        that range: only those few index entries are written again.
        """
        t = self.t
        n = _count(keys)
        self._ensure_rows(base + num_fresh)
        t.next_row.assign(base + num_fresh)
        tokens = tf.range(n) + base

        def some_found() -> tf.Tensor:
            slots, rows = claims.merged()
            won = tf.equal(rows, tokens)
            below = tf.range(n) < num_fresh
            late = positions(tf.logical_and(won, tf.logical_not(below)))
            gaps = positions(tf.logical_and(tf.logical_not(won), below))  # as many
            entries = tf.stack([tf.gather(keys, late), gaps + base], 1)
            t.index.scatter_update(tf.IndexedSlices(entries, tf.gather(slots, late)))
            # token past the new rows -> its new row, for the new keys and their repeats
            moved = tf.scatter_nd((late - num_fresh)[:, None], gaps, [n - num_fresh])
            past = rows >= base + num_fresh
            at = tf.where(past, rows - base - num_fresh, 0)
            return tf.where(past, tf.gather(moved, at) + base, rows)

        return tf.cond(tf.equal(num_fresh, n), lambda: tokens, some_found)

    def _resolve_found(
        self,
        keys: tf.Tensor,
        base: tf.Tensor,
        claims: Claims,
        fresh_rows: tf.Tensor,
        num_fresh: tf.Tensor,
        pick_last: bool,
    ) -> tuple[tf.Tensor, tf.Tensor | None]:
        """:meth:`_resolve` of a batch with present or repeated keys, or given freed rows:
        the new keys' index entries get their rows, and every key the row of its key.
        Returns ``(rows, last)``."""
        t = self.t
        n = _count(keys)
        slots, rows = claims.merged()
        fresh = tf.equal(rows, tf.range(n) + base)
        all_new = tf.equal(num_fresh, n)
        at = positions(fresh)
        entries = tf.stack([tf.gather(keys, at), fresh_rows], 1)
        t.index.scatter_update(tf.IndexedSlices(entries, tf.gather(slots, at)))
        claimed = rows >= base
        # Usually every claim is its claimer's own (no key repeats a new key of the batch):
        # the fresh rows go straight to the claimers' positions.
        distinct = tf.reduce_all(tf.equal(claimed, fresh))
        rows_found = rows

        def numbered() -> tf.Tensor:
            """The claimer's rank among the fresh keys, for every key holding a token
            (claimers and their repeats): it numbers the new key and its new row."""
            rank = tf.dynamic_stitch(  # position -> rank among the fresh keys (cumsum is slow)
                [tf.range(n + 1, dtype=tf.int32), tf.cast(at, tf.int32)],
                [tf.zeros(tf.reshape(n + 1, [1]), tf.int64), tf.range(num_fresh)],
            )
            return tf.gather(rank, tf.where(claimed, rows_found - base, n))

        rows = tf.cond(
            distinct,
            lambda: tf.cond(  # every key new: the fresh rows in order
                all_new,
                lambda: fresh_rows,
                lambda: tf.tensor_scatter_nd_update(rows_found, at[:, None], fresh_rows),
            ),
            lambda: tf.where(
                claimed, tf.gather(tf.concat([fresh_rows, [EMPTY]], 0), numbered()), rows_found
            ),
        )
        if not pick_last:
            return rows, None
        last = tf.cond(
            tf.logical_and(distinct, tf.reduce_all(claimed)),
            lambda: tf.ones(tf.reshape(n, [1]), tf.bool),
            lambda: self._last_of_each(keys, slots, rows, claimed, numbered(), num_fresh),
        )
        return rows, last

    def _last_of_each(
        self,
        keys: tf.Tensor,
        slots: tf.Tensor,
        rows: tf.Tensor,
        claimed: tf.Tensor,
        new_key: tf.Tensor,
        num_fresh: tf.Tensor,
    ) -> tf.Tensor:
        """Mark the last occurrence of each key of a resolved batch.

        The occurrences of a new key are numbered by ``new_key``: a segment max picks the
        last. Keys already present race for their slots (:meth:`last_occurrence`).
        """
        new_at, old_at = positions(claimed), positions(tf.logical_not(claimed))
        number = tf.gather(new_key, new_at)
        position = tf.cast(new_at, tf.int32)  # GPU segment max takes int32 data, not int64
        latest = tf.math.unsorted_segment_max(position, number, num_fresh)
        new_last = tf.equal(position, tf.gather(latest, number))
        old_last = self.last_occurrence(*(tf.gather(x, old_at) for x in (keys, slots, rows)))
        last = tf.dynamic_stitch(
            [position, tf.cast(old_at, tf.int32)],
            [tf.cast(new_last, tf.int32), tf.cast(old_last, tf.int32)],
        )
        return tf.cast(last, tf.bool)

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Upsert; the last of duplicated keys wins (with a serial scatter, by writing the
        rows in batch order). Eagerly (an op-by-op bulk call), the rows are written beside
        the claims where they can be (:class:`_EarlyRows`)."""
        t = self.t
        eager = tf.executing_eagerly() and t.serial_scatter
        early = _EarlyRows(self, keys, values) if eager else None
        rows, _, last = self._resolve(keys, pick_last=not t.serial_scatter, early=early)
        if early is not None and early.final():
            self.stamp(rows)
            return
        self.write_keys(keys, rows)
        if last is None:
            t.values.scatter_update(tf.IndexedSlices(values, rows))
            self.stamp(rows)
            return

        def write_last() -> tf.Tensor:
            at = positions(last)
            t.values.scatter_update(tf.IndexedSlices(tf.gather(values, at), tf.gather(rows, at)))
            return tf.constant(True)

        def write_all() -> tf.Tensor:
            t.values.scatter_update(tf.IndexedSlices(values, rows))
            return tf.constant(True)

        tf.cond(tf.reduce_all(last), write_all, write_last)
        self.stamp(rows)

    def compile_load(self, count: tf.Tensor) -> None:
        """Have XLA compile the race a bulk load runs (:data:`~._index.race_from`, chunks
        of :data:`~._index.CHUNK` keys) for the index as it is, with no key taking part:
        nothing is written (every write of a key that takes no part goes out of bounds,
        which XLA's scatter skips). Eagerly the compile runs in the background
        (:mod:`._xla`). ``count``, the keys of a load batch, is checked by the caller."""
        del count  # one shape a capacity, whatever the batch
        args = load_race_args()
        race = race_from[self.t.serial_scatter]
        if tf.executing_eagerly():
            _xla.prepare(race, self.t.index, *args)
        else:
            race(self.t.index.handle, *args)

    def load_distinct(self, keys: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        """Insert keys absent from the table and distinct among themselves (a bulk load,
        e.g. a restore), placed directly like a rehash: no claim tokens, no search for
        repeats. Returns how many keys broke that precondition (not placed; their rows
        were taken and written, so the table must then be cleared)."""
        t = self.t
        n = _count(keys)
        self.reserve(n)
        rows = self.allocate_rows(n)
        t.values.scatter_update(tf.IndexedSlices(values, rows))
        self.write_keys(keys, rows)
        self.stamp(rows)
        t.num_keys.assign_add(n)
        return self.place(keys, rows)

    def load_prepared(self, keys: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        """:meth:`load_distinct` into a table that has room for the keys already (an eager
        bulk load reserves it first, see ``HashTable.load_distinct``): no growth of the
        index or the row store, so its kernel is about two thirds of the nodes to trace,
        which a restore in a new process waits for before its first load. A batch that
        does not fit fails before it writes."""
        t = self.t
        n = _count(keys)
        with tf.control_dependencies([self.room_for_load(n)]):
            rows = self.allocate_rows(n, grow=False)
        t.values.scatter_update(tf.IndexedSlices(values, rows))
        self.write_keys(keys, rows)
        self.stamp(rows)
        t.num_keys.assign_add(n)
        return self.place(keys, rows)

    def accum_insert(self, keys: tf.Tensor, deltas: tf.Tensor) -> None:
        """Add deltas, inserting missing keys at zero first."""
        t = self.t
        rows, new_rows, _ = self._resolve(keys, pick_last=False)
        t.values.scatter_update(
            tf.IndexedSlices(
                tf.zeros(tf.stack([_count(new_rows), t.dim]), t.values.dtype), new_rows
            )
        )
        t.values.scatter_add(tf.IndexedSlices(deltas, rows))
        self.write_keys(keys, rows)
        self.stamp(rows)

    def accum_existing(self, keys: tf.Tensor, deltas: tf.Tensor) -> None:
        """Add deltas to present keys; missing keys are ignored."""
        t = self.t
        rows = self.find_rows(keys)
        exists = rows >= 0
        rows = tf.boolean_mask(rows, exists)
        t.values.scatter_add(tf.IndexedSlices(tf.boolean_mask(deltas, exists), rows))
        self.stamp(rows)

    def remove(self, keys: tf.Tensor) -> None:
        """Tombstone the slots of present keys and free their rows."""
        t = self.t
        slots, rows = self.find(keys)
        present = positions(slots >= 0)
        keys, slots, rows = (tf.gather(x, present) for x in (keys, slots, rows))
        last = positions(self.last_occurrence(keys, slots, rows))
        keys, slots, rows = (tf.gather(x, last) for x in (keys, slots, rows))
        tombstones = tf.fill(tf.shape(slots), tf.constant(DELETED, tf.int64))
        t.index.scatter_update(tf.IndexedSlices(tf.stack([keys, tombstones], 1), slots))
        self.unstamp(rows)
        self.free(rows)
        t.num_keys.assign_sub(_count(rows))
        t.num_deleted.assign_add(_count(rows))
        if t.track_changes:
            self.log_removed(keys)

    def clear(self) -> None:
        """Empty the table: an index that holds keys or tombstones, and a row store that
        handed rows out, go back to their initial sizes.

        A buffer that holds nothing is kept, not allocated anew (new memory is slow to
        touch): an index without keys or tombstones is all empty, and rows are written
        when they are handed out. So a table grown for rows to come (``reserve``, as a
        restore does while it reads) keeps that room.
        """
        t = self.t
        if t.fixed_shapes:
            self._clear_in_place()
            return
        capacity = tf.constant(t.init_capacity, tf.int64)
        used = t.num_keys + t.num_deleted > 0

        def empty() -> tf.Tensor:
            replace(t.index, empty_index(capacity))
            return tf.constant(True)

        tf.cond(used, empty, lambda: tf.constant(False))
        rows = tf.constant(t.init_rows, tf.int64)

        def shrink() -> tf.Tensor:
            replace(t.values, tf.zeros(tf.stack([rows, t.dim]), t.values.dtype))
            replace(t.row_keys, tf.zeros(tf.reshape(rows, [1]), tf.int64))
            if t.track_changes:  # stamps are as long as the row store
                # Fill has no GPU kernel for uint32 (nor int32): cast int64 zeros
                zeros = tf.zeros(tf.reshape(rows, [1]), tf.int64)
                replace(t.stamps, tf.cast(zeros, STAMP_DTYPE))
            return tf.constant(True)

        handed_out = tf.logical_and(t.next_row > 0, tf.not_equal(variable_length(t.values), rows))
        tf.cond(handed_out, shrink, lambda: tf.constant(False))
        t.free_rows.assign(tf.zeros([16], tf.int64))
        for counter in (t.num_keys, t.num_deleted, t.num_free, t.next_row, t.num_removed):
            counter.assign(0)
        if t.track_changes:  # the epoch goes on: a cleared table has no history
            t.removed.assign(tf.zeros([16], tf.int64))
            t.removed_at.assign(tf.zeros([16], tf.int64))

    def _clear_in_place(self) -> None:
        """``clear`` of a fixed-shape table: every variable keeps its shape; the index is
        emptied and the counters reset (rows are written when handed out)."""
        t = self.t
        replace(t.index, empty_index(variable_length(t.index)))
        for counter in (t.num_keys, t.num_deleted, t.num_free, t.next_row, t.num_removed):
            counter.assign(0)

    def snapshot(self) -> tuple[tf.Tensor, ...]:
        """The index, the row store, the key count, the key of each row, the rows handed
        out, the free list and its length, as they are, without a copy: a later write to
        the table copies a buffer these tensors still hold (the variables are in
        copy-on-write mode, see :func:`read_shared`)."""
        t = self.t
        return (
            read_shared(t.index),
            read_shared(t.values),
            t.num_keys.read_value(),
            read_shared(t.row_keys),
            t.next_row.read_value(),
            read_shared(t.free_rows),
            t.num_free.read_value(),
        )

    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """``(keys, values)`` of every live slot, read in one pass."""
        t = self.t
        live = self.live_entries()
        keys, rows = entry_columns(live)
        return keys, tf.gather(t.values, rows)


#: The thread that writes an eager insert's rows beside its claims (:class:`_EarlyRows`).
_WRITER = LazyPool(1, "de_store-rows")


class _EarlyRows:
    """The rows of an eager bulk insert, written by another thread while the caller's
    thread claims the keys' slots, as the batch's new keys take them if every key is new:
    key ``i`` the row ``base + i`` (its claim token kept as its row, see
    :meth:`TableOps._resolve`). The claims touch the index only, the writes the row store
    only; on two cores the writes (about 0.05 s for 1M rows of dim 16) take no time of
    their own in a batch of new keys (a table being filled), whose claims take about
    twice as long.

    The row store grows first where it has no room for the batch, only while the claims
    wait for XLA's compile of the race (see :func:`~._claim_loop._race_chunks_eagerly`):
    the first batch a table being filled in a new process inserts at a capacity waits
    about a quarter of a second there. A growth copies every row held, which a batch of
    present keys would not need.

    Rows past those handed out are never read, so a batch not all new (present or
    repeated keys) only wrote them once more than it needed: its rows are written again,
    where the resolve put them. Only on the host's first CPU: eager ops elsewhere run
    one thread at a time (see :data:`~._locking.EAGER_ON_DEVICE`), which the caller holds.
    """

    def __init__(self, ops: TableOps, keys: tf.Tensor, values: tf.Tensor) -> None:
        self.ops, self.keys, self.values = ops, keys, values
        self.end: int | None = None  # the next row once the batch took the rows ``base ..``
        self.writing: Future[None] | None = None

    def start(self, base: tf.Tensor) -> None:
        """Start writing the rows ``base ..`` in the writer's thread, where they are the
        batch's if every key is new: a batch of compiled claims (:data:`COMPILED_MIN_KEYS`
        keys or more) into a table that hands out no freed row (those would go first),
        whose row store has room for it or whose race will wait for its compile (a batch
        of :data:`~._claim_loop.WAIT_MIN_KEYS` keys or more, :func:`~._claim_loop.race_waits`)."""
        t = self.ops.t
        n = int(self.keys.shape[0])
        if n < COMPILED_MIN_KEYS or needs_eager_lock(t.values.device):
            return
        if int(t.num_free.read_value()) != 0:
            return
        if int(base) + n > eager_length(t.values) and not race_waits(t, n):
            return
        self.end = int(base) + n
        self.writing = _WRITER.submit(self._write, base, n)

    def _write(self, base: tf.Tensor, n: int) -> None:
        t = self.ops.t
        with tf.device(t.values.device):
            self.ops._ensure_rows(base + n)
            rows = tf.range(n, dtype=tf.int64) + base
            t.values.scatter_update(tf.IndexedSlices(self.values, rows))
            self.ops.write_keys(self.keys, rows)

    def join(self, quiet: bool = False) -> None:
        """Wait for the writes (the claims are done): the resolve grows the row store
        next. Raises what the writes raised, unless ``quiet`` (the claims failed)."""
        if self.writing is not None:
            wait([self.writing])
            if not quiet:
                self.writing.result()

    def final(self) -> bool:
        """Whether the rows written are the batch's: every key was new, so the resolve
        handed out exactly the rows ``base .. base + n - 1``, in batch order."""
        return self.end is not None and int(self.ops.t.next_row.read_value()) == self.end
