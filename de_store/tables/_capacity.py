"""The capacity operations of :class:`~de_store.tables._table_ops.TableOps`: growing the
index (a rehash, which places its keys again with the probes of
:class:`~de_store.tables._probing.ProbeOps`) and the row store, and handing out and
freeing row ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from de_store.tables import _xla
from de_store.tables._change_tracking import STAMP_DTYPE
from de_store.tables._index import (
    COMPILED_MIN_KEYS,
    empty_index,
    entry_columns,
    live_entries,
    load_race_args,
    race_from,
)
from de_store.tables._probing import ProbeOps
from de_store.tables._variables import push, read_shared, replace, variable_length

#: Most keys an insert's growth leaves room for beyond its own (see ``reserve``): 2**22,
#: an index of at most 2**23 more slots (128 MB).
AHEAD_MAX_KEYS = 1 << 22
#: How :meth:`CapacityOps.room_for_load` fails.
NO_ROOM = "the table has no room for a bulk load of"
#: Batches like the one that makes a table grow that the growth leaves room for.
BATCHES_AHEAD = 3


class CapacityOps(ProbeOps):
    """The growth of one table's index and row store, over its probes."""

    def live_entries(self) -> tf.Tensor:
        """The ``(key, row)`` entries of every occupied slot, ``[n, 2]``, in one read."""
        return live_entries(read_shared(self.t.index))

    def size(self) -> tf.Tensor:
        """The number of keys held."""
        return self.t.num_keys.read_value()

    def prepare(self, count: tf.Tensor) -> None:
        """Grow the index and the row store once for ``count`` more keys (a bulk load)."""
        self.reserve(count)
        self._ensure_rows(self.t.next_row + tf.maximum(count - self.t.num_free, 0), False)

    def room_check(self, kernel: str, args: tuple[tf.Tensor, ...], label: tf.Tensor) -> Any:
        """An assertion that kernel ``kernel`` on ``args`` fits a fixed-shape table as it is
        (``None`` for kernels that add nothing): the keys absent now counted as new (the
        rows of removed keys are reused first), so the growth branches of the operation
        are never taken."""
        t = self.t
        if kernel in ("insert", "load_distinct", "accum_insert", "prepare"):
            incoming = self._incoming(kernel, args[0])
            fits, room = self._room(incoming, t.num_keys)
            found = ["keys held", t.num_keys, "incoming up to", incoming]
        elif kernel == "remove" and t.track_changes:
            incoming = tf.size(args[0], out_type=tf.int64)
            log = variable_length(t.removed)
            fits = t.num_removed + incoming <= log
            found = ["removals logged", t.num_removed, "incoming up to", incoming]
            room = ["removal log", log]
        else:
            return None
        return tf.debugging.Assert(
            fits,
            [
                label,
                ": this fixed-shape table has no room for the batch:",
                *found,
                *room,
                "; call Variable.reserve (or HashTable.reserve) outside tf.function, "
                "between steps, or create it with a larger init_size",
            ],
            summarize=1,
        )

    def room_for_load(self, count: tf.Tensor) -> tf.Operation:
        """An assertion that ``count`` more keys fit the index and the row store as they
        are, without growing (:meth:`~._table_ops.TableOps.load_prepared`): tombstones
        counted, as ``reserve`` counts them."""
        t = self.t
        fits, room = self._room(count, t.num_keys + t.num_deleted)
        found = ["keys; keys held", t.num_keys, "tombstones", t.num_deleted]
        return tf.debugging.Assert(fits, [NO_ROOM, count, *found, *room], summarize=1)

    def _room(self, incoming: tf.Tensor, held: tf.Tensor) -> tuple[tf.Tensor, list[Any]]:
        """Whether ``incoming`` more keys fit the table as it is, its index holding
        ``held`` entries (freed rows reused first), and the room that decides it, for
        messages."""
        t = self.t
        capacity = variable_length(t.index)
        limit = self._load_limit(capacity)
        rows = variable_length(t.values)
        rows_needed = t.next_row + tf.maximum(incoming - t.num_free, 0)
        fits = tf.logical_and(held + incoming <= limit, rows_needed <= rows)
        return fits, ["index capacity", capacity, "load limit", limit, "rows", rows]

    def _incoming(self, kernel: str, keys: tf.Tensor) -> tf.Tensor:
        """The keys ``kernel`` may add: those absent now (a repeated one counted each time
        it repeats), the count itself for ``prepare``, every key for ``load_distinct``."""
        if kernel == "prepare":
            return keys
        if kernel == "load_distinct":  # absent and distinct by contract
            return tf.size(keys, out_type=tf.int64)
        # The room check and the reserve of the same operation ask alike: probe once.
        absent: dict[Any, tf.Tensor] = self.__dict__.setdefault("_absent", {})
        if keys.ref() not in absent:
            absent[keys.ref()] = tf.reduce_sum(tf.cast(self.find_rows(keys) < 0, tf.int64))
        return absent[keys.ref()]

    def _load_limit(self, capacity: tf.Tensor) -> tf.Tensor:
        """The keys plus tombstones an index of ``capacity`` slots holds before it grows."""
        return tf.cast(tf.cast(capacity, tf.float64) * self.t.max_load_factor, tf.int64)

    def place_entries(self, entries: tf.Tensor) -> None:
        """Place index ``entries`` ``[n, 2]`` (distinct keys, their rows) into an empty
        index: the rehash of a fixed-shape table into a bigger index variable."""
        self.place_from_home(*entry_columns(entries))
        self.t.num_deleted.assign(0)

    def reserve(
        self, incoming: tf.Tensor, batches_ahead: int = 0, compiled_rehash: bool = False
    ) -> None:
        """Rehash into a bigger index first when ``incoming`` new keys could overflow it.

        A growth also leaves room for ``batches_ahead`` more batches of ``incoming`` keys
        (at most :data:`AHEAD_MAX_KEYS` keys more): an insert that makes the table grow
        may well be followed by more like it (a table being filled), and every capacity
        a table meets costs a rehash and the compiles of its first probe rounds.
        ``compiled_rehash``: see :meth:`rehash`.
        """
        t = self.t
        capacity = variable_length(t.index)
        used = t.num_keys + t.num_deleted + incoming
        limit = self._load_limit(capacity)

        def grow() -> tf.Tensor:
            ahead = tf.minimum(incoming * batches_ahead, AHEAD_MAX_KEYS)
            target = t.num_keys + incoming + ahead
            new_capacity = tf.while_loop(
                lambda c: tf.cast(c, tf.float64) * t.max_load_factor < tf.cast(target, tf.float64),
                lambda c: [c * 2],  # a list, as the loop variables: eager loops need one
                [capacity],
            )[0]
            if compiled_rehash and tf.executing_eagerly():
                self._compile_race_at(new_capacity, incoming)
            self.rehash(new_capacity, compiled_rehash)
            return tf.constant(True)

        tf.cond(used > limit, grow, lambda: tf.constant(False))

    def _compile_race_at(self, capacity: tf.Tensor, incoming: tf.Tensor) -> None:
        """Start XLA's compile of the race at the ``capacity`` an eager growing insert of
        ``incoming`` keys grows the index to, before the rehash: the batch's race runs at
        that capacity, and its compile (some tenths of a second, in the background, see
        :mod:`._xla`) overlaps the rehash instead of starting after it. A batch too small
        for the race compiles nothing."""
        if int(incoming) >= COMPILED_MIN_KEYS:
            race = race_from[self.t.serial_scatter]
            _xla.prepare_at(race, self.t.index, int(capacity), *load_race_args())

    def rehash(self, capacity: tf.Tensor, compiled: bool = False) -> None:
        """Rebuild the index at ``capacity``, dropping tombstones; rows do not move.

        ``compiled``: the live keys are placed as a bulk load places them (:meth:`place`:
        the compiled race, chunk after chunk, then the loop for the keys left), not by the
        probe loop alone, which takes about twice as long a key. The inserts that grow a
        table being filled rehash millions of keys, each time at the capacity they insert
        at next (one XLA compile serves both). The race makes the kernels that hold it
        trace longer, so only growing inserts take it; a bulk load runs in a table its
        restore grew first.
        """
        t = self.t
        live = self.live_entries()
        replace(t.index, empty_index(capacity))
        t.num_deleted.assign(0)
        if compiled:
            self.place(*entry_columns(live))
        else:
            self.place_from_home(*entry_columns(live))

    def allocate_rows(self, count: tf.Tensor, grow: bool = True) -> tf.Tensor:
        """Take ``count`` row ids: freed rows first, then fresh ones (growing the store,
        unless ``grow`` is False: the caller checked that they fit)."""
        t = self.t
        reused = tf.minimum(count, t.num_free)
        top = t.num_free.read_value()
        from_free = tf.gather(t.free_rows, tf.range(top - reused, top))
        fresh_start = t.next_row.read_value()
        fresh = tf.range(fresh_start, fresh_start + count - reused)
        if grow:
            self._ensure_rows(fresh_start + count - reused)
        t.num_free.assign_sub(reused)
        t.next_row.assign_add(count - reused)
        return tf.concat([from_free, fresh], axis=0)

    def _ensure_rows(self, needed: tf.Tensor, headroom: bool = True) -> None:
        """Make the row store hold at least ``needed`` rows.

        The store grows by ``row_growth`` at least (times what is held, or, when
        ``headroom``, times what is needed if more: a batch bigger than the headroom then
        does not make the next one grow). Two ways to grow, by ``Config.reserve_rows``:

        - with ``reserve_rows`` (a table on a CPU), a store left unwritten (``Empty``)
          takes a copy of the rows in use only, and, with ``headroom``, holds rows for
          every key the index holds before it grows again (at most twice what is needed,
          or ``needed + AHEAD_MAX_KEYS`` if more): a table being filled copies its rows
          about once per growth of its index instead of once per ``row_growth``, and the
          pages of the rows it has not written are never touched, so they cost no
          resident memory;
        - otherwise (a table on a GPU, where a store costs its whole size in device
          memory, written or not) a gather builds a store ``row_growth`` times bigger,
          its rows past the old end copies of the last one.

        A row is written (or zeroed, by accum) whenever it is handed out, so what a store
        holds past its rows in use is never read. A store with no row handed out yet (an
        empty table grown for a restore) is left unwritten either way.
        """
        t = self.t

        def grow() -> tf.Tensor:
            have = variable_length(t.values)
            base = tf.cast(tf.maximum(needed, have) if headroom else have, tf.float64)
            bigger = tf.cast(tf.math.ceil(base * t.row_growth), tf.int64)
            length = tf.maximum(needed, bigger)
            # An unwritten store may hold rows for every key the index holds before it
            # grows (its growth left room for the batches that may follow, ``reserve``):
            # they cost no memory until written, and spare their copies.
            if headroom:
                held = self._load_limit(variable_length(t.index))
                ahead = tf.minimum(held, needed + tf.maximum(needed, AHEAD_MAX_KEYS))
                unwritten = tf.maximum(length, ahead)
            else:
                unwritten = length
            if t.reserve_rows:
                _unwritten_store(unwritten, t.next_row.read_value())
            else:
                tf.cond(
                    t.next_row > 0,
                    lambda: _gathered_store(length),
                    lambda: _unwritten_store(unwritten, None),
                )
            return tf.constant(True)

        def _gathered_store(length: tf.Tensor) -> tf.Tensor:
            # One gather builds the bigger store (a read plus a concat would allocate and
            # copy it twice more).
            source = tf.minimum(tf.range(length), variable_length(t.values) - 1)
            replace(t.values, tf.gather(t.values, source))
            replace(t.row_keys, tf.gather(t.row_keys, source))
            if t.track_changes:  # a row's stamp is written whenever the row is
                replace(t.stamps, tf.gather(t.stamps, source))
            return tf.constant(True)

        def _unwritten_store(length: tf.Tensor, used: tf.Tensor | None) -> tf.Tensor:
            rows = tf.cast(length, tf.int32)
            shape = tf.stack([rows, t.dim])

            def stamps() -> tf.Tensor:  # Empty has no GPU kernel for uint32: bitcast float32
                return tf.bitcast(tf.raw_ops.Empty(shape=rows[None], dtype=tf.float32), STAMP_DTYPE)

            _regrow(t.values, lambda: tf.raw_ops.Empty(shape=shape, dtype=t.values.dtype), used)
            _regrow(t.row_keys, lambda: tf.raw_ops.Empty(shape=rows[None], dtype=tf.int64), used)
            if t.track_changes:
                _regrow(t.stamps, stamps, used)
            return tf.constant(True)

        have = variable_length(t.values)
        tf.cond(needed > have, grow, lambda: tf.constant(False))

    def write_keys(self, keys: tf.Tensor, rows: tf.Tensor) -> None:
        """Record the key of each of ``rows`` in ``row_keys`` (written with the rows:
        repeated keys write the same key to the same row)."""
        self.t.row_keys.scatter_update(tf.IndexedSlices(keys, rows))

    def free(self, rows: tf.Tensor) -> None:
        """Push row ids on the free list (growing it when full)."""
        push(self.t.num_free, [(self.t.free_rows, rows)])


def _regrow(var: tf.Variable, unwritten: Callable[[], tf.Tensor], used: tf.Tensor | None) -> None:
    """Make the store ``unwritten()`` builds the store of ``var``, with a copy of the first
    ``used`` rows of the store it replaces (``None``: nothing to keep). The new store is
    built where it is assigned, so the variable is its only holder and the scatter into it
    copies no buffer."""
    if used is None:
        replace(var, unwritten())
        return
    old = read_shared(var)
    replace(var, unwritten())
    var.scatter_update(tf.IndexedSlices(old[:used], tf.range(used)))
