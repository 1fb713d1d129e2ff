"""Sparse optimizers: any Keras or ``tf.compat.v1.train`` optimizer, extended to train
dynamic embeddings by updating only the looked-up keys.

The Keras is the one ``tf.keras`` routes to (:mod:`de_store._keras`): Keras 3, or tf_keras
under ``TF_USE_LEGACY_KERAS=1``, whose optimizers :mod:`de_store._keras2_optimizers` extends
(``tf.keras.optimizers`` and ``tf.keras.optimizers.legacy`` both).

:func:`DynamicEmbeddingOptimizer` (TFRA's name) takes an optimizer and returns one of the
same class that also accepts :class:`~de_store.embedding.TrainableWrapper` s. For each
wrapper the update runs the optimizer's own update step on the batch rows: the slot states
(momentum, velocity, accumulators ...) live per key in companion tables of the Variable;
their rows for the batch ids are read into per-wrapper slot variables, the optimizer's
update step runs on the rows, the slots and the aggregated gradient, and the new rows and
slots are written back to the tables for those ids only (overwritten, or added as a delta
when the Variable has ``bp_v2``). Ordinary variables get the optimizer's normal update, so
one optimizer trains a whole model, in ``model.fit`` or a custom loop.

Slot columns are named ``{optimizer}_{slot}`` (``rmsprop_velocity``, ``ftrl_linear``);
Adam's and Adagrad's keep the names ``adam_m``, ``adam_v`` and ``adagrad_accumulator``.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from de_store import _keras2_optimizers, _v1_optimizers
from de_store._keras import is_keras_2, keras
from de_store._row_rules import RowGradients
from de_store._slots import (
    aggregate,
    decay_weight,
    load_slot,
    row_slot_variable,
    slot_column,
    slot_initializer,
    write_back_rows,
)
from de_store.embedding import BatchRows, RowsState, TrainableWrapper, wrapper_of
from de_store.errors import VariableError


class _RowSlots:
    """A Keras 3 optimizer whose slots for a wrapper are ``[None, dim]`` variables.

    Keras creates a slot of the reference variable's shape; a wrapper's row count changes
    with every batch, so its slots are variables of unknown row count, recorded with their
    initializers for the companion tables.
    """

    def add_variable_from_reference(
        self, reference_variable: Any, name: str | None = None, initializer: Any = "zeros"
    ) -> Any:
        wrapper = wrapper_of(reference_variable)
        if wrapper is None:
            return super().add_variable_from_reference(  # type: ignore[misc]
                reference_variable, name=name, initializer=initializer
            )
        slot = row_slot_variable(wrapper, name or "var")
        self._de_slots.append((name or "var", slot, initializer))  # type: ignore[attr-defined]
        return slot


@functools.cache
def _rows_class(keras_class: type) -> type:
    return type(f"Rows{keras_class.__name__}", (_RowSlots, keras_class), {})


class _LocalUpdates:
    """Placed right above Keras's TensorFlow optimizer class: its update step and weight
    decay run on each variable in place, outside any distribution strategy's update (which
    takes only variables, and under ``ParameterServerStrategy`` a step scheduled without
    ``strategy.run`` has no replica to merge from), while the Keras class's own overrides
    (Nadam's product of momentum factors) still run first."""

    def _backend_update_step(self, grads: Any, variables: Any, learning_rate: Any) -> None:
        for grad, variable in zip(grads, variables, strict=True):
            self.update_step(grad, variable, learning_rate)  # type: ignore[attr-defined]

    def _apply_weight_decay(self, variables: Any) -> None:
        for variable in variables:
            decay_weight(self, variable)


@functools.cache
def _tensor_rows_class(keras_class: type) -> type:
    """The class that updates :class:`RowsState` rows: ``keras_class`` with
    :class:`_LocalUpdates` between it and Keras's TensorFlow optimizer class."""
    backend = next(c for c in keras_class.__mro__ if c.__name__ == "TFOptimizer")
    local = type("LocalUpdates", (_LocalUpdates, backend), {})
    return type(f"TensorRows{keras_class.__name__}", (_RowSlots, keras_class, local), {})


class _SparseMixin(RowGradients):
    """Mixed into a Keras 3 optimizer class: routes wrapper gradients to
    :meth:`_apply_sparse`, the rest to the Keras optimizer."""

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

    def minimize(self, loss: Any, var_list: Any, tape: Any = None) -> Any:
        """Minimise ``loss`` (a tensor computed under ``tape``, or a callable) over
        ``var_list`` (a list, or a callable returning one: wrappers exist after the loss
        has run)."""
        if callable(loss):
            with tf.GradientTape() as tape:
                loss = loss()
        if tape is None:
            raise ValueError(
                "minimize: expected a callable loss, or a loss tensor with the GradientTape "
                "it was computed under; got a tensor and tape=None"
            )
        variables = list(var_list() if callable(var_list) else var_list)
        grads = tape.gradient(loss, variables)
        self.apply(grads, variables)
        return self.iterations  # type: ignore[attr-defined]

    def _rows_optimizer(self, wrapper: TrainableWrapper) -> Any:
        """The optimizer (of this one's Keras class and config) that updates the rows of
        ``wrapper``: built on it once, sharing this one's step count and learning rate."""
        inners: dict[int, Any] = self.__dict__.setdefault("_de_rows", {})
        inner = inners.get(id(wrapper))
        if inner is None:
            kind = _tensor_rows_class if isinstance(wrapper, RowsState) else _rows_class
            with tf.init_scope():
                inner = kind(self._keras_class()).from_config(self.get_config())  # type: ignore[attr-defined]
                object.__setattr__(inner, "_de_slots", [])
                inner.build([wrapper])
                object.__setattr__(inner, "_iterations", self.iterations)  # type: ignore[attr-defined]
                object.__setattr__(inner, "_learning_rate", self._learning_rate)  # type: ignore[attr-defined]
            inners[id(wrapper)] = inner
        return inner

    def _apply_sparse(self, grad: Any, wrapper: Any) -> None:
        if isinstance(wrapper, BatchRows):  # tables on parameter servers: tensors of the step
            grad, wrapper = wrapper.state.bind(grad), wrapper.state
        inner = self._rows_optimizer(wrapper)
        keras_name = self._keras_class().__name__
        slots = [
            load_slot(wrapper, slot_column(keras_name, name), slot, slot_initializer(init))[0]
            for name, slot, init in inner._de_slots
        ]
        old = tf.convert_to_tensor(wrapper)
        grad = tf.cast(aggregate(grad, tf.shape(wrapper.ids)[0]), old.dtype)
        if getattr(inner, "weight_decay", None):
            inner._apply_weight_decay([wrapper])
        inner._backend_update_step([grad], [wrapper], inner.learning_rate)
        write_back_rows(wrapper, old, slots)


#: The sparse mixin of the Keras ``tf.keras`` routes to.
_Sparse: Any = _keras2_optimizers.Keras2Sparse if is_keras_2() else _SparseMixin


@keras.utils.register_keras_serializable(package="de_store")
class SGD(_Sparse, keras.optimizers.SGD):
    """``keras.optimizers.SGD`` + sparse updates (slot ``sgd_momentum`` with momentum)."""


@keras.utils.register_keras_serializable(package="de_store")
class Adagrad(_Sparse, keras.optimizers.Adagrad):
    """``keras.optimizers.Adagrad`` + sparse updates; slot ``adagrad_accumulator``."""


@keras.utils.register_keras_serializable(package="de_store")
class Adam(_Sparse, keras.optimizers.Adam):
    """``keras.optimizers.Adam`` + sparse updates; slots ``adam_m`` and ``adam_v``."""


_NAMED_CLASSES: dict[type, type] = {
    keras.optimizers.SGD: SGD,
    keras.optimizers.Adagrad: Adagrad,
    keras.optimizers.Adam: Adam,
}


@functools.cache
def _sparse_class(keras_class: type) -> type:
    named = _NAMED_CLASSES.get(keras_class)
    if named is not None:
        return named
    created = type(keras_class.__name__, (_Sparse, keras_class), {"__module__": __name__})
    # a compiled model's .keras file names its optimizer's class: load_model finds it here
    return keras.utils.register_keras_serializable(package="de_store")(created)


_SPARSE_KINDS = (
    _SparseMixin,
    _keras2_optimizers.Keras2Sparse,
    _keras2_optimizers.LegacySparse,
    _v1_optimizers.V1Sparse,
)


def DynamicEmbeddingOptimizer(optimizer: Any) -> Any:
    """Return an optimizer of ``optimizer``'s class and settings that also trains
    dynamic embeddings (TFRA's ``dynamic_embedding.DynamicEmbeddingOptimizer``).

    ``optimizer`` is any optimizer of the Keras ``tf.keras`` routes to (``Adam``,
    ``RMSprop``, ``Ftrl`` ...; under Keras 2 ``tf.keras.optimizers.legacy`` ones too) or
    any ``tf.compat.v1.train.Optimizer``. As in TFRA, it is extended in place (its class
    becomes a subclass of its own class) and returned: the object the program holds, its
    settings and any state it has built train dynamic embeddings too.
    """
    if isinstance(optimizer, _SPARSE_KINDS):
        return optimizer
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _v1_optimizers.extend(optimizer)
    if is_keras_2() and isinstance(optimizer, keras.optimizers.legacy.Optimizer):
        return _keras2_optimizers.extend_legacy(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise VariableError(
            "DynamicEmbeddingOptimizer: expected a Keras optimizer or a "
            f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}"
        )
    optimizer.__class__ = _sparse_class(type(optimizer))  # type: ignore[arg-type]
    return optimizer
