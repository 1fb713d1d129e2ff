"""The claim loop of big inserts: the keys the compiled first probe rounds left race on for
empty slots, round after round, each round compiled (:data:`~._index.race_from`) over
chunks of keys; and :func:`probe_rounds`, the loop of rounds it and the graph probe of
:class:`~de_store.tables._probing.ProbeOps` run."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from de_store.tables import _xla
from de_store.tables._index import (
    CHUNK,
    entry_columns,
    load_race_args,
    plain,
    positions,
    race_from,
)
from de_store.tables._types import View
from de_store.tables._variables import count as _count

#: Keys from which an eager race waits for its shape's compile rather than run its plain
#: rounds meanwhile (:func:`_race_chunks_eagerly`): about as long as a compile would take
#: the rest of its way on the development machine (plain rounds about 0.37 us a key, a
#: compile about 0.3 s), and the plain rounds slow that compile down.
WAIT_MIN_KEYS = 1 << 19


def probe_rounds(body: Any, columns: list[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """Run ``body`` round after round until every key is resolved; ``(slots, rows)`` of
    each key, in batch order.

    ``columns`` are what the rounds carry per key (keys first). ``body(step, idx, *columns,
    found, found_at)`` writes, at ``step``, the batch positions (from ``idx``) of the keys
    it resolved to ``found`` and their ``(slot, row)`` to ``found_at``, and returns the
    arguments of the next round, for the keys left.
    """
    if tf.executing_eagerly() and int(_count(columns[0])) == 0:  # an eager array of none
        none = tf.zeros([0], tf.int64)  # cannot concat
        return none, none
    found, found_at = (
        tf.TensorArray(tf.int64, size=0, dynamic_size=True, infer_shape=False, element_shape=shape)
        for shape in ([None], [None, 2])
    )
    loop = tf.while_loop(
        lambda step, idx, *_: _count(idx) > 0,
        body,
        (tf.constant(0, tf.int32), tf.range(_count(columns[0])), *columns, found, found_at),
        shape_invariants=(
            tf.TensorShape([]),
            *[tf.TensorShape([None])] * (1 + len(columns)),
            *[tf.TensorShape(None)] * 2,
        ),
    )
    # The positions found form a permutation of the batch.
    order = tf.cast(loop[-2].concat(), tf.int32)
    result = tf.dynamic_stitch([order], [loop[-1].concat()])
    return entry_columns(result)


def race_chunks(
    t: View, keys: tf.Tensor, tokens: tf.Tensor, start: tf.Tensor
) -> tuple[tf.Tensor, ...]:
    """:data:`~._index.race_from` over every key, chunk after chunk of
    :data:`~._index.CHUNK` keys (the last one padded): ``(rows, slots, start,
    counts)`` as :func:`~._index._race_from` gives them, for keys probing from
    ``start``."""
    if tf.executing_eagerly():
        return _race_chunks_eagerly(t, keys, tokens, start)
    # Each column padded to whole chunks and seen as rows of a chunk, which the loop
    # gathers: a strided slice of tensor bounds is several nodes, and a kernel's trace
    # costs about the same time for each node.
    n = _count(keys)
    chunk = tf.constant(CHUNK, tf.int64)
    chunks = tf.cast((n + chunk - 1) // chunk, tf.int32)
    pad = tf.zeros(tf.reshape(tf.cast(chunks, tf.int64) * chunk - n, [1]), tf.int64)
    by_chunk = [tf.reshape(tf.concat([x, pad], 0), [-1, CHUNK]) for x in (keys, tokens, start)]
    race = race_from[t.serial_scatter]
    outs = [tf.TensorArray(tf.int64, size=chunks, element_shape=[CHUNK]) for _ in range(3)]

    def body(j: tf.Tensor, counts: tf.Tensor, *outs: tf.TensorArray) -> tuple[Any, ...]:
        ks, tk, st = (tf.gather(x, j) for x in by_chunk)
        left = tf.minimum(n - tf.cast(j, tf.int64) * chunk, chunk)
        *got, more = _xla.call(race, t.index, ks, tk, left, st)
        written = (out.write(j, x) for out, x in zip(outs, got, strict=True))
        return (j + 1, counts + more, *written)

    # One chunk after the other: each race reads the slots the ones before claimed.
    loop = tf.while_loop(
        lambda j, *_: j < chunks,
        body,
        (tf.constant(0), tf.zeros([2], tf.int64), *outs),
        parallel_iterations=1,
    )
    first = tf.zeros([1], tf.int64), tf.reshape(n, [1])
    return (*(tf.slice(out.concat(), *first) for out in loop[2:]), loop[1])


def race_waits(t: View, n: int) -> bool:
    """Whether an eager race of ``n`` keys in table ``t`` as it is now would wait for its
    compile (:func:`_race_chunks_eagerly`): :data:`WAIT_MIN_KEYS` keys or more, and
    :func:`~._xla.waits`."""
    race = race_from[t.serial_scatter]
    return n >= WAIT_MIN_KEYS and _xla.waits(race, t.index, *load_race_args())


def _race_chunks_eagerly(
    t: View, keys: tf.Tensor, tokens: tf.Tensor, start: tf.Tensor
) -> tuple[tf.Tensor, ...]:
    """:func:`race_chunks` run eagerly (an op-by-op bulk call). Compiled, the chunks are
    cut from the padded columns by one op each, so that a chunk costs one call where the
    graph's loop body is a few dozen Python-dispatched ops. While this process has not
    compiled the shape, the plain race runs once over the whole batch (with one probe
    round, see :data:`~._index.plain`): chunk by chunk, Python would dispatch its few
    dozen ops for every 32K keys. A batch of :data:`WAIT_MIN_KEYS` or more waits for
    the compile instead, where it can (see :func:`~._xla.runner`)."""
    n = int(keys.shape[0])
    race = race_from[t.serial_scatter]
    compiled = _xla.runner(race, t.index, *load_race_args(), wait=n >= WAIT_MIN_KEYS)
    if compiled is None:
        return plain[race](t.index.handle, keys, tokens, tf.constant(n, tf.int64), start)
    chunks = -(-n // CHUNK)
    pad = tf.zeros([chunks * CHUNK - n], tf.int64)
    columns = [
        tf.unstack(tf.reshape(tf.concat([x, pad], 0), [chunks, CHUNK]))
        for x in (keys, tokens, start)
    ]
    outs: list[list[tf.Tensor]] = [[], [], []]
    counts = []
    for j in range(chunks):
        count = tf.constant(min(CHUNK, n - j * CHUNK), tf.int64)
        *got, more = compiled(t.index.handle, columns[0][j], columns[1][j], count, columns[2][j])
        for out, x in zip(outs, got, strict=True):
            out.append(x)
        counts.append(more)
    return (*(tf.concat(out, 0)[:n] for out in outs), tf.add_n(counts))


def claim_loop(
    t: View, keys: tf.Tensor, start: tf.Tensor, tokens: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """The probe of :meth:`~._probing.ProbeOps.probe` claiming, for keys probing on from
    ``start``, each round the compiled rounds and race of :func:`race_chunks` over every
    key left."""

    def body(step, idx, ks, tk, pos, found, found_at):
        rows, slots, going_on, _ = race_chunks(t, ks, tk, pos)
        done_at = positions(going_on < 0)
        found = found.write(step, tf.gather(idx, done_at))
        at = [tf.gather(slots, done_at), tf.gather(rows, done_at)]
        found_at = found_at.write(step, tf.stack(at, axis=1))
        keep = positions(going_on >= 0)
        kept = [tf.gather(x, keep) for x in (idx, ks, tk, going_on)]
        return (step + 1, *kept, found, found_at)

    return probe_rounds(body, [keys, tokens, start])
