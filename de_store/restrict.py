"""Restrict policies: bound a Variable's size by dropping its oldest or rarest keys.

A policy keeps one status value per key in a companion table of its Variable (column
``"timestamp"`` or ``"frequency"``), updated by the optimizers for every trained key (or by
``apply_update``). ``Variable.restrict(num_reserved, trigger)`` then keeps the
``num_reserved`` best-ranked keys and removes the others from the values, the optimizer
slots and the status together. The status is checkpointed with the Variable.
"""

from __future__ import annotations

import abc
from typing import Any

import tensorflow as tf

from de_store.errors import VariableError


class RestrictPolicy(tf.Module, abc.ABC):
    """Base of the restrict policies; ``Variable(restrict_policy=Cls)`` builds ``Cls(var)``."""

    column: str

    def __init__(self, var: Any) -> None:
        super().__init__(name=f"{self.column}_policy")
        object.__setattr__(self, "_var", var)  # untracked: the Variable tracks this policy
        self.status = var.companion(self.column, dim=1, value_dtype=tf.int64, initializer=0)

    @abc.abstractmethod
    def apply_update(self, keys: tf.Tensor) -> None:
        """Record that ``keys`` were just updated."""

    def apply_restriction(self, num_reserved: int, trigger: int | None = None) -> None:
        """If the size exceeds ``trigger`` (default ``num_reserved``), keep the
        ``num_reserved`` keys with the highest status and remove the rest everywhere."""
        trigger = num_reserved if trigger is None else trigger
        if num_reserved < 0 or trigger < num_reserved:
            raise VariableError(
                f"variable '{self._var.name}': expected 0 <= num_reserved <= trigger, "
                f"got num_reserved={num_reserved}, trigger={trigger}"
            )
        with self._var.exclusive():  # no update between the ranking and the removal
            keys, _ = self._var.export()
            status = tf.reshape(self.status.lookup(keys), [-1])
            count = tf.size(keys, out_type=tf.int32)
            excess = tf.where(count > trigger, count - num_reserved, 0)
            order = tf.argsort(status, stable=True)
            self._var.remove(tf.gather(keys, order[:excess]))


class TimestampRestrictPolicy(RestrictPolicy):
    """Keep the most recently updated keys.

    The status is a strictly increasing int64 clock: wall time in microseconds, moved one
    tick past the previous update when the wall clock has not advanced, so every update
    call ranks after the one before it.
    """

    column = "timestamp"

    def __init__(self, var: Any) -> None:
        super().__init__(var)
        with tf.init_scope():
            self.clock = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="clock")

    def apply_update(self, keys: tf.Tensor) -> None:
        """Stamp ``keys`` with the next clock value."""
        with self._var.exclusive():  # eager updates from several threads: one clock
            now = tf.cast(tf.timestamp() * 1e6, tf.int64)
            stamp = tf.maximum(now, self.clock + 1)
            self.clock.assign(stamp)
            stamps = tf.fill(tf.stack([tf.size(keys), 1]), stamp)
            self.status.upsert(keys, stamps)


class FrequencyRestrictPolicy(RestrictPolicy):
    """Keep the most frequently updated keys (one count per update call per key)."""

    column = "frequency"

    def apply_update(self, keys: tf.Tensor) -> None:
        """Add one to the count of every distinct key in ``keys``."""
        unique_keys, _ = tf.unique(tf.reshape(keys, [-1]))
        ones = tf.ones(tf.stack([tf.size(unique_keys), 1]), tf.int64)
        self.status.accum(unique_keys, ones, insert_missing=True)
