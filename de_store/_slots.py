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


class TensorSlot:
    """A ``[None, dim]`` variable as an optimizer's update step uses it, held as a tensor.

    ``assign``, ``assign_add`` and ``assign_sub`` replace the tensor and ``read_value``
    returns it; arithmetic and ``tf.convert_to_tensor`` use it. A Keras optimizer's
    ``update_step`` run on these computes new rows and slots as tensors of the step, with
    no variable: the update of a step on a parameter-server worker (see
    :class:`de_store.embedding.BatchRows`), whose slot rows go back to their tables.
    """

    trainable = False

    def __init__(self, name: str, dtype: tf.DType, dim: int) -> None:
        self.name = self._unique_id = name
        self.path = name
        self.dtype = tf.as_dtype(dtype)
        self.shape = tf.TensorShape([None, dim])
        self.device = ""
        self._tensor = tf.zeros([0, dim], self.dtype)

    def read_value(self) -> tf.Tensor:
        return self._tensor

    value = read_value

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: Any = True
    ) -> Any:
        self._tensor = tf.cast(tf.convert_to_tensor(value), self.dtype)
        return self

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: Any = True
    ) -> Any:
        return self.assign(self._tensor + delta)

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: Any = True
    ) -> Any:
        return self.assign(self._tensor - delta)

    def __add__(self, other: Any) -> Any:
        return self._tensor + other

    def __radd__(self, other: Any) -> Any:
        return other + self._tensor

    def __sub__(self, other: Any) -> Any:
        return self._tensor - other

    def __rsub__(self, other: Any) -> Any:
        return other - self._tensor

    def __mul__(self, other: Any) -> Any:
        return self._tensor * other

    def __rmul__(self, other: Any) -> Any:
        return other * self._tensor

    def __truediv__(self, other: Any) -> Any:
        return self._tensor / other

    def __rtruediv__(self, other: Any) -> Any:
        return other / self._tensor

    def __pow__(self, other: Any) -> Any:
        return self._tensor**other

    def __neg__(self) -> Any:
        return -self._tensor

    def __abs__(self) -> Any:
        return abs(self._tensor)


tf.register_tensor_conversion_function(
    TensorSlot, lambda slot, dtype=None, name=None, as_ref=False: slot.read_value()
)


def decay_weight(optimizer: Any, variable: Any) -> None:
    """The decoupled weight decay of a Keras optimizer (``weight_decay``; Keras 3's and
    tf_keras's alike) on ``variable`` in place, outside any distribution strategy's update:
    ``variable -= variable * weight_decay * learning_rate``."""
    if not getattr(optimizer, "weight_decay", None) or not optimizer._use_weight_decay(variable):
        return
    lr = tf.cast(optimizer.learning_rate, variable.dtype)
    variable.assign_sub(variable * tf.cast(optimizer.weight_decay, variable.dtype) * lr)


def row_slot_variable(wrapper: Any, slot: str) -> Any:
    """A slot variable for ``wrapper``'s batch rows: ``[None, dim]``, as a wrapper's row
    count changes with every batch (an optimizer would make it the wrapper's shape); a
    :class:`TensorSlot` for a wrapper that is one."""
    params = wrapper.params
    if isinstance(wrapper, TensorSlot):
        return TensorSlot(f"{params.name}/{slot}", params.value_dtype, params.dim)
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
