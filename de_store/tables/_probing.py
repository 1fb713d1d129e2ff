"""The probes of :class:`~de_store.tables.hash_table.HashTable`'s index: finding the row
of each key, and claiming or placing a slot for each.

Every function here builds TensorFlow ops only (no Python control flow on tensor values),
so it traces inside ``tf.function`` and runs on whatever device the table lives on.
:class:`ProbeOps` probes one table's index; big lookups start with the compiled first
probe rounds of :mod:`._index`, big inserts and loads with the compiled races of
:mod:`._claim_loop`, chunk after chunk, and big inserts go on in its claim loop. The
operations built on these probes are in :mod:`._table_ops`.
"""

from __future__ import annotations

import tensorflow as tf

from de_store.tables import _xla
from de_store.tables._claim_loop import claim_loop, probe_rounds, race_chunks
from de_store.tables._index import (
    COMPILED_MIN_KEYS,
    EMPTY,
    entry_columns,
    first_probes,
    home_slots,
    next_slots,
    padded,
    positions,
    slot_rows,
)
from de_store.tables._types import Claims, View
from de_store.tables._variables import count as _count
from de_store.tables._variables import variable_length

# Tokens of the last-occurrence race sit above every real row id. (The claims of an insert
# use ``next_row + i``, also above every row held.)
TOKEN_BASE = 1 << 40


class ProbeOps:
    """The probes of one table's index (built while tracing a kernel): finding keys, and
    claiming or placing slots for them; ``self.t`` is the table."""

    t: View

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
        left = positions(next_pos >= 0)

        def rest() -> tf.Tensor:
            _, found = self.probe(tf.gather(keys, left), False, start=tf.gather(next_pos, left))
            return tf.tensor_scatter_nd_update(rows, left[:, None], found)

        return tf.cond(_count(left) > 0, rest, lambda: rows)

    def _first_probes(self, keys: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:func:`first_probes` on the batch padded to its size class (few XLA shapes)."""
        n = _count(keys)
        return tuple(x[:n] for x in _xla.call(first_probes, self.t.index, *padded(n, keys)))

    def find_or_claim(self, keys: tf.Tensor, base: tf.Tensor) -> Claims:
        """``probe`` claiming empty slots, key ``i`` with the token ``base + i``; big
        batches start with a compiled race from the keys' home slots (:meth:`_first_race`)."""
        return Claims(
            *tf.cond(
                _count(keys) >= COMPILED_MIN_KEYS,
                lambda: self._claim_compiled(keys, base),
                lambda: self._claim_uncompiled(keys, base),
            )
        )

    def _claim_uncompiled(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:meth:`probe` claiming, every key left to the loop."""
        n = _count(keys)
        none = tf.fill(tf.reshape(n, [1]), tf.constant(EMPTY, tf.int64))
        got = self.probe(keys, True, tokens=base)
        return (none, none, tf.range(n), *got, tf.constant(0, tf.int64))

    def _claim_compiled(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """:meth:`_first_race` with the tokens ``base + i``, then
        :func:`~._claim_loop.claim_loop` for the keys left."""
        tokens = tf.range(_count(keys)) + base
        rows, slots, start, counts = self._first_race(keys, tokens)
        left = positions(start >= 0)

        def loop() -> tuple[tf.Tensor, tf.Tensor]:
            return claim_loop(self.t, tf.gather(keys, left), tf.gather(start, left), left + base)

        got = tf.cond(
            _count(left) > 0, loop, lambda: (tf.zeros([0], tf.int64), tf.zeros([0], tf.int64))
        )
        return (slots, rows, left, *got, counts[0])

    def _first_race(self, keys: tf.Tensor, tokens: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """The first race of a big batch, from each key's home slot, chunk after chunk
        (:func:`~._claim_loop.race_chunks`): the compiled race of :data:`~._index.CHUNK`
        keys is the one shape XLA compiles per capacity for inserts and loads."""
        home = tf.fill(tf.shape(keys), tf.constant(-1, tf.int64))
        return race_chunks(self.t, keys, tokens, home)

    # -- the probe loop ----------------------------------------------------------------
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
            held, rows = entry_columns(tf.gather(t.index, pos))
            hit = tf.logical_and(rows >= 0, tf.equal(held, ks))
            empty = tf.equal(rows, EMPTY)
            if claim:
                done = tf.logical_or(hit, self._claim(token(idx), ks, pos, empty))
                # A loser of a race stays: the winner may be a duplicate of it.
                next_pos = tf.where(empty, pos, next_slots(pos, ks, mask))
            else:
                done = tf.logical_or(hit, empty)
                next_pos = pos  # moved below, for the kept keys only
            done_at = positions(done)
            found = found.write(step, tf.gather(idx, done_at))
            hit, rows = tf.gather(hit, done_at), tf.gather(rows, done_at)
            if claim:  # the slot, and the row found or the claim token
                mine = token(tf.gather(idx, done_at))
                at = [tf.gather(pos, done_at), tf.where(hit, rows, mine)]
            else:  # the slot and row found, or (-1, EMPTY)
                at = [tf.where(hit, tf.gather(pos, done_at), -1), tf.where(hit, rows, EMPTY)]
            found_at = found_at.write(step, tf.stack(at, axis=1))
            keep = positions(tf.logical_not(done))
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
            won = tf.logical_and(empty, tf.equal(slot_rows(t.index, pos), tokens))
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
        at = positions(where)
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
        seen = slot_rows(t.index, slots)

        def rerace(later: tf.Tensor, rounds: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            mine, where_ = tf.gather(tokens, later), tf.gather(slots, later)
            t.index.scatter_update(
                tf.IndexedSlices(tf.stack([tf.gather(keys, later), mine], 1), where_)
            )
            held = slot_rows(t.index, where_)
            return tf.boolean_mask(later, mine > held), rounds + 1

        _, rounds = tf.while_loop(
            lambda later, _: _count(later) > 0,
            rerace,
            (positions(tokens > seen), tf.constant(0, tf.int32)),
            shape_invariants=(tf.TensorShape([None]), tf.TensorShape([])),
        )
        last = tf.cond(
            rounds > 0,
            lambda: tf.equal(slot_rows(t.index, slots), tokens),
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
        with :meth:`_first_race`, like big inserts, then race again where it left many
        keys (:meth:`_race_again`), and the probe loop takes the keys left; small ones go
        to the probe loop from their home slots. The loop is traced
        once, after the branch: a restore traces its bulk load in a new process before its
        first rows load.
        """

        def raced() -> tuple[tf.Tensor, ...]:
            _, _, start, counts = self._first_race(keys, rows)
            left = positions(start >= 0)
            ks, rs, st = (tf.gather(x, left) for x in (keys, rows, start))
            *rest, more = tf.cond(
                _count(left) >= COMPILED_MIN_KEYS,
                lambda: self._race_again(ks, rs, st),
                lambda: (ks, rs, st, tf.constant(0, tf.int64)),
            )
            return (*rest, tf.unstack(counts)[1] + more)

        def from_home() -> tuple[tf.Tensor, ...]:
            home = home_slots(keys, variable_length(self.t.index) - 1)
            return keys, rows, home, tf.constant(0, tf.int64)

        *left, repeated = tf.cond(_count(keys) >= COMPILED_MIN_KEYS, raced, from_home)
        return repeated + self._place_loop(*left)

    def _race_again(
        self, keys: tf.Tensor, rows: tf.Tensor, start: tf.Tensor
    ) -> tuple[tf.Tensor, ...]:
        """One more compiled race of the keys the first one left (16,384 or more), from
        where each stopped: the keys of a bulk load into a table near its load limit
        meet more full slots, and a fifth of a batch can be left (a batch loaded last
        into 10M keys). The probe loop takes the few it leaves in turn. Returns the keys
        left, their rows and slots to probe from, and how many found their own key."""
        _, _, going_on, counts = race_chunks(self.t, keys, rows, start)
        left = positions(going_on >= 0)
        return (*(tf.gather(x, left) for x in (keys, rows, going_on)), tf.unstack(counts)[1])

    def place_from_home(self, keys: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """:meth:`place` in the probe loop only, from each key's home slot: the rehash of
        every kernel but a growing insert's (see
        :meth:`~._capacity.CapacityOps.rehash`), and a fixed-shape table's placing. The
        loop keeps the compiled race out of those kernels, so they trace faster."""
        home = home_slots(keys, variable_length(self.t.index) - 1)
        return self._place_loop(keys, rows, home)

    def _place_loop(self, keys: tf.Tensor, rows: tf.Tensor, start: tf.Tensor) -> tf.Tensor:
        """The probe loop of :meth:`place`, from the slots ``start``."""
        t = self.t
        mask = variable_length(t.index) - 1

        def body(
            ks: tf.Tensor, rs: tf.Tensor, pos: tf.Tensor, repeated: tf.Tensor
        ) -> tuple[tf.Tensor, ...]:
            empty = tf.equal(slot_rows(t.index, pos), EMPTY)
            written = self._write_entries(ks, rs, pos, empty)
            with tf.control_dependencies(written):
                won = tf.equal(slot_rows(t.index, pos), rs)
            if not t.serial_scatter:  # the winner writes its whole entry once more
                written = self._write_entries(ks, rs, pos, won)
            lost = positions(tf.logical_not(won))
            with tf.control_dependencies(written):  # read after the writes
                held, held_rows = entry_columns(tf.gather(t.index, tf.gather(pos, lost)))
            own = tf.logical_and(held_rows >= 0, tf.equal(held, tf.gather(ks, lost)))
            keep = tf.gather(lost, positions(tf.logical_not(own)))
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


def _entries(keys: tf.Tensor, rows: tf.Tensor, at: tf.Tensor) -> tf.Tensor:
    """Index entries ``[m, 2]`` (key, row) of the keys at positions ``at``."""
    return tf.stack([tf.gather(keys, at), tf.gather(rows, at)], axis=1)
