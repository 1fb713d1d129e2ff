"""The index of :class:`~de_store.tables.hash_table.HashTable`: slot encoding, hash,
capacities, and the XLA-compiled first probe rounds that lookups, inserts and bulk loads
start with (the probe loop is in :mod:`._probing`, the claim loop in :mod:`._claim_loop`).
"""

from __future__ import annotations

import functools
import math

import tensorflow as tf
from tensorflow.python.framework import cpp_shape_inference_pb2
from tensorflow.python.framework.ops import EagerTensor
from tensorflow.python.ops import resource_variable_ops

from de_store.tables._variables import variable_length

EMPTY = -1
DELETED = -2
MIN_CAPACITY = 16

# Python ints, made int64 constants where used: a module-level EagerTensor captured by a
# kernel cannot be used from a tf.compat.v1 graph.
_MIX1 = -49064778989728563  # 0xff51afd7ed558ccd as int64
_MIX2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53 as int64
_LOW31 = 0x7FFFFFFF
_LOW24 = 0xFFFFFF


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


def probe_step(keys: tf.Tensor) -> tf.Tensor:
    """The odd stride of each key's probe sequence (double hashing), below 2**24.

    An odd stride visits every slot of a power-of-two index. Keys of one home slot
    mostly step apart, so clusters do not grow into long runs as under linear probing,
    and the keys inserted last find their slot in fewer probes. Every probe round reads
    each key's slot in a pass of its own, so linear probing's neighbouring slots would save
    nothing there, while its longer runs would cost more rounds.
    """
    mixed = tf.bitwise.bitwise_and(tf.bitwise.right_shift(keys * _MIX2, 40), _LOW24)
    return tf.bitwise.bitwise_or(mixed, tf.constant(1, tf.int64))


def home_slots(keys: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """The slot where the probe of each key starts (``mask``: capacity - 1)."""
    return tf.bitwise.bitwise_and(hash_keys(keys), mask)


def next_slots(
    pos: tf.Tensor, keys: tf.Tensor, mask: tf.Tensor, step: tf.Tensor | None = None
) -> tf.Tensor:
    """The slot each key probes after ``pos``: every probe, compiled or in the graph loop,
    follows this one sequence. ``step``: the keys' :func:`probe_step`, when the caller
    made it once for several rounds."""
    return tf.bitwise.bitwise_and(pos + (probe_step(keys) if step is None else step), mask)


def hash_keys(keys: tf.Tensor) -> tf.Tensor:
    """A 64-bit finalizer (murmur3 fmix64) on int64 keys; shifts masked to be logical."""
    # Each constant made once: in a trace, every Python number an op takes is a node.
    shift, low31 = tf.constant(33, tf.int64), tf.constant(_LOW31, tf.int64)

    def fold(x: tf.Tensor) -> tf.Tensor:
        high = tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, shift), low31)
        return tf.bitwise.bitwise_xor(x, high)

    return fold(fold(fold(keys) * _MIX1) * _MIX2)


def positions(mask: tf.Tensor) -> tf.Tensor:
    """The positions where the 1-D ``mask`` is true, in order (int64).

    ``tf.where(mask)[:, 0]`` in fewer nodes: a traced kernel costs its trace about the same
    time for each node, and a strided slice is four (the slice and its three bounds)."""
    return tf.reshape(tf.where(mask), [-1])


def entry_columns(entries: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(keys, rows)``, the columns of index entries ``[n, 2]``: one node, where each
    ``entries[:, j]`` is four (see :func:`positions`). Eagerly, no strided slice either
    (see :func:`find_in`)."""
    keys, rows = tf.unstack(entries, num=2, axis=1)
    return keys, rows


def slot_rows(index: tf.Variable | tf.Tensor, slots: tf.Tensor) -> tf.Tensor:
    """The row column of the index entries at ``slots``."""
    return entry_columns(tf.gather(index, slots))[1]


def live_entries(entries: tf.Tensor) -> tf.Tensor:
    """The ``(key, row)`` entries ``[n, 2]`` of the occupied slots of index ``entries``
    (a row of 0 or more: neither empty nor a tombstone), in slot order."""
    return tf.gather(entries, positions(entry_columns(entries)[1] >= 0))


def find_in(index: tf.Tensor, keys: tf.Tensor) -> tf.Tensor:
    """The row of each key in ``index``, a tensor (a table's snapshot), ``EMPTY`` for a
    key it does not hold: the probe of a lookup, run eagerly round by round on the keys
    left (a snapshot is looked up once, in the background, so nothing is compiled).

    It runs no strided slice: TensorFlow 2.21's eager strided slices on a device other
    than the default one, run by two threads at once, may each be given the other's
    bounds, and this runs in a save's background thread beside the training thread's
    ops on the table's device. Columns are unstacked, the capacity is read from the shape.
    """
    mask = int(index.shape[0]) - 1
    left = tf.range(tf.size(keys, out_type=tf.int64))
    pos = home_slots(keys, mask)
    done_at, done_rows = [], []
    for _ in range(mask + 1):  # every slot, at most: an index always has empty ones
        if int(tf.size(left)) == 0:
            break
        held, rows = entry_columns(tf.gather(index, pos))
        hit = tf.logical_and(rows >= 0, tf.equal(held, keys))
        stop = tf.logical_or(hit, tf.equal(rows, EMPTY))
        done, keep = positions(stop), positions(tf.logical_not(stop))
        done_at.append(tf.cast(tf.gather(left, done), tf.int32))
        found = tf.gather(rows, done)
        done_rows.append(tf.where(tf.gather(hit, done), found, tf.constant(EMPTY, tf.int64)))
        left, keys = tf.gather(left, keep), tf.gather(keys, keep)
        pos = next_slots(tf.gather(pos, keep), keys, mask)
    if not done_at:
        return tf.zeros([0], tf.int64)
    return tf.dynamic_stitch(done_at, done_rows)


def handle_variable(handle: tf.Tensor, spec: tf.TensorSpec) -> tf.Variable:
    """A variable object over a resource handle given to a traced function.

    The handle's shape data is set first, so that ops reading it infer their shapes.
    """
    data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
    data.shape_and_type.add(shape=spec.shape.as_proto(), dtype=spec.dtype.as_datatype_enum)
    graph_mode = not isinstance(handle, EagerTensor)  # an eager handle keeps its own data
    resource_variable_ops._set_handle_shapes_and_types(handle, data, graph_mode=graph_mode)
    return resource_variable_ops.BaseResourceVariable(
        handle=handle, dtype=spec.dtype, shape=spec.shape, trainable=False, in_graph_mode=False
    )


def size_class(n: tf.Tensor) -> tf.Tensor:
    """``n > 0`` rounded up to a multiple of ``2 ** (floor(log2 n) - 2)``: at most 25% more,
    and only 4 to 8 sizes per power of two, so XLA compiles few shapes."""
    exponent = tf.math.floor(tf.math.log(tf.cast(n, tf.float64)) / math.log(2.0))
    step = tf.bitwise.left_shift(
        tf.constant(1, tf.int64), tf.maximum(tf.cast(exponent, tf.int64) - 2, 0)
    )
    return (n + step - 1) // step * step


def padded(n: tf.Tensor, *columns: tf.Tensor) -> list[tf.Tensor]:
    """Each int64 column of ``n`` values padded with zeros to the size class of ``n``: the
    compiled functions see few shapes."""
    padding = tf.zeros(tf.reshape(size_class(n) - n, [1]), tf.int64)
    return [tf.concat([x, padding], 0) for x in columns]


@tf.function(
    jit_compile=True,
    autograph=False,
    input_signature=[tf.TensorSpec([], tf.resource), tf.TensorSpec([None], tf.int64)],
)
def first_probes(index_handle: tf.Tensor, keys: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """:data:`COMPILED_ROUNDS` probe rounds over every key at once, as one XLA computation.

    Returns ``(rows, stop, next_pos)``: the row of each key found (``EMPTY`` for a key
    found missing or not resolved yet); the slot where a resolved key stopped, at its own
    key or at an empty slot, ``-1`` if unresolved; and the slot where the probe of an
    unresolved key goes on (``-1`` once resolved). XLA's fused gathers and selects
    run these rounds several times faster than the graph loop, which compacts the
    unresolved keys every round. How many keys two rounds leave depends on when they
    came: few of the keys inserted into an emptier table, many of those inserted last, and
    many missing keys. Two rounds: every round costs each key in it a gather, and more
    rounds cost the keys resolved early more than they save the late ones
    (``benchmarks/table_bench.py`` times lookups and inserts). XLA compiles once per index
    capacity and batch size class.
    """
    index = handle_variable(index_handle, tf.TensorSpec([None, 2], tf.int64))
    rows, stop, pos = _probe_rounds(index, keys)
    return rows, stop, tf.where(stop >= 0, tf.constant(-1, tf.int64), pos)


def _probe_rounds(
    index: tf.Variable,
    keys: tf.Tensor,
    start: tf.Tensor | None = None,
    rounds: int = COMPILED_ROUNDS,
) -> tuple[tf.Tensor, ...]:
    """``rounds`` probe rounds, as :func:`first_probes` runs them: ``(rows, stop, pos)``,
    ``pos`` where the probe of each key would go on. Probes start at ``start`` (at the
    home slot where it is negative, or where ``start`` is not given)."""
    mask = variable_length(index) - 1
    pos = home_slots(keys, mask)
    # Each constant and the keys' probe step made once, not once a round: a trace makes
    # a node of every Python number an op takes, and of every strided slice's bounds.
    zero, empty = tf.constant(0, tf.int64), tf.constant(EMPTY, tf.int64)
    if start is not None:
        pos = tf.where(start >= zero, start, pos)
    rows = tf.fill(tf.shape(keys), empty)
    stop = tf.fill(tf.shape(keys), tf.constant(-1, tf.int64))
    step = probe_step(keys)
    for _ in range(rounds):
        held, row = entry_columns(tf.gather(index, pos))
        hit = tf.logical_and(row >= zero, tf.equal(held, keys))
        now = tf.logical_and(stop < zero, tf.logical_or(hit, tf.equal(row, empty)))
        rows = tf.where(tf.logical_and(now, hit), row, rows)
        stop = tf.where(now, pos, stop)
        # A key resolved reads slot 0 in the rounds left, which stays in cache.
        pos = tf.where(stop >= zero, zero, next_slots(pos, keys, mask, step))
    return rows, stop, pos


def _race_from(
    index_handle: tf.Tensor,
    keys: tf.Tensor,
    tokens: tf.Tensor,
    count: tf.Tensor,
    start: tf.Tensor,
    *,
    serial: bool,
    compiled: bool = True,
    rounds: int = 0,
) -> tuple[tf.Tensor, ...]:
    """:data:`CHUNK_ROUNDS` probe rounds from ``start`` (from the home slot where it is
    negative), then one race of the first ``count`` keys that stopped at an empty slot for
    it, with ``(key, token)`` entries, all in one XLA computation.

    Returns ``(rows, slots, start, counts)``: the row of each key found (a claim token:
    a repeat of a winner), the token of each winner, ``EMPTY`` for the others; the slot
    of each key found or winner, else ``-1``; ``start``, the slot where the probe of each
    key left goes on (unresolved, or a loser of the race, which looks at its slot again:
    the winner may be a duplicate of it; ``-1`` for the keys found and the winners); and
    ``counts``, how many of the first ``count`` keys won and were found. The writes of the keys
    that take no part go out of bounds, which XLA's scatter skips. Unless ``serial``
    (one writer after another, as on a CPU), the winners write their entries once more:
    a parallel scatter may mix the columns of two writers. Not ``compiled`` (the same
    rounds as TensorFlow ops, :data:`plain`), only the writers' entries are scattered:
    TensorFlow's scatter refuses an index out of bounds. ``rounds``: the probe rounds
    before the race, :data:`CHUNK_ROUNDS` unless given.
    """
    index = handle_variable(index_handle, tf.TensorSpec([None, 2], tf.int64))
    rows, stop, pos = _probe_rounds(index, keys, start, rounds or CHUNK_ROUNDS)
    capacity = variable_length(index)
    zero, none = tf.constant(0, tf.int64), tf.constant(-1, tf.int64)  # made once (see above)
    real = tf.range(tf.size(keys, out_type=tf.int64)) < count
    stopped = stop >= zero
    claim = tf.logical_and(real, tf.logical_and(stopped, rows < zero))
    entries = tf.stack([keys, tokens], 1)

    def write(writers: tf.Tensor) -> None:
        if compiled:
            index.scatter_update(tf.IndexedSlices(entries, tf.where(writers, stop, capacity)))
        else:
            at = positions(writers)
            index.scatter_update(tf.IndexedSlices(tf.gather(entries, at), tf.gather(stop, at)))

    write(claim)
    seen = slot_rows(index, tf.where(claim, stop, zero))
    won = tf.logical_and(claim, tf.equal(seen, tokens))
    if not serial:
        write(won)
    found = tf.logical_and(real, rows >= zero)
    resolved = tf.logical_or(tf.logical_or(found, won), tf.logical_not(real))
    start = tf.where(resolved, none, tf.where(stopped, stop, pos))
    counts = tf.stack([tf.reduce_sum(tf.cast(x, tf.int64)) for x in (won, found)])
    slots = tf.where(tf.logical_or(found, won), stop, none)
    return tf.where(won, tokens, rows), slots, start, counts


#: Keys per call of :data:`race_from`: one XLA shape per index capacity. Chunks of 16K
#: to 32K keys did best for the 300K keys the last batch of 10M leaves (64K and 128K
#: waste more on the padding of the last chunk, which every round of the loop pays).
CHUNK = 1 << 15
#: Probe rounds of :data:`race_from` before its race: the keys it gets have probed
#: already, so more of them meet full slots.
CHUNK_ROUNDS = 3
#: :func:`_race_from` from given slots (a negative one: the home slot), compiled for
#: chunks of :data:`CHUNK` keys, by ``serial``: a big insert or bulk load races its keys
#: in chunks, first from their home slots, then the keys left, round after round; one XLA
#: shape per index capacity serves them all, whatever the batch's size. In TF ops,
#: each round of that loop cost about 130 ns per key (a gather of the index alone 24 ns,
#: against 11 ns in XLA); the compiled race, about 50 ns.
race_from = {
    serial: tf.function(
        functools.partial(_race_from, serial=serial),
        jit_compile=True,
        autograph=False,
        input_signature=[
            tf.TensorSpec([], tf.resource),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([], tf.int64),
            tf.TensorSpec([None], tf.int64),
        ],
    )
    for serial in (True, False)
}


def load_race_args() -> tuple[tf.Tensor, ...]:
    """Arguments of :data:`race_from` with no key taking part (``count`` 0): what a call
    that only makes XLA compile its shape passes."""
    chunk = tf.zeros([CHUNK], tf.int64)
    return chunk, chunk, tf.constant(0, tf.int64), chunk


#: The Python functions of the compiled rounds, run as TensorFlow ops: what an eager bulk
#: call runs while XLA compiles its shape (:mod:`._xla`). The plain race probes one round
#: before it races: each round is a pass of its own over every key of the batch, most of
#: which stop at the first slot they probe (the keys left go on in the claim loop).
plain = {
    first_probes: first_probes.python_function,
    **{
        race[serial]: functools.partial(_race_from, serial=serial, compiled=False, rounds=1)
        for race in (race_from,)
        for serial in (True, False)
    },
}


def empty_index(capacity: tf.Tensor) -> tf.Tensor:
    """An index of ``capacity`` empty slots (every column ``EMPTY``)."""
    return tf.fill(tf.stack([capacity, tf.constant(2, tf.int64)]), tf.constant(EMPTY, tf.int64))
