"""The update rules of SGD, Adagrad and Adam as functions of tensors, for steps that hold
no batch variables (``apply_row_gradients``: the steps of ``ParameterServerStrategy``
workers, which share the tables and run at the same time).

Each rule follows its Keras optimizer's ``update_step`` to the letter (Keras 3's and
tf_keras's are the same) and keeps its slots in the same companion columns
(``sgd_momentum``, ``adagrad_accumulator``, ``adam_m`` and ``adam_v``), so a model trains
and checkpoints alike on either path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from de_store._keras import keras
from de_store._slots import slot_column
from de_store.errors import VariableError


class RowRule(NamedTuple):
    """An update rule: its slots (name, initial value) and the update itself,
    ``update(optimizer, rows, grad, slots, lr, step) -> (rows, slots)``."""

    slots: Callable[[Any], list[tuple[str, float]]]
    update: Callable[..., tuple[tf.Tensor, list[tf.Tensor]]]


def _sgd_slots(opt: Any) -> list[tuple[str, float]]:
    return [("momentum", 0.0)] if opt.momentum != 0 else []


def _sgd(
    opt: Any,
    rows: tf.Tensor,
    grad: tf.Tensor,
    slots: list[tf.Tensor],
    lr: tf.Tensor,
    step: tf.Tensor,
) -> Any:
    if opt.momentum == 0:
        return rows - lr * grad, []
    momentum = tf.cast(opt.momentum, rows.dtype)
    m = -grad * lr + slots[0] * momentum
    if opt.nesterov:
        return rows - grad * lr + m * momentum, [m]
    return rows + m, [m]


def _adagrad_slots(opt: Any) -> list[tuple[str, float]]:
    return [("accumulator", float(opt.initial_accumulator_value))]


def _adagrad(
    opt: Any,
    rows: tf.Tensor,
    grad: tf.Tensor,
    slots: list[tf.Tensor],
    lr: tf.Tensor,
    step: tf.Tensor,
) -> Any:
    accumulator = slots[0] + tf.square(grad)
    return rows - lr * grad / tf.sqrt(accumulator + opt.epsilon), [accumulator]


def _adam_slots(opt: Any) -> list[tuple[str, float]]:
    return [("momentum", 0.0), ("velocity", 0.0)]


def _adam(
    opt: Any,
    rows: tf.Tensor,
    grad: tf.Tensor,
    slots: list[tf.Tensor],
    lr: tf.Tensor,
    step: tf.Tensor,
) -> Any:
    local_step = tf.cast(step + 1, rows.dtype)
    beta_1 = tf.cast(opt.beta_1, rows.dtype)
    beta_2 = tf.cast(opt.beta_2, rows.dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, local_step)) / (1 - tf.pow(beta_1, local_step))
    m = slots[0] + (grad - slots[0]) * (1 - beta_1)
    v = slots[1] + (tf.square(grad) - slots[1]) * (1 - beta_2)
    return rows - (m * alpha) / (tf.sqrt(v) + opt.epsilon), [m, v]


RULES = {
    "SGD": RowRule(_sgd_slots, _sgd),
    "Adagrad": RowRule(_adagrad_slots, _adagrad),
    "Adam": RowRule(_adam_slots, _adam),
}


# tf_keras's legacy optimizers (OptimizerV2): their hyperparameters are read with
# ``_get_hyper``, and their fused kernels (ResourceApplyKerasMomentum, ResourceApplyAdagradV2,
# ResourceApplyAdam) compute the updates below.
def _legacy_sgd_slots(opt: Any) -> list[tuple[str, float]]:
    return [("momentum", 0.0)] if opt._momentum else []


def _legacy_sgd(
    opt: Any, rows: tf.Tensor, grad: tf.Tensor, slots: list[tf.Tensor], lr: tf.Tensor, step: Any
) -> Any:
    if not opt._momentum:
        return rows - lr * grad, []
    momentum = tf.cast(opt._get_hyper("momentum"), rows.dtype)
    m = slots[0] * momentum - lr * grad
    if opt.nesterov:
        return rows + m * momentum - lr * grad, [m]
    return rows + m, [m]


def _legacy_adagrad_slots(opt: Any) -> list[tuple[str, float]]:
    return [("accumulator", float(opt._initial_accumulator_value))]


def _legacy_adagrad(
    opt: Any, rows: tf.Tensor, grad: tf.Tensor, slots: list[tf.Tensor], lr: tf.Tensor, step: Any
) -> Any:
    accumulator = slots[0] + tf.square(grad)
    epsilon = tf.cast(opt.epsilon, rows.dtype)
    return rows - lr * grad / (tf.sqrt(accumulator) + epsilon), [accumulator]


def _legacy_adam_slots(opt: Any) -> list[tuple[str, float]]:
    if opt.amsgrad:
        raise VariableError("legacy Adam with amsgrad=True has no update of batch rows")
    return [("m", 0.0), ("v", 0.0)]


def _legacy_adam(
    opt: Any, rows: tf.Tensor, grad: tf.Tensor, slots: list[tf.Tensor], lr: tf.Tensor, step: Any
) -> Any:
    local_step = tf.cast(step + 1, rows.dtype)
    beta_1 = tf.cast(opt._get_hyper("beta_1"), rows.dtype)
    beta_2 = tf.cast(opt._get_hyper("beta_2"), rows.dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, local_step)) / (1 - tf.pow(beta_1, local_step))
    m = slots[0] + (grad - slots[0]) * (1 - beta_1)
    v = slots[1] + (tf.square(grad) - slots[1]) * (1 - beta_2)
    epsilon = tf.cast(opt.epsilon, rows.dtype)
    return rows - alpha * m / (tf.sqrt(v) + epsilon), [m, v]


LEGACY_RULES = {
    "SGD": RowRule(_legacy_sgd_slots, _legacy_sgd),
    "Adagrad": RowRule(_legacy_adagrad_slots, _legacy_adagrad),
    "Adam": RowRule(_legacy_adam_slots, _legacy_adam),
}


def apply_rule_to_rows(
    optimizer: Any,
    rule: RowRule,
    columns: Callable[[str], str],
    grad: Any,
    rows: Any,
    lr: Any,
    step: Any,
) -> None:
    """Update the rows ``rows`` holds (a :class:`de_store.embedding.RowsState`, with the
    gradient ``grad`` of each of its ids) and their slots by ``rule``, and write both back
    to the tables; ``columns(slot)`` names a slot's companion column."""
    variable, ids = rows.params, rows.ids
    old = rows.read_value()
    grad = tf.cast(grad, old.dtype)
    companions = [
        variable.companion(columns(slot), variable.dim, variable.value_dtype, init)
        for slot, init in rule.slots(optimizer)
    ]
    slots = [companion.lookup(ids, return_exists=True) for companion in companions]
    new_rows, new_slots = rule.update(
        optimizer, old, grad, [s for s, _ in slots], tf.cast(lr, old.dtype), step
    )
    variable.write_back(ids, old, new_rows, rows.existed)
    for companion, (slot_old, existed), new in zip(companions, slots, new_slots, strict=True):
        companion.write_back(ids, slot_old, new, existed)
    if variable.restrict_policy is not None:
        variable.restrict_policy.apply_update(ids)


class RowGradients:
    """``apply_row_gradients`` for a de_store optimizer of SGD, Adagrad or Adam (either
    Keras); the optimizer's class names its rule (:meth:`_keras_class`)."""

    def _keras_class(self) -> type:
        """The Keras optimizer class this optimizer extends: the first of its classes that
        is a Keras optimizer and not one of de_store's."""
        return next(
            c
            for c in type(self).__mro__
            if issubclass(c, keras.optimizers.Optimizer) and not issubclass(c, RowGradients)
        )

    def apply_row_gradients(self, updates: Any) -> None:
        """Apply the gradients of looked-up rows, without batch variables.

        ``updates`` holds ``(grad, ids, variable)`` triples: ``grad`` is the gradient of the
        loss with respect to ``variable.lookup(ids)`` (any shape ``ids.shape + [dim]``;
        rows of repeated ids add up). Each id's row and slots are read from the tables,
        updated by this optimizer's rule and written back (``write_back``: added as a delta
        with ``bp_v2``). The step counter advances once.

        This is the update of steps that run on many workers at once and share the tables:
        a ``ParameterServerStrategy`` step scheduled by a ``ClusterCoordinator``, which
        cannot hold a batch variable of its own. SGD, Adagrad and Adam have it.
        """
        name = self._keras_class().__name__
        rule = RULES.get(name)
        if rule is None:
            raise VariableError(
                f"apply_row_gradients: expected an SGD, Adagrad or Adam optimizer, got {name}"
            )
        step = self.iterations  # type: ignore[attr-defined]
        lr = self.learning_rate  # type: ignore[attr-defined]
        for grad, ids, variable in updates:
            _apply_rule(self, rule, name, grad, ids, variable, lr, step)
        step.assign_add(1)


def _apply_rule(
    optimizer: Any, rule: RowRule, name: str, grad: Any, ids: Any, variable: Any, lr: Any, step: Any
) -> None:
    """One variable's share of :meth:`RowGradients.apply_row_gradients`."""
    ids = tf.reshape(variable._keys(ids), [-1])
    unique, position = tf.unique(ids)
    grad = tf.reshape(tf.convert_to_tensor(grad), [-1, variable.dim])
    grad = tf.math.unsorted_segment_sum(grad, position, tf.size(unique))
    rows, existed = variable.lookup(unique, return_exists=True)
    companions = [
        variable.companion(slot_column(name, slot), variable.dim, variable.value_dtype, init)
        for slot, init in rule.slots(optimizer)
    ]
    slots = [companion.lookup(unique, return_exists=True) for companion in companions]
    lr = tf.cast(lr, rows.dtype)
    new_rows, new_slots = rule.update(
        optimizer, rows, tf.cast(grad, rows.dtype), [s for s, _ in slots], lr, step
    )
    variable.write_back(unique, rows, new_rows, existed)
    for companion, (old, slot_existed), new in zip(companions, slots, new_slots, strict=True):
        companion.write_back(unique, old, new, slot_existed)
    if variable.restrict_policy is not None:
        variable.restrict_policy.apply_update(unique)
