"""tf_keras (Keras 2) optimizers extended to train dynamic embeddings.

Under ``TF_USE_LEGACY_KERAS=1`` a TFRA program hands :func:`de_store.DynamicEmbeddingOptimizer`
a tf_keras optimizer of either kind; both get the behaviour the Keras 3 ones have:

- :class:`Keras2Sparse` (``tf.keras.optimizers.*``, tf_keras's ``Optimizer``): for each
  :class:`~de_store.embedding.TrainableWrapper` an optimizer of the same class and config,
  built once on the wrapper with ``[None, dim]`` slot variables and sharing the step count
  and learning rate, runs its ``update_step`` on the batch rows; ordinary variables go
  through the optimizer's own ``apply_gradients``.
- :class:`LegacySparse` (``tf.keras.optimizers.legacy.*``, ``OptimizerV2``): a wrapper's
  slots are ``[None, dim]`` variables; ``apply_gradients`` loads their batch rows, lets the
  optimizer's own kernels update rows and slots with every other variable, and writes both
  back.

Slot rows live per key in companion tables of the Variable. tf_keras names some slots
differently from Keras 3 (``m`` for SGD's momentum, ``rms`` for RMSprop's velocity); the
columns take the Keras 3 name of the same state, so a table trained under either Keras has
the same companions (``adam_m``, ``sgd_momentum``, ``rmsprop_velocity`` ...).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.saved_model import save_context

from de_store._keras import keras
from de_store._row_rules import LEGACY_RULES, RowGradients, apply_rule_to_rows
from de_store._slots import (
    aggregate,
    decay_weight,
    load_slot,
    row_slot_variable,
    slot_column,
    write_back_rows,
)
from de_store.embedding import BatchRows, RowsState, TrainableWrapper, wrapper_of
from de_store.errors import VariableError

#: tf_keras slot names whose Keras 3 optimizer calls the same state otherwise.
_KERAS3_SLOT_NAMES = {
    ("sgd", "m"): "momentum",
    ("adam", "vhat"): "velocity_hat",
    ("adamw", "m"): "momentum",
    ("adamw", "v"): "velocity",
    ("adamw", "vhat"): "velocity_hat",
    ("nadam", "m"): "momentum",
    ("nadam", "v"): "velocity",
    ("lion", "m"): "momentum",
    ("rmsprop", "rms"): "velocity",
    ("rmsprop", "mg"): "average_gradient",
    ("adamax", "v"): "u",
    ("adadelta", "accum_grad"): "accumulated_grad",
    ("adadelta", "accum_var"): "accumulated_delta_var",
}


def keras2_slot_column(optimizer: str, slot: str) -> str:
    """The companion column of slot ``slot`` of tf_keras optimizer class ``optimizer``:
    the column of the Keras 3 slot holding the same state."""
    return slot_column(optimizer, _KERAS3_SLOT_NAMES.get((optimizer.lower(), slot), slot))


def _first_row(initial: Any) -> np.ndarray | None:
    """The row a slot starts from, of its initial ``[1, dim]`` value: ``None`` for zeros."""
    row = np.asarray(initial)[0]
    return row if row.any() else None


class _RowsOf:
    """A wrapper as an optimizer's ``build`` sees it: one row (a concrete shape, from which
    Adagrad and Ftrl fill their initial accumulators), the wrapper's dtype and key."""

    def __init__(self, wrapper: TrainableWrapper) -> None:
        self.wrapper = wrapper
        self.shape = tf.TensorShape([1, wrapper.params.dim])
        self.dtype = wrapper.dtype
        self._unique_id = wrapper._unique_id


class _RowSlots:
    """A tf_keras optimizer whose slots for a wrapper are ``[None, dim]`` variables,
    recorded with their initial rows for the companion tables."""

    def add_variable_from_reference(
        self, model_variable: Any, variable_name: str, shape: Any = None, initial_value: Any = None
    ) -> Any:
        if not isinstance(model_variable, _RowsOf):
            return super().add_variable_from_reference(  # type: ignore[misc]
                model_variable, variable_name, shape, initial_value
            )
        slot = row_slot_variable(model_variable.wrapper, variable_name)
        first = None if initial_value is None else _first_row(initial_value)
        self._de_slots.append((variable_name, slot, first))  # type: ignore[attr-defined]
        return slot


@functools.cache
def _rows_class(keras_class: type) -> type:
    return type(f"Rows{keras_class.__name__}", (_RowSlots, keras_class), {})


class Keras2Sparse(RowGradients):
    """Mixed into a tf_keras ``Optimizer`` class: routes wrapper gradients to
    :meth:`_apply_sparse`, the rest to the optimizer's own ``apply_gradients``."""

    def build(self, var_list: Any) -> None:
        super().build([v for v in var_list if wrapper_of(v) is None])  # type: ignore[misc]

    def apply_gradients(
        self, grads_and_vars: Any, name: Any = None, skip_gradients_aggregation: bool = False
    ) -> Any:
        pairs = list(grads_and_vars)
        sparse = [(g, v) for g, v in pairs if wrapper_of(v) is not None and g is not None]
        dense = [(g, v) for g, v in pairs if wrapper_of(v) is None]
        if sparse:
            self._compute_current_learning_rate()  # type: ignore[attr-defined]
            for grad, variable in sparse:
                self._apply_sparse(grad, variable)
        if dense:
            return super().apply_gradients(  # type: ignore[misc]
                dense, name, skip_gradients_aggregation
            )
        return self.iterations.assign_add(1)  # type: ignore[attr-defined]

    def _rows_optimizer(self, wrapper: TrainableWrapper) -> Any:
        """The optimizer (of this one's class and config) that updates the rows of
        ``wrapper``: built on it once, sharing this one's step count and learning rate."""
        inners: dict[int, Any] = self.__dict__.setdefault("_de_rows", {})
        inner = inners.get(id(wrapper))
        if inner is None:
            with tf.init_scope():
                inner = _rows_class(self._keras_class()).from_config(self.get_config())  # type: ignore[attr-defined]
                object.__setattr__(inner, "_de_slots", [])
                inner.build([_RowsOf(wrapper)])
            for shared in ("_iterations", "_learning_rate", "_current_learning_rate"):
                if shared in self.__dict__:
                    object.__setattr__(inner, shared, self.__dict__[shared])
            inners[id(wrapper)] = inner
        return inner

    def _apply_sparse(self, grad: Any, wrapper: Any) -> None:
        if isinstance(wrapper, BatchRows):  # tables on parameter servers: tensors of the step
            grad, wrapper = wrapper.state.bind(grad), wrapper.state
        inner = self._rows_optimizer(wrapper)
        name = self._keras_class().__name__
        slots = [
            load_slot(wrapper, keras2_slot_column(name, slot_name), slot, first)[0]
            for slot_name, slot, first in inner._de_slots
        ]
        old = tf.convert_to_tensor(wrapper)
        grad = tf.cast(aggregate(grad, tf.shape(wrapper.ids)[0]), old.dtype)
        if isinstance(wrapper, RowsState):  # outside any distribution strategy's update
            decay_weight(inner, wrapper)
        else:
            inner._apply_weight_decay([wrapper])
        inner.update_step(grad, wrapper)
        write_back_rows(wrapper, old, slots)


class LegacySparse:
    """Mixed into a tf_keras ``OptimizerV2`` class (``tf.keras.optimizers.legacy``).

    A wrapper's slots are kept apart from the optimizer's own (``add_slot`` would make them
    the wrapper's declared shape), each with the row it starts from.
    """

    def add_slot(
        self, var: Any, slot_name: str, initializer: Any = "zeros", shape: Any = None
    ) -> Any:
        wrapper = wrapper_of(var)
        if wrapper is None:
            return super().add_slot(var, slot_name, initializer, shape)  # type: ignore[misc]
        if slot_name not in self._slot_names:  # type: ignore[attr-defined]
            self._slot_names.append(slot_name)  # type: ignore[attr-defined]
        slots = self._row_slots(wrapper)
        if slot_name not in slots:
            with tf.init_scope():
                if isinstance(initializer, str):
                    initializer = keras.initializers.get(initializer)
                first = initializer(shape=[1, wrapper.params.dim], dtype=wrapper.dtype)
                slots[slot_name] = (row_slot_variable(wrapper, slot_name), _first_row(first))
        return slots[slot_name][0]

    def get_slot(self, var: Any, slot_name: str) -> Any:
        wrapper = wrapper_of(var)
        if wrapper is None:
            return super().get_slot(var, slot_name)  # type: ignore[misc]
        if save_context.in_save_context():
            # A SavedModel saves no slot of a wrapper (KeyError: TensorFlow skips it), as
            # Keras 3 and tf_keras's current optimizers save none: a loader would revive it
            # with the optimizer's add_slot, which cannot fill the wrapper's [None, dim]
            # shape, and its rows are only a batch's, which the companion tables hold.
            raise KeyError(f"{wrapper.name}: the slots of batch rows are not saved")
        return self._row_slots(wrapper)[slot_name][0]

    def _row_slots(self, wrapper: TrainableWrapper) -> dict[str, tuple[Any, Any]]:
        """The slots of ``wrapper`` by name: (variable, first row or ``None`` for zeros)."""
        by_wrapper: dict[int, Any] = self.__dict__.setdefault("_de_row_slots", {})
        return by_wrapper.setdefault(id(wrapper), {})  # type: ignore[no-any-return]

    def apply_gradients(
        self, grads_and_vars: Any, name: Any = None, experimental_aggregate_gradients: bool = True
    ) -> Any:
        pairs, loaded = [], []
        for grad, var in grads_and_vars:
            wrapper = wrapper_of(var)
            if isinstance(wrapper, BatchRows):  # rows of a step on parameter servers
                if grad is not None:
                    self._apply_rule(grad, wrapper)
                continue
            if wrapper is not None and grad is not None:
                with tf.init_scope():
                    self._create_all_weights([wrapper])  # type: ignore[attr-defined]
                old = tf.convert_to_tensor(wrapper)
                loaded.append((wrapper, old, self._load_slots(wrapper)))
                grad = aggregate(grad, tf.shape(old)[0])
            pairs.append((grad, var))
        if not pairs:
            return self.iterations.assign_add(1)  # type: ignore[attr-defined]
        op = super().apply_gradients(  # type: ignore[misc]
            pairs, name, experimental_aggregate_gradients
        )
        for wrapper, old, slots in loaded:
            write_back_rows(wrapper, old, slots)
        return op

    def _apply_rule(self, grad: Any, rows: BatchRows) -> None:
        """Update batch rows of a step on parameter servers by this optimizer's rule as a
        function of tensors: its fused kernels need variables, which such a step has none
        of (SGD, Adagrad and Adam have the rule)."""
        name = type(self).__name__
        rule = LEGACY_RULES.get(name)
        if rule is None:
            raise VariableError(
                f"variable '{rows.params.name}': its tables live on parameter servers, whose "
                f"steps hold no variable for the batch rows; tf.keras.optimizers.legacy.{name} "
                "updates only variables there. Use legacy SGD, Adagrad or Adam (without "
                "amsgrad), or any optimizer of tf.keras.optimizers"
            )
        try:
            rule.slots(self)
        except VariableError as err:
            raise VariableError(f"variable '{rows.params.name}': {err}") from None
        state = rows.state
        grad = state.bind(grad)
        step, lr = self.iterations, self._decayed_lr(state.dtype)  # type: ignore[attr-defined]
        apply_rule_to_rows(self, rule, lambda s: keras2_slot_column(name, s), grad, state, lr, step)

    def _load_slots(self, wrapper: TrainableWrapper) -> list[Any]:
        """Read the batch's rows of every slot of ``wrapper`` from its companion table."""
        name = type(self).__name__
        return [
            load_slot(wrapper, keras2_slot_column(name, slot_name), slot, first)[0]
            for slot_name, (slot, first) in sorted(self._row_slots(wrapper).items())
        ]


@functools.cache
def _legacy_class(legacy_class: type) -> type:
    return type(legacy_class.__name__, (LegacySparse, legacy_class), {"__module__": __name__})


def extend_legacy(optimizer: Any) -> Any:
    """Make ``optimizer`` (an ``OptimizerV2``) train dynamic embeddings too, in place (its
    class becomes a subclass of its own), and return it."""
    optimizer.__class__ = _legacy_class(type(optimizer))  # type: ignore[arg-type]
    return optimizer
