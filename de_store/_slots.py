"""What the sparse optimizers share: gradient aggregation, slot column names and
initializers, and writing trained rows and slots back to the tables."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from de_store._keras import keras

#: Slot columns with names of their own (Keras Adam's and Adagrad's, as checkpoints hold them).
_COLUMNS = {
    ("adam", "momentum"): "adam_m",
    ("adam", "velocity"): "adam_v",
    ("adagrad", "accumulator"): "adagrad_accumulator",
}

Slot = tuple[Any, tf.Tensor, tf.Tensor, Any]  # (companion, old rows, existed, slot variable)


def aggregate(grad: Any, count: tf.Tensor) -> tf.Tensor:
    """Sum an ``IndexedSlices`` gradient per row (duplicate ids add up)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, count)
    return tf.convert_to_tensor(grad)


def slot_column(optimizer: str, slot: str) -> str:
    """The companion column of slot ``slot`` of optimizer class ``optimizer`` (a Keras or
    ``tf.compat.v1`` class name: ``Adam`` and ``AdamOptimizer`` name the same columns)."""
    key = (optimizer.removesuffix("Optimizer").lower(), slot)
    return _COLUMNS.get(key, f"{key[0]}_{slot}")


def row_slot_variable(wrapper: Any, slot: str) -> tf.Variable:
    """A slot variable for ``wrapper``'s batch rows: ``[None, dim]``, as a wrapper's row
    count changes with every batch (an optimizer would make it the wrapper's shape)."""
    params = wrapper.params
    with tf.init_scope(), tf.device(wrapper.device):
        return tf.Variable(
            tf.zeros([0, params.dim], params.value_dtype),
            shape=tf.TensorShape([None, params.dim]),
            trainable=False,
            name=f"{params.name}/{slot}".replace(":", "_"),
        )


def load_slot(wrapper: Any, column: str, slot: Any, initializer: Any) -> tuple[Slot, Any]:
    """Read the batch's rows of companion ``column`` (made with ``initializer`` if new)
    into ``slot``: the :data:`Slot` to write back later, and the assign op."""
    params = wrapper.params
    companion = params.companion(column, params.dim, params.value_dtype, initializer)
    values, existed = companion.lookup(wrapper.ids, return_exists=True)
    return (companion, values, existed, slot), slot.assign(values)


def slot_initializer(initializer: Any) -> Any:
    """The companion initializer of a Keras slot initializer: ``None`` for zeros, a
    constant, or the initializer itself (a callable of ``shape`` and ``dtype``)."""
    if initializer is None:
        return None
    if isinstance(initializer, (int, float)):
        return float(initializer)
    initializer = keras.initializers.get(initializer)
    if isinstance(initializer, keras.initializers.Zeros):
        return None
    if isinstance(initializer, keras.initializers.Ones):
        return 1.0
    if isinstance(initializer, keras.initializers.Constant):
        return float(initializer.value)
    return initializer


def write_back_rows(wrapper: Any, old: tf.Tensor, slots: list[Slot]) -> list[Any]:
    """Write the wrapper's trained rows and each slot's new rows to their tables; the ops
    (in a ``tf.compat.v1`` graph, what must run)."""
    params, ids = wrapper.params, wrapper.ids
    ops = [params.write_back(ids, old, tf.convert_to_tensor(wrapper), wrapper.existed)]
    for companion, slot_old, slot_existed, slot in slots:
        ops.append(companion.write_back(ids, slot_old, tf.convert_to_tensor(slot), slot_existed))
    if params.restrict_policy is not None:
        ops.append(params.restrict_policy.apply_update(ids))
    return [op for op in ops if op is not None]
