"""Sparse optimizers: Keras 3 SGD, Adagrad and Adam that update only the touched keys.

Each class is the Keras optimizer of the same name, extended: a gradient for the ``rows``
of a :class:`~de_store.embedding.TrainableWrapper` is aggregated per unique id and the
update is written back to the dynamic tables for those ids only (overwritten, or added as a
delta when the Variable has ``bp_v2``). Slot states live in companion tables of the
Variable (``adagrad_accumulator``, ``adam_m``, ``adam_v``). Dense variables get the normal
Keras update, so one optimizer trains a whole model, in ``model.fit`` or a custom loop.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from de_store.embedding import TrainableWrapper, wrapper_of
from de_store.errors import VariableError

Slot = tuple[Any, tf.Tensor, tf.Tensor, tf.Tensor]  # (companion, old, new, existed)


class _SparseMixin:
    """Routes wrapper gradients to ``_sparse_step``, the rest to the Keras optimizer."""

    def build(self, variables: list[Any]) -> None:
        super().build([v for v in variables if wrapper_of(v) is None])  # type: ignore[misc]

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if trainable_variables is None:
            return super().apply(grads)  # type: ignore[misc]
        pairs = list(zip(grads, trainable_variables, strict=True))
        sparse = [(g, v) for g, v in pairs if wrapper_of(v) is not None]
        dense = [(g, v) for g, v in pairs if wrapper_of(v) is None]
        for grad, variable in sparse:
            if grad is not None:
                self._apply_sparse(grad, wrapper_of(variable))  # type: ignore[arg-type]
        if dense:
            return super().apply(  # type: ignore[misc]
                [g for g, _ in dense], [v for _, v in dense]
            )
        self.iterations.assign_add(1)  # type: ignore[attr-defined]
        return None

    def _apply_sparse(self, grad: Any, wrapper: TrainableWrapper) -> None:
        params = wrapper.params
        ids, old = wrapper.ids, tf.convert_to_tensor(wrapper.rows)
        grad = _aggregate(grad, tf.shape(ids)[0])
        lr = tf.cast(self.learning_rate, params.value_dtype)  # type: ignore[attr-defined]
        new, slots = self._sparse_step(params, ids, old, tf.cast(grad, old.dtype), lr)
        params.write_back(ids, old, new, wrapper.existed)
        for companion, slot_old, slot_new, slot_existed in slots:
            companion.write_back(ids, slot_old, slot_new, slot_existed)
        if params.restrict_policy is not None:
            params.restrict_policy.apply_update(ids)

    def _sparse_step(
        self, params: Any, ids: tf.Tensor, old: tf.Tensor, grad: tf.Tensor, lr: tf.Tensor
    ) -> tuple[tf.Tensor, list[Slot]]:
        raise NotImplementedError


def _aggregate(grad: Any, count: tf.Tensor) -> tf.Tensor:
    """Sum an ``IndexedSlices`` gradient per row (duplicate ids add up)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, count)
    return tf.convert_to_tensor(grad)


def _slot(params: Any, column: str, ids: tf.Tensor, init: float) -> tuple[Any, Any, Any]:
    companion = params.companion(column, params.dim, params.value_dtype, initializer=init)
    values, existed = companion.lookup(ids, return_exists=True)
    return companion, values, existed


class SGD(_SparseMixin, keras.optimizers.SGD):
    """``keras.optimizers.SGD`` (without momentum for dynamic embeddings) + sparse updates."""

    def _sparse_step(self, params, ids, old, grad, lr):  # type: ignore[no-untyped-def]
        if self.momentum:
            raise VariableError(
                f"variable '{params.name}': de_store SGD supports momentum=0 for dynamic "
                f"embeddings, got momentum={self.momentum}"
            )
        return old - lr * grad, []


class Adagrad(_SparseMixin, keras.optimizers.Adagrad):
    """``keras.optimizers.Adagrad`` + sparse updates; slot ``adagrad_accumulator``."""

    def _sparse_step(self, params, ids, old, grad, lr):  # type: ignore[no-untyped-def]
        acc, acc_old, acc_existed = _slot(
            params, "adagrad_accumulator", ids, self.initial_accumulator_value
        )
        acc_new = acc_old + grad * grad
        new = old - lr * grad / tf.sqrt(acc_new + self.epsilon)
        return new, [(acc, acc_old, acc_new, acc_existed)]


class Adam(_SparseMixin, keras.optimizers.Adam):
    """``keras.optimizers.Adam`` + sparse updates; slots ``adam_m`` and ``adam_v``."""

    def _sparse_step(self, params, ids, old, grad, lr):  # type: ignore[no-untyped-def]
        if self.amsgrad:
            raise VariableError(
                f"variable '{params.name}': de_store Adam supports amsgrad=False for dynamic "
                "embeddings, got amsgrad=True"
            )
        step = tf.cast(self.iterations + 1, old.dtype)
        alpha = lr * tf.sqrt(1 - self.beta_2**step) / (1 - self.beta_1**step)
        m, m_old, m_existed = _slot(params, "adam_m", ids, 0.0)
        v, v_old, v_existed = _slot(params, "adam_v", ids, 0.0)
        m_new = m_old + (grad - m_old) * (1 - self.beta_1)
        v_new = v_old + (grad * grad - v_old) * (1 - self.beta_2)
        new = old - alpha * m_new / (tf.sqrt(v_new) + self.epsilon)
        return new, [(m, m_old, m_new, m_existed), (v, v_old, v_new, v_existed)]


_SPARSE_CLASSES: dict[type, Any] = {
    keras.optimizers.SGD: SGD,
    keras.optimizers.Adagrad: Adagrad,
    keras.optimizers.Adam: Adam,
}


def DynamicEmbeddingOptimizer(optimizer: keras.optimizers.Optimizer) -> Any:
    """Return a copy of a Keras SGD, Adagrad or Adam that also trains dynamic embeddings.

    The name follows TFRA's ``dynamic_embedding.DynamicEmbeddingOptimizer``.
    """
    if isinstance(optimizer, _SparseMixin):
        return optimizer
    sparse_cls = _SPARSE_CLASSES.get(type(optimizer))
    if sparse_cls is None:
        raise VariableError(
            f"optimizer '{optimizer.name}': expected keras SGD, Adagrad or Adam, "
            f"got {type(optimizer).__name__}"
        )
    return sparse_cls.from_config(optimizer.get_config())
