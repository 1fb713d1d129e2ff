"""The graph kernels of :class:`~de_store.tables.hash_table.HashTable`.

Every function here builds TensorFlow ops only (no Python control flow on tensor values),
so it traces inside ``tf.function`` and runs on whatever device the table lives on.
:class:`Kernels` holds the compiled functions of one :class:`Config`, shared by its tables;
:class:`TableOps` builds the ops of one operation over one table's variables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.python.framework import cpp_shape_inference_pb2
from tensorflow.python.ops import resource_variable_ops

from de_store.tables._tracking import STAMP_DTYPE, TrackingOps, push, variable_length
from de_store.tables._tracking import count as _count

EMPTY = -1
DELETED = -2
# Tokens of the last-occurrence race sit above every real row id. (The claims of an insert
# use ``next_row + i``, also above every row held.)
TOKEN_BASE = 1 << 40
MIN_CAPACITY = 16

_MIX1 = tf.constant(-49064778989728563, tf.int64)  # 0xff51afd7ed558ccd as int64
_MIX2 = tf.constant(-4265267296055464877, tf.int64)  # 0xc4ceb9fe1a85ec53 as int64
_LOW31 = tf.constant(0x7FFFFFFF, tf.int64)


#: Probe rounds that :func:`first_probes` runs over every key of a batch.
COMPILED_ROUNDS = 2
#: Smaller batches probe in the graph loop only: no XLA compilation for their sizes.
COMPILED_MIN_KEYS = 1 << 14


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


class _Race(NamedTuple):
    """One race for the empty slots where :func:`first_probes` stopped.

    ``found``, ``stop``: as :func:`first_probes` returns them; ``at``: the positions of the
    keys that raced, ``slots`` their slots, ``won`` which of them won; ``left``: the
    positions of the keys to probe on (unresolved, or lost), ``start`` where.
    """

    found: tf.Tensor
    stop: tf.Tensor
    at: tf.Tensor
    slots: tf.Tensor
    won: tf.Tensor
    left: tf.Tensor
    start: tf.Tensor


class _View:
    """One table as the kernels see it: its config fields and its variables."""

    def __init__(self, config: Config, state: State) -> None:
        self.__dict__.update(dataclasses.asdict(config))
        self.__dict__.update(state._asdict())
        self.state = state

    def __getattr__(self, name: str) -> tf.Variable:  # for mypy: attributes set above
        raise AttributeError(name)


class Kernels:
    """The ``tf.function`` s of every table of one :class:`Config`, variables passed in.

    A function is traced once per config, not once per table: tests and models create many
    small tables of a few configs. Kernels do not call each other as functions: a nested
    ``tf.function`` given variables would bind the first caller's variables.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        names = ["lookup", "insert", "load_distinct", "accum_insert", "accum_existing", "remove"]
        names += ["clear", "prepare", "export_all", "export_changes", "forget_removed"]
        for name in names:
            setattr(self, name, self._function(name))

    def run(self, name: str, state: State, *args: tf.Tensor) -> Any:
        """Run kernel ``name``: the shared function when eager, inlined inside a trace.

        Inside a caller's ``tf.function`` the ops go into the caller's graph: a shared
        function called there with variables could bind the variables of that trace.
        """
        if tf.executing_eagerly():
            return getattr(self, name)(tuple(v.handle for v in state), *args)
        return getattr(TableOps(_View(self.config, state), self), name)(*args)

    def _function(self, name: str) -> tf.types.experimental.PolymorphicFunction:
        # The variables come in as resource handles (plain tensor inputs, so one trace
        # serves every table); a function given variables would capture the first ones.
        def kernel(handles: tuple[tf.Tensor, ...], *args: tf.Tensor) -> object:
            state = State(*map(_handle_variable, handles, self._variable_specs()))
            return getattr(TableOps(_View(self.config, state), self), name)(*args)

        kernel.__name__ = name
        keys = tf.TensorSpec([None], tf.int64)
        rows = tf.TensorSpec([None, self.config.dim], self.config.dtype)
        count = tf.TensorSpec([], tf.int64)
        args = {
            "lookup": [keys],
            "remove": [keys],
            "clear": [],
            "export_all": [],
            "prepare": [count],
            "export_changes": [count],
            "forget_removed": [count],
        }
        handles = tuple(tf.TensorSpec([], tf.resource) for _ in State._fields)
        signature = [handles, *args.get(name, [keys, rows])]
        return tf.function(kernel, autograph=False, input_signature=signature)

    def _variable_specs(self) -> list[tf.TensorSpec]:
        rows = tf.TensorSpec([None, self.config.dim], self.config.dtype)
        counter = tf.TensorSpec([], tf.int64)
        ids = tf.TensorSpec([None], tf.int64)
        stamps = tf.TensorSpec([None], STAMP_DTYPE)
        index = tf.TensorSpec([None, 2], tf.int64)
        return [index, rows, ids, *[counter] * 4, stamps, counter, ids, ids, counter]


def _handle_variable(handle: tf.Tensor, spec: tf.TensorSpec) -> tf.Variable:
    """A variable object over a resource handle given to a traced function.

    The handle's shape data is set first, so that ops reading it infer their shapes.
    """
    data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
    data.shape_and_type.add(shape=spec.shape.as_proto(), dtype=spec.dtype.as_datatype_enum)
    resource_variable_ops._set_handle_shapes_and_types(handle, data, graph_mode=True)
    return resource_variable_ops.BaseResourceVariable(
        handle=handle, dtype=spec.dtype, shape=spec.shape, trainable=False, in_graph_mode=False
    )


@functools.cache
def kernels_for(config: Config) -> Kernels:
    """The shared kernels of ``config``."""
    return Kernels(config)


class TableOps(TrackingOps):
    """Graph operations over one table's variables (built while tracing a kernel)."""

    def __init__(self, table: _View, kernels: Kernels) -> None:
        self.t = table
        self.kernels = kernels

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
        padded = tf.concat([keys, tf.zeros(tf.reshape(size_class(n) - n, [1]), tf.int64)], 0)
        return tuple(x[:n] for x in first_probes(self.t.index.handle, padded))

    def find_or_claim(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``probe`` claiming empty slots, key ``i`` with the token ``base + i``; big
        batches start with :func:`first_probes`."""
        return tf.cond(
            _count(keys) >= COMPILED_MIN_KEYS,
            lambda: self._claim_compiled(keys, base),
            lambda: self.probe(keys, True, tokens=base),
        )

    def _claim_compiled(self, keys: tf.Tensor, base: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """:meth:`_first_race` with the tokens ``base + i``, then the probe loop for the
        keys left (a loser looks at its slot again: the winner may be a duplicate of it)."""
        race = self._first_race(keys, lambda at: at + base)
        left = race.left
        got = tf.cond(  # (slot, row) of each key left
            _count(left) > 0,
            lambda: tf.stack(self.probe(tf.gather(keys, left), True, race.start, left + base), 1),
            lambda: tf.zeros([0, 2], tf.int64),
        )
        won_at = tf.where(race.won)[:, 0]
        winners = tf.gather(race.at, won_at)
        result = tf.dynamic_stitch(
            [tf.cast(x, tf.int32) for x in (tf.range(_count(keys)), winners, left)],
            [
                tf.stack([tf.where(race.found >= 0, race.stop, -1), race.found], 1),
                tf.stack([tf.gather(race.slots, won_at), winners + base], 1),
                got,
            ],
        )
        return result[:, 0], result[:, 1]

    def _first_race(self, keys: tf.Tensor, tokens: Any) -> _Race:
        """:func:`first_probes`, then one race of the keys that stopped at an empty slot
        for it; ``tokens(at)`` gives the tokens of the keys at positions ``at``."""
        found, stop, next_pos = self._first_probes(keys)
        at = tf.where(tf.logical_and(stop >= 0, found < 0))[:, 0]
        slots = tf.gather(stop, at)
        won = self._claim(tokens(at), tf.gather(keys, at), slots, None)
        lost = tf.where(tf.logical_not(won))[:, 0]
        unresolved = tf.where(next_pos >= 0)[:, 0]
        left = tf.concat([unresolved, tf.gather(at, lost)], 0)
        start = tf.concat([tf.gather(next_pos, unresolved), tf.gather(slots, lost)], 0)
        return _Race(found, stop, at, slots, won, left, start)

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

        found = tf.TensorArray(
            tf.int64, size=0, dynamic_size=True, infer_shape=False, element_shape=[None]
        )
        found_at = tf.TensorArray(
            tf.int64, size=0, dynamic_size=True, infer_shape=False, element_shape=[None, 2]
        )

        def body(step, idx, ks, pos, found, found_at):
            entry = tf.gather(t.index, pos)
            rows = entry[:, 1]
            hit = tf.logical_and(rows >= 0, tf.equal(entry[:, 0], ks))
            empty = tf.equal(rows, EMPTY)
            if claim:
                done = tf.logical_or(hit, self._claim(token(idx), ks, pos, empty))
                # A loser of a race stays: the winner may be a duplicate of it.
                next_pos = tf.where(empty, pos, tf.bitwise.bitwise_and(pos + 1, mask))
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
                kept[2] = tf.bitwise.bitwise_and(kept[2] + 1, mask)
            return (step + 1, *kept, found, found_at)

        loop = tf.while_loop(
            lambda step, idx, *_: _count(idx) > 0,
            body,
            (
                tf.constant(0, tf.int32),
                tf.range(_count(keys)),
                keys,
                tf.bitwise.bitwise_and(hash_keys(keys), mask) if start is None else start,
                found,
                found_at,
            ),
            shape_invariants=(
                tf.TensorShape([]),
                *[tf.TensorShape([None])] * 3,
                *[tf.TensorShape(None)] * 2,
            ),
        )
        # Put the per-round results back in batch order (``order`` is a permutation).
        order = tf.cast(loop[4].concat(), tf.int32)
        result = tf.dynamic_stitch([order], [loop[5].concat()])
        return result[:, 0], result[:, 1]

    def _claim(
        self, tokens: tf.Tensor, keys: tf.Tensor, pos: tf.Tensor, empty: tf.Tensor | None
    ) -> tf.Tensor:
        """Race for empty slots with ``(key, token)`` entries; return which keys won theirs.

        Any one writer of a contested slot may win, and a GPU scatter may even mix the
        columns of two writers, so there the winner (by token) writes its entry once more.
        """
        t = self.t
        written = self._write_entries(keys, tokens, pos, empty)
        with tf.control_dependencies(written):
            won = tf.equal(tf.gather(t.index, pos)[:, 1], tokens)
            won = won if empty is None else tf.logical_and(empty, won)
        if not t.serial_scatter:
            written = self._write_entries(keys, tokens, pos, won)
        # The next probe round must see the written keys: make its inputs wait for them.
        with tf.control_dependencies(written):
            return tf.identity(won)

    def _write_entries(
        self, keys: tf.Tensor, rows: tf.Tensor, slots: tf.Tensor, where: tf.Tensor | None
    ) -> list[tf.Operation]:
        """Scatter the entries ``(key, row)`` marked by ``where`` into their slots; return
        the write (for control dependencies; none when eager)."""
        if where is None:
            entries = tf.stack([keys, rows], 1)
        else:
            at = tf.where(where)[:, 0]
            entries, slots = _entries(keys, rows, at), tf.gather(slots, at)
        written = self.t.index.scatter_update(tf.IndexedSlices(entries, slots))
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
        with :func:`first_probes`, like big inserts (a rehash does not: in its empty index
        every key stops at its first slot, which the loop's first round reads as well).
        """
        return tf.cond(
            _count(keys) >= COMPILED_MIN_KEYS,
            lambda: self._place_compiled(keys, rows),
            lambda: self._place_loop(keys, rows, self._home(keys)),
        )

    def _home(self, keys: tf.Tensor) -> tf.Tensor:
        """The slot where the probe of each key starts."""
        return tf.bitwise.bitwise_and(hash_keys(keys), variable_length(self.t.index) - 1)

    def _place_compiled(self, keys: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """:meth:`_first_race` with the rows as tokens, then the loop for the keys left."""
        race = self._first_race(keys, lambda at: tf.gather(rows, at))
        left = race.left
        present = tf.reduce_sum(tf.cast(race.found >= 0, tf.int64))
        return present + tf.cond(
            _count(left) > 0,
            lambda: self._place_loop(tf.gather(keys, left), tf.gather(rows, left), race.start),
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
            pos = tf.bitwise.bitwise_and(tf.gather(pos, keep) + 1, mask)
            repeated += _count(lost) - _count(keep)
            return tf.gather(ks, keep), tf.gather(rs, keep), pos, repeated

        loop = tf.while_loop(
            lambda ks, *_: _count(ks) > 0,
            body,
            (keys, rows, start, tf.constant(0, tf.int64)),
            shape_invariants=(*(tf.TensorShape([None]),) * 3, tf.TensorShape([])),
        )
        return loop[3]

    # -- capacity ----------------------------------------------------------------------
    def prepare(self, count: tf.Tensor) -> None:
        """Grow the index and the row store once for ``count`` more keys (a bulk load)."""
        self.reserve(count)
        self._ensure_rows(self.t.next_row + tf.maximum(count - self.t.num_free, 0), False)

    def reserve(self, incoming: tf.Tensor) -> None:
        """Rehash into a bigger index first when ``incoming`` new keys could overflow it."""
        t = self.t
        capacity = variable_length(t.index)
        used = t.num_keys + t.num_deleted + incoming
        limit = tf.cast(tf.cast(capacity, tf.float64) * t.max_load_factor, tf.int64)

        def grow() -> tf.Tensor:
            target = t.num_keys + incoming
            new_capacity = tf.while_loop(
                lambda c: tf.cast(c, tf.float64) * t.max_load_factor < tf.cast(target, tf.float64),
                lambda c: c * 2,
                [capacity],
            )[0]
            self.rehash(new_capacity)
            return tf.constant(True)

        tf.cond(used > limit, grow, lambda: tf.constant(False))

    def rehash(self, capacity: tf.Tensor) -> None:
        """Rebuild the index at ``capacity``, dropping tombstones; rows do not move."""
        t = self.t
        live = self.live_entries()
        t.index.assign(empty_index(capacity))
        t.num_deleted.assign(0)
        self._place_loop(live[:, 0], live[:, 1], self._home(live[:, 0]))

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

    def _ensure_rows(self, needed: tf.Tensor, headroom: bool = True) -> None:
        t = self.t

        def grow() -> tf.Tensor:
            have = variable_length(t.values)
            # ``row_growth`` times what is held, or, when ``headroom``, times what is needed
            # if more: a batch bigger than the headroom then does not make the next one grow.
            base = tf.cast(tf.maximum(needed, have) if headroom else have, tf.float64)
            bigger = tf.cast(tf.math.ceil(base * t.row_growth), tf.int64)
            # One gather builds the bigger store (a read plus a concat would allocate and
            # copy it twice more). Rows past the old end repeat its last row: a row is
            # written (or zeroed, by accum) whenever it is handed out.
            source = tf.minimum(tf.range(tf.maximum(needed, bigger)), have - 1)
            t.values.assign(tf.gather(t.values, source))
            if t.track_changes:  # a row's stamp is written whenever the row is
                t.stamps.assign(tf.gather(t.stamps, source))
            return tf.constant(True)

        have = variable_length(t.values)
        tf.cond(needed > have, grow, lambda: tf.constant(False))

    def free(self, rows: tf.Tensor) -> None:
        """Push row ids on the free list (growing it when full)."""
        push(self.t.num_free, [(self.t.free_rows, rows)])

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

        Returns ``(rows, fresh, last)``: ``fresh`` marks the keys that were new, ``last``
        (when ``pick_last``, else ``None``) the last occurrence of each key.
        """
        t = self.t
        n = _count(keys)
        self.reserve(n)
        # Key ``i`` claims with the token ``base + i``, the row it gets when every key of the
        # batch is new and no freed row waits: the claims then wrote the final entries.
        # (Rows held now are below ``base``.)
        base = t.next_row.read_value()
        slots, rows = self.find_or_claim(keys, base)
        fresh = tf.equal(rows, tf.range(n) + base)
        num_fresh = tf.reduce_sum(tf.cast(fresh, tf.int64))
        all_new = tf.equal(num_fresh, n)
        final = tf.logical_and(all_new, tf.equal(t.num_free, 0))
        fresh_rows = self.allocate_rows(num_fresh)
        t.num_keys.assign_add(num_fresh)
        at = tf.where(fresh)[:, 0]

        def enter_rows() -> tf.Tensor:
            entries = tf.stack([tf.gather(keys, at), fresh_rows], 1)
            t.index.scatter_update(tf.IndexedSlices(entries, tf.gather(slots, at)))
            return tf.constant(True)

        tf.cond(final, lambda: tf.constant(False), enter_rows)
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
            lambda: tf.cond(  # every key new (a batch of new ids): the fresh rows in order
                all_new,
                lambda: fresh_rows,
                lambda: tf.tensor_scatter_nd_update(rows_found, at[:, None], fresh_rows),
            ),
            lambda: tf.where(
                claimed, tf.gather(tf.concat([fresh_rows, [EMPTY]], 0), numbered()), rows_found
            ),
        )
        if not pick_last:
            return rows, fresh, None
        last = tf.cond(
            tf.logical_and(distinct, tf.reduce_all(claimed)),
            lambda: tf.ones(tf.reshape(n, [1]), tf.bool),
            lambda: self._last_of_each(keys, slots, rows, claimed, numbered(), num_fresh),
        )
        return rows, fresh, last

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
        self.stamp(rows)
        t.num_keys.assign_add(n)
        return self.place(keys, rows)

    def accum_insert(self, keys: tf.Tensor, deltas: tf.Tensor) -> None:
        """Add deltas, inserting missing keys at zero first."""
        t = self.t
        rows, fresh, _ = self._resolve(keys, pick_last=False)
        new_rows = tf.boolean_mask(rows, fresh)
        t.values.scatter_update(
            tf.IndexedSlices(
                tf.zeros(tf.stack([_count(new_rows), t.dim]), t.values.dtype), new_rows
            )
        )
        t.values.scatter_add(tf.IndexedSlices(deltas, rows))
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
        self.free(rows)
        t.num_keys.assign_sub(_count(rows))
        t.num_deleted.assign_add(_count(rows))
        if t.track_changes:
            self.log_removed(keys)

    def clear(self) -> None:
        """Empty the table: the index and the row store go back to their initial sizes.

        A buffer already at its initial size is kept, not allocated anew (new memory is
        slow to touch, and a restore clears a fresh table first): rows are written when
        they are handed out, and an index without keys or tombstones is all empty.
        """
        t = self.t
        capacity = tf.constant(t.init_capacity, tf.int64)
        used = tf.logical_or(t.num_keys + t.num_deleted > 0, variable_length(t.index) != capacity)

        def empty() -> tf.Tensor:
            t.index.assign(empty_index(capacity))
            return tf.constant(True)

        tf.cond(used, empty, lambda: tf.constant(False))
        rows = tf.constant(t.init_rows, tf.int64)

        def shrink() -> tf.Tensor:
            t.values.assign(tf.zeros(tf.stack([rows, t.dim]), t.values.dtype))
            if t.track_changes:  # stamps are as long as the row store
                # Fill has no GPU kernel for uint32 (nor int32): cast int64 zeros
                zeros = tf.zeros(tf.reshape(rows, [1]), tf.int64)
                t.stamps.assign(tf.cast(zeros, STAMP_DTYPE))
            return tf.constant(True)

        tf.cond(variable_length(t.values) != rows, shrink, lambda: tf.constant(False))
        t.free_rows.assign(tf.zeros([16], tf.int64))
        for counter in (t.num_keys, t.num_deleted, t.num_free, t.next_row, t.num_removed):
            counter.assign(0)
        if t.track_changes:  # the epoch goes on: a cleared table has no history
            t.removed.assign(tf.zeros([16], tf.int64))
            t.removed_at.assign(tf.zeros([16], tf.int64))

    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """``(keys, values)`` of every live slot, read in one pass."""
        t = self.t
        live = self.live_entries()
        return live[:, 0], tf.gather(t.values, live[:, 1])

    def live_entries(self) -> tf.Tensor:
        """The ``(key, row)`` entries of every occupied slot, ``[n, 2]``, in one read."""
        entries = self.t.index.read_value()
        return tf.gather(entries, tf.where(entries[:, 1] >= 0)[:, 0])


def size_class(n: tf.Tensor) -> tf.Tensor:
    """``n > 0`` rounded up to a multiple of ``2 ** (floor(log2 n) - 2)``: at most 25% more,
    and only 4 to 8 sizes per power of two, so XLA compiles few shapes."""
    exponent = tf.math.floor(tf.math.log(tf.cast(n, tf.float64)) / math.log(2.0))
    step = tf.bitwise.left_shift(
        tf.constant(1, tf.int64), tf.maximum(tf.cast(exponent, tf.int64) - 2, 0)
    )
    return (n + step - 1) // step * step


@tf.function(
    jit_compile=True,
    autograph=False,
    input_signature=[tf.TensorSpec([], tf.resource), tf.TensorSpec([None], tf.int64)],
)
def first_probes(index_handle: tf.Tensor, keys: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """:data:`COMPILED_ROUNDS` probe rounds over every key at once, as one XLA computation.

    Returns ``(rows, stop, next_pos)``: the row of each key found (``EMPTY`` for a key
    found missing or not resolved yet); the slot where a resolved key stopped, at its own
    key or at an empty slot (the one an insert claims), ``-1`` if unresolved; and the slot
    where the probe of an unresolved key goes on (``-1`` once resolved). Lookups and
    inserts share these compiled rounds. XLA's fused gathers and selects
    run these rounds several times faster than the graph loop, which compacts the
    unresolved keys every round. How many keys two rounds leave depends on when they
    came: at a final load of 0.6 (10M keys inserted in batches of 1M), 0.2% of the first
    batch's keys but 37% of the last's, which sit at the ends of clusters (14.5% of all
    present keys; missing keys, which probe to the end of their cluster, about 40%).
    Every round costs about 10 ms per 1M keys; more rounds cost the early keys more than
    they save the late ones, measured up to six (also with the rounds' reads fused into
    one pass); for inserts, three rounds did as well as two, four and six worse. XLA
    compiles once per index capacity and batch size class.
    """
    index = _handle_variable(index_handle, tf.TensorSpec([None, 2], tf.int64))
    mask = variable_length(index) - 1
    pos = tf.bitwise.bitwise_and(hash_keys(keys), mask)
    rows = tf.fill(tf.shape(keys), tf.constant(EMPTY, tf.int64))
    stop = tf.fill(tf.shape(keys), tf.constant(-1, tf.int64))
    for _ in range(COMPILED_ROUNDS):
        entry = tf.gather(index, pos)
        hit = tf.logical_and(entry[:, 1] >= 0, tf.equal(entry[:, 0], keys))
        now = tf.logical_and(stop < 0, tf.logical_or(hit, tf.equal(entry[:, 1], EMPTY)))
        rows = tf.where(tf.logical_and(now, hit), entry[:, 1], rows)
        stop = tf.where(now, pos, stop)
        pos = tf.bitwise.bitwise_and(pos + 1, mask)
    return rows, stop, tf.where(stop >= 0, tf.constant(-1, tf.int64), pos)


def empty_index(capacity: tf.Tensor) -> tf.Tensor:
    """An index of ``capacity`` empty slots (every column ``EMPTY``)."""
    return tf.fill(tf.stack([capacity, tf.constant(2, tf.int64)]), tf.constant(EMPTY, tf.int64))


def _entries(keys: tf.Tensor, rows: tf.Tensor, at: tf.Tensor) -> tf.Tensor:
    """Index entries ``[m, 2]`` (key, row) of the keys at positions ``at``."""
    return tf.stack([tf.gather(keys, at), tf.gather(rows, at)], axis=1)
