"""The graph operations of :class:`~de_store.tables.hash_table.HashTable`.

Every function here builds TensorFlow ops only (no Python control flow on tensor values),
so it traces inside ``tf.function`` and runs on whatever device the table lives on.
:class:`TableOps` builds the ops of one operation over one table's variables; the shared
``tf.function`` s that call it are in :mod:`._kernels`, the index layout and the compiled
first probe rounds in :mod:`._index`, the growth of the index and the row store in
:mod:`._capacity`, change tracking in :mod:`._tracking`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from de_store.tables._capacity import BATCHES_AHEAD, CapacityOps
from de_store.tables._index import (
    COMPILED_MIN_KEYS,
    DELETED,
    EMPTY,
    empty_index,
    first_probes,
    first_race,
    home_slots,
    next_slots,
    padded,
    size_class,
)
from de_store.tables._race import KEPT_TOKENS_DIV, RaceOps, probe_rounds
from de_store.tables._tracking import (
    STAMP_DTYPE,
    TrackingOps,
    read_shared,
    replace,
    variable_length,
)
from de_store.tables._tracking import count as _count
from de_store.tables._types import Claims, View

# Tokens of the last-occurrence race sit above every real row id. (The claims of an insert
# use ``next_row + i``, also above every row held.)
TOKEN_BASE = 1 << 40


class TableOps(CapacityOps, RaceOps, TrackingOps):
    """Graph operations over one table's variables (built while tracing a kernel)."""

    def __init__(self, table: View) -> None:
        self.t = table

    def find(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``probe`` without claiming."""
        return self.probe(keys, False)

    def find_rows(self, keys: tf.Tensor) -> tf.Tensor:
        """The row of each key, ``EMPTY`` when missing; big batches start with
        :func:`first_probes`."""
        return tf.cond(
            _count(keys) >= COMPILED_MIN_KEYS,
            lambda: self._find_rows_compiled(keys),
            lambda: self.probe(keys, False)[1],
        )

    def _find_rows_compiled(self, keys: tf.Tensor) -> tf.Tensor:
        """:func:`first_probes`, then the probe loop from where they stopped, for the keys
        still unresolved."""
        rows, _, next_pos = self._first_probes(keys)
        left = tf.where(next_pos >= 0)[:, 0]

        def rest() -> tf.Tensor:
            _, found = self.probe(tf.gather(keys, left), False, start=tf.gather(next_pos, left))
            return tf.tensor_scatter_nd_update(rows, left[:, None], found)

        return tf.cond(_count(left) > 0, rest, lambda: rows)

    def _first_probes(self, keys: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:func:`first_probes` on the batch padded to its size class (few XLA shapes)."""
        n = _count(keys)
        return tuple(x[:n] for x in first_probes(self.t.index.handle, *padded(n, keys)))

    def find_or_claim(self, keys: tf.Tensor, base: tf.Tensor) -> Claims:
        """``probe`` claiming empty slots, key ``i`` with the token ``base + i``; big
        batches start with :func:`~._index.first_race`."""
        return Claims(
            *tf.cond(
                _count(keys) >= COMPILED_MIN_KEYS,
                lambda: self._claim_compiled(keys, base),
                lambda: self._claim_loop(keys, base),
            )
        )

    def _claim_loop(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:meth:`probe` claiming, every key left to the loop."""
        n = _count(keys)
        none = tf.fill(tf.reshape(n, [1]), tf.constant(EMPTY, tf.int64))
        got = self.probe(keys, True, tokens=base)
        return (none, none, tf.range(n), *got, tf.constant(0, tf.int64))

    def _claim_compiled(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:func:`~._index.first_race` with the tokens ``base + i``, then
        :meth:`_race_loop` for the keys left."""
        tokens = tf.range(_count(keys)) + base
        rows, slots, start, counts = self._first_race(keys, tokens)
        left = tf.where(start >= 0)[:, 0]
        got = tf.cond(
            _count(left) > 0,
            lambda: self._race_loop(tf.gather(keys, left), tf.gather(start, left), left + base),
            lambda: (tf.zeros([0], tf.int64), tf.zeros([0], tf.int64)),
        )
        return (slots, rows, left, *got, counts[0])

    def _first_race(self, keys: tf.Tensor, tokens: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:func:`~._index.first_race` on the batch padded to its size class."""
        n = _count(keys)
        race = first_race[self.t.serial_scatter]
        *got, counts = race(self.t.index.handle, *padded(n, keys, tokens), n)
        return (*(x[:n] for x in got), counts)

    # -- probing -----------------------------------------------------------------------
    def probe(
        self,
        keys: tf.Tensor,
        claim: bool,
        start: tf.Tensor | None = None,
        tokens: tf.Tensor | int = TOKEN_BASE,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(slots, rows)`` for each key.

        ``slots[i]`` is the slot holding ``keys[i]``; a missing key gets ``-1``, or, when
        ``claim``, an empty slot it (or a duplicate of it) claimed with a token. ``rows[i]`` is
        the slot's row id as seen when the key was found (for a fresh claim, the token:
        ``tokens + i`` for key ``i``, above every row held).
        Each round works on the keys still unresolved only. Probing starts at each key's
        home slot, or at ``start`` (slots already probed are skipped).
        """
        t = self.t
        mask = variable_length(t.index) - 1
        per_key = isinstance(tokens, tf.Tensor) and tokens.shape.rank == 1

        def token(i: tf.Tensor) -> tf.Tensor:
            return tf.gather(tokens, i) if per_key else i + tokens

        def body(step, idx, ks, pos, found, found_at):
            entry = tf.gather(t.index, pos)
            rows = entry[:, 1]
            hit = tf.logical_and(rows >= 0, tf.equal(entry[:, 0], ks))
            empty = tf.equal(rows, EMPTY)
            if claim:
                done = tf.logical_or(hit, self._claim(token(idx), ks, pos, empty))
                # A loser of a race stays: the winner may be a duplicate of it.
                next_pos = tf.where(empty, pos, next_slots(pos, ks, mask))
            else:
                done = tf.logical_or(hit, empty)
                next_pos = pos  # moved below, for the kept keys only
            done_at = tf.where(done)[:, 0]
            found = found.write(step, tf.gather(idx, done_at))
            hit, rows = tf.gather(hit, done_at), tf.gather(rows, done_at)
            if claim:  # the slot, and the row found or the claim token
                mine = token(tf.gather(idx, done_at))
                at = [tf.gather(pos, done_at), tf.where(hit, rows, mine)]
            else:  # the slot and row found, or (-1, EMPTY)
                at = [tf.where(hit, tf.gather(pos, done_at), -1), tf.where(hit, rows, EMPTY)]
            found_at = found_at.write(step, tf.stack(at, axis=1))
            keep = tf.where(tf.logical_not(done))[:, 0]
            kept = [tf.gather(x, keep) for x in (idx, ks, next_pos)]
            if not claim:
                kept[2] = next_slots(kept[2], kept[1], mask)
            return (step + 1, *kept, found, found_at)

        return probe_rounds(body, [keys, home_slots(keys, mask) if start is None else start])

    def _claim(
        self, tokens: tf.Tensor, keys: tf.Tensor, pos: tf.Tensor, empty: tf.Tensor
    ) -> tf.Tensor:
        """Race for empty slots with ``(key, token)`` entries; return which keys won theirs.

        Any one writer of a contested slot may win, and a GPU scatter may even mix the
        columns of two writers, so there the winner (by token) writes its entry once more.
        """
        t = self.t
        written = self._write_entries(keys, tokens, pos, empty)
        with tf.control_dependencies(written):
            won = tf.logical_and(empty, tf.equal(tf.gather(t.index, pos)[:, 1], tokens))
        if not t.serial_scatter:
            written = self._write_entries(keys, tokens, pos, won)
        # The next probe round must see the written keys: make its inputs wait for them.
        with tf.control_dependencies(written):
            return tf.identity(won)

    def _write_entries(
        self, keys: tf.Tensor, rows: tf.Tensor, slots: tf.Tensor, where: tf.Tensor
    ) -> list[tf.Operation]:
        """Scatter the entries ``(key, row)`` marked by ``where`` into their slots; return
        the write (for control dependencies; none when eager)."""
        at = tf.where(where)[:, 0]
        written = self.t.index.scatter_update(
            tf.IndexedSlices(_entries(keys, rows, at), tf.gather(slots, at))
        )
        return [written.op] if hasattr(written, "op") else []

    def last_occurrence(self, keys: tf.Tensor, slots: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """Mark, among keys resolved to the same slot, the last one in the batch.

        Every key writes its token into its slot and reads it back. A GPU scatter keeps an
        arbitrary writer, so keys later than the one kept race again until the last one
        holds every slot (on the CPU, writes apply in order and no re-race runs). The row
        ids are restored afterwards.
        """
        t = self.t
        tokens = tf.range(_count(slots)) + TOKEN_BASE
        t.index.scatter_update(tf.IndexedSlices(tf.stack([keys, tokens], 1), slots))
        seen = tf.gather(t.index, slots)[:, 1]

        def rerace(later: tf.Tensor, rounds: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            mine, where_ = tf.gather(tokens, later), tf.gather(slots, later)
            t.index.scatter_update(
                tf.IndexedSlices(tf.stack([tf.gather(keys, later), mine], 1), where_)
            )
            held = tf.gather(t.index, where_)[:, 1]
            return tf.boolean_mask(later, mine > held), rounds + 1

        _, rounds = tf.while_loop(
            lambda later, _: _count(later) > 0,
            rerace,
            (tf.where(tokens > seen)[:, 0], tf.constant(0, tf.int32)),
            shape_invariants=(tf.TensorShape([None]), tf.TensorShape([])),
        )
        last = tf.cond(
            rounds > 0,
            lambda: tf.equal(tf.gather(t.index, slots)[:, 1], tokens),
            lambda: tf.equal(seen, tokens),
        )
        with tf.control_dependencies([last]):
            t.index.scatter_update(tf.IndexedSlices(tf.stack([keys, rows], 1), slots))
        return tf.identity(last)

    def place(self, keys: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """Write ``keys`` absent from the index, distinct, with their distinct ``rows``.

        Keys race for empty slots with their row ids; every loser moves on. Returns how many
        keys broke the precondition (present already, or repeated in ``keys``: the slot
        they lost, or passed, holds their own key); those are not placed. Big batches start
        with :func:`~._index.first_race`, like big inserts.
        """
        return tf.cond(
            _count(keys) >= COMPILED_MIN_KEYS,
            lambda: self._place_compiled(keys, rows),
            lambda: self.place_from_home(keys, rows),
        )

    def place_from_home(self, keys: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """:meth:`place` in the probe loop only, from each key's home slot (a rehash: its
        batches have every size, and a compiled race compiles for each). The loop keeps
        the compiled race out of every kernel that may rehash, so those trace faster: a
        restore traces them, and a growth rehashes only a few times."""
        home = home_slots(keys, variable_length(self.t.index) - 1)
        return self._place_loop(keys, rows, home)

    def _place_compiled(self, keys: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """:func:`~._index.first_race` with the rows as tokens, then the loop for the keys
        left."""
        _, _, start, counts = self._first_race(keys, rows)
        left = tf.where(start >= 0)[:, 0]
        return counts[1] + tf.cond(
            _count(left) > 0,
            lambda: self._place_loop(*(tf.gather(x, left) for x in (keys, rows, start))),
            lambda: tf.constant(0, tf.int64),
        )

    def _place_loop(self, keys: tf.Tensor, rows: tf.Tensor, start: tf.Tensor) -> tf.Tensor:
        """The probe loop of :meth:`place`, from the slots ``start``."""
        t = self.t
        mask = variable_length(t.index) - 1

        def body(
            ks: tf.Tensor, rs: tf.Tensor, pos: tf.Tensor, repeated: tf.Tensor
        ) -> tuple[tf.Tensor, ...]:
            empty = tf.equal(tf.gather(t.index, pos)[:, 1], EMPTY)
            written = self._write_entries(ks, rs, pos, empty)
            with tf.control_dependencies(written):
                won = tf.equal(tf.gather(t.index, pos)[:, 1], rs)
            if not t.serial_scatter:  # the winner writes its whole entry once more
                written = self._write_entries(ks, rs, pos, won)
            lost = tf.where(tf.logical_not(won))[:, 0]
            with tf.control_dependencies(written):
                held = tf.gather(t.index, tf.gather(pos, lost))  # after the writes
            own = tf.logical_and(held[:, 1] >= 0, tf.equal(held[:, 0], tf.gather(ks, lost)))
            keep = tf.gather(lost, tf.where(tf.logical_not(own))[:, 0])
            ks, rs = tf.gather(ks, keep), tf.gather(rs, keep)
            pos = next_slots(tf.gather(pos, keep), ks, mask)
            repeated += _count(lost) - _count(keep)
            return ks, rs, pos, repeated

        loop = tf.while_loop(
            lambda ks, *_: _count(ks) > 0,
            body,
            (keys, rows, start, tf.constant(0, tf.int64)),
            shape_invariants=(*(tf.TensorShape([None]),) * 3, tf.TensorShape([])),
        )
        return loop[3]

    # -- operations --------------------------------------------------------------------
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
        self, keys: tf.Tensor, pick_last: bool
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
        """Find or claim a slot per key and give claimed slots fresh rows.

        Returns ``(rows, fresh_rows, last)``: ``fresh_rows`` are the rows given to the new
        keys, ``last`` (when ``pick_last``, else ``None``) marks the last occurrence of each
        key.
        """
        t = self.t
        n = _count(keys)
        # A fixed-shape table reserves for the keys absent now (its room check counted
        # them): the whole batch could ask a full table for a rehash it cannot grow into.
        if t.fixed_shapes:
            self.reserve(self._incoming("insert", keys))
        else:
            self.reserve(n, BATCHES_AHEAD)
        # Key ``i`` claims with the token ``base + i`` (rows held now are below ``base``).
        base = t.next_row.read_value()
        claims = self.find_or_claim(keys, base)
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
        at = tf.where(fresh)[:, 0]
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
        new_at, old_at = tf.where(claimed)[:, 0], tf.where(tf.logical_not(claimed))[:, 0]
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
        rows in batch order)."""
        t = self.t
        rows, _, last = self._resolve(keys, pick_last=not t.serial_scatter)
        self.write_keys(keys, rows)
        if last is None:
            t.values.scatter_update(tf.IndexedSlices(values, rows))
            self.stamp(rows)
            return

        def write_last() -> tf.Tensor:
            at = tf.where(last)[:, 0]
            t.values.scatter_update(tf.IndexedSlices(tf.gather(values, at), tf.gather(rows, at)))
            return tf.constant(True)

        def write_all() -> tf.Tensor:
            t.values.scatter_update(tf.IndexedSlices(values, rows))
            return tf.constant(True)

        tf.cond(tf.reduce_all(last), write_all, write_last)
        self.stamp(rows)

    def compile_load(self, count: tf.Tensor) -> None:
        """Run the compiled first race of a bulk load of ``count`` keys with none taking
        part: XLA compiles it (or loads it from TensorFlow's cache) for the index as it is
        and ``count``'s size class, and nothing is written (every write of a key that takes
        no part goes out of bounds, which XLA's scatter skips)."""
        padding = tf.zeros(tf.reshape(size_class(count), [1]), tf.int64)
        race = first_race[self.t.serial_scatter]
        race(self.t.index.handle, padding, padding, tf.constant(0, tf.int64))

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
        present = tf.where(slots >= 0)[:, 0]
        keys, slots, rows = (tf.gather(x, present) for x in (keys, slots, rows))
        last = tf.where(self.last_occurrence(keys, slots, rows))[:, 0]
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
        return live[:, 0], tf.gather(t.values, live[:, 1])


def _entries(keys: tf.Tensor, rows: tf.Tensor, at: tf.Tensor) -> tf.Tensor:
    """Index entries ``[m, 2]`` (key, row) of the keys at positions ``at``."""
    return tf.stack([tf.gather(keys, at), tf.gather(rows, at)], axis=1)
