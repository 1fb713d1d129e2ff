"""The variables of a table as its graph operations read and write them: their lengths,
assignments and reads that copy no buffer, and stacks that grow as they are pushed to.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def count(x: tf.Tensor) -> tf.Tensor:
    """Elements of ``x`` (int64 scalar)."""
    return tf.size(x, out_type=tf.int64)


def variable_length(var: tf.Variable) -> tf.Tensor:
    """Leading dimension of a variable, without reading its value."""
    shape = tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64)
    if var.shape.rank is not None:  # one node, where a strided slice makes four
        return tf.unstack(shape, num=var.shape.rank)[0]
    return shape[0]


def eager_length(var: tf.Variable) -> int:
    """Leading dimension of a variable, read eagerly as a Python int: the shape is read as
    numpy, without the eager strided slice that :func:`variable_length` would run
    (see :data:`~de_store.tables._locking.EAGER_ON_DEVICE`)."""
    return int(tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64).numpy()[0])


def replace(var: tf.Variable, value: tf.Tensor) -> None:
    """Assign ``value`` (of any length) to ``var`` without copying it.

    A variable that a sparse op (gather, scatter) has touched is in TensorFlow's
    copy-on-read mode: it copies every value assigned to it, into memory touched for the
    first time, a cost in seconds per GB that a table growing to millions of keys pays at
    each growth (docs/benchmarks.md, Costs behind the code). ``DisableCopyOnRead`` ends
    that mode; the next sparse op starts it again, copying only if the buffer is still
    shared then.
    """
    tf.raw_ops.DisableCopyOnRead(resource=var.handle)
    var.assign(value)


def read_shared(var: tf.Variable) -> tf.Tensor:
    """The value of ``var`` without a copy (see :func:`replace`): a later sparse write
    copies the buffer if this tensor still holds it."""
    tf.raw_ops.DisableCopyOnRead(resource=var.handle)
    return var.read_value()


def push(top: tf.Variable, stacks: Sequence[tuple[tf.Variable, tf.Tensor]]) -> None:
    """Append each ``values`` to its int64 stack variable at ``top``, the fill they share.

    The stacks are as long as each other; when the values do not fit they all grow first,
    to twice their length or to what is needed if more. ``top`` then counts the values.
    """
    start = top.read_value()
    needed = start + count(stacks[0][1])

    def grow() -> tf.Tensor:
        have = variable_length(stacks[0][0])
        extra = tf.zeros(tf.reshape(tf.maximum(needed, 2 * have) - have, [1]), tf.int64)
        for stack, _ in stacks:
            replace(stack, tf.concat([stack, extra], axis=0))
        return tf.constant(True)

    tf.cond(needed > variable_length(stacks[0][0]), grow, lambda: tf.constant(False))
    at = tf.range(start, needed)
    for stack, values in stacks:
        stack.scatter_update(tf.IndexedSlices(values, at))
    top.assign(needed)
