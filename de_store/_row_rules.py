"""The update rules of SGD, Adagrad and Adam as functions of tensors, for steps that hold
no batch variables (``apply_row_gradients``: the steps of ``ParameterServerStrategy``
workers, which share the tables and run at the same time).

Each rule follows its Keras 3 optimizer's ``update_step`` to the letter and keeps its slots
in the same companion columns (``sgd_momentum``, ``adagrad_accumulator``, ``adam_m`` and
``adam_v``), so a model trains and checkpoints alike on either path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf


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
