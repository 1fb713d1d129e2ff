"""``tf.compat.v1.train`` optimizers extended to train dynamic embeddings.

:func:`extend` turns an optimizer into one of a subclass of its own class whose slots for a
:class:`~de_store.embedding.TrainableWrapper` are ``[None, dim]`` variables (a wrapper's
row count changes with every batch). ``apply_gradients`` reads each wrapper's slot rows
from the companion tables, lets the optimizer's own kernels update rows and slots, and
writes both back to the tables for the batch ids.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.training import optimizer as v1_optimizer

from de_store._slots import (
    Slot,
    aggregate,
    load_slot,
    row_slot_variable,
    slot_column,
    write_back_rows,
)
from de_store.embedding import BatchRows, TrainableWrapper, wrapper_of
from de_store.errors import VariableError


class V1Sparse:
    """Mixed into a ``tf.compat.v1.train.Optimizer`` class by :func:`extend`."""

    # -- slots of wrappers --------------------------------------------------------------
    def _zeros_slot(self, var: Any, slot_name: str, op_name: str) -> Any:
        wrapper = wrapper_of(var)
        if wrapper is None:
            return super()._zeros_slot(var, slot_name, op_name)  # type: ignore[misc]
        return self._row_slot(wrapper, slot_name, None)

    def _get_or_make_slot_with_initializer(
        self, var: Any, initializer: Any, shape: Any, dtype: Any, slot_name: str, op_name: str
    ) -> Any:
        wrapper = wrapper_of(var)
        if wrapper is None:
            return super()._get_or_make_slot_with_initializer(  # type: ignore[misc]
                var, initializer, shape, dtype, slot_name, op_name
            )
        return self._row_slot(wrapper, slot_name, initializer)

    def _create_slots(self, var_list: list[Any]) -> None:
        others = [v for v in var_list if wrapper_of(v) is None]
        if others:
            super()._create_slots(others)  # type: ignore[misc]
        for wrapper in [v for v in var_list if wrapper_of(v) is not None]:
            try:
                super()._create_slots([wrapper])  # type: ignore[misc]
            except ValueError:
                # ProximalAdagrad builds its accumulator as a constant of the variable's
                # shape, which a wrapper's [None, dim] cannot give: make that slot here
                value = getattr(self, "_initial_accumulator_value", None)
                if value is None:
                    raise
                self._row_slot(
                    wrapper, "accumulator", lambda shape, dtype, value=value: np.full(shape, value)
                )

    def _row_slot(self, wrapper: TrainableWrapper, slot_name: str, initializer: Any) -> Any:
        named = self._slot_dict(slot_name)  # type: ignore[attr-defined]
        key = v1_optimizer._var_key(wrapper)
        if key not in named:
            named[key] = row_slot_variable(wrapper, slot_name)
            with tf.init_scope():
                self.__dict__.setdefault("_de_initial_rows", {})[slot_name] = _initial_row(
                    initializer, wrapper
                )
        return named[key]

    # -- the update -----------------------------------------------------------------------
    def apply_gradients(
        self, grads_and_vars: Any, global_step: Any = None, name: Any = None
    ) -> Any:
        pairs, loaded, loads = [], [], []
        for grad, var in grads_and_vars:
            wrapper = wrapper_of(var)
            if isinstance(wrapper, BatchRows):
                raise VariableError(
                    f"variable '{wrapper.params.name}': its tables live on parameter servers, "
                    "whose steps hold no variable for the batch rows; a tf.compat.v1.train "
                    f"optimizer ({type(self).__name__}) updates only variables. Use a Keras "
                    "optimizer (any of tf.keras.optimizers)"
                )
            if wrapper is not None and grad is not None:
                with tf.init_scope():
                    self._create_slots([wrapper])  # type: ignore[attr-defined]
                # in a graph nothing else orders these reads after the lookup's writes
                with tf.control_dependencies(wrapper.last_load):
                    old = tf.identity(wrapper.read_value())
                    slots, assigns = self._load_slots(wrapper)
                loaded.append((wrapper, old, slots))
                loads += [old, *assigns]
                grad = aggregate(grad, tf.shape(old)[0])  # old: read after the lookup
            pairs.append((grad, var))
        with tf.control_dependencies(loads):
            op = super().apply_gradients(pairs, global_step, name)  # type: ignore[misc]
        writes = []
        with tf.control_dependencies([] if op is None else [op]):
            for wrapper, old, slots in loaded:
                writes += write_back_rows(wrapper, old, slots)
        return op if tf.executing_eagerly() else tf.group(op, *writes)

    def _load_slots(self, wrapper: TrainableWrapper) -> tuple[list[Slot], list[Any]]:
        """Read the batch's rows of every slot from its companion table into the slot
        variable; the slots and the assign ops."""
        initial_rows = self.__dict__.get("_de_initial_rows", {})
        slots, assigns = [], []
        for slot_name in sorted(self.get_slot_names()):  # type: ignore[attr-defined]
            slot = self.get_slot(wrapper, slot_name)  # type: ignore[attr-defined]
            if slot is None:
                continue
            column = slot_column(type(self).__name__, slot_name)
            loaded, assign = load_slot(wrapper, column, slot, initial_rows.get(slot_name))
            slots.append(loaded)
            assigns.append(assign)
        return slots, assigns


def _initial_row(initializer: Any, wrapper: TrainableWrapper) -> np.ndarray | None:
    """The row a slot starts from: ``None`` for zeros.

    ``initializer`` is an initializer of ``shape`` and ``dtype``, or (for a variable of
    unknown shape) a tensor or a function of no arguments filling the wrapper's current
    shape, which has a row from its creation on.
    """
    if initializer is None:
        return None
    if callable(initializer):
        params = wrapper.params
        try:
            initializer = initializer(shape=[1, params.dim], dtype=params.value_dtype)
        except TypeError:
            initializer = initializer()
    if isinstance(initializer, tf.Tensor) and not tf.executing_eagerly():
        return np.full([wrapper.params.dim], _filled_with(initializer))
    return np.asarray(initializer)[0]


def _filled_with(rows: tf.Tensor) -> Any:
    """The value every element of a graph tensor of unknown shape is filled with."""
    op = rows.op
    value = {"OnesLike": 1, "ZerosLike": 0}.get(op.type)
    if value is None and op.type == "Fill":
        value = tf.get_static_value(op.inputs[1])
    if value is None:
        raise ValueError(
            f"slot initializer {rows.name}: expected a constant fill (Fill, OnesLike or "
            f"ZerosLike of a constant), got a {op.type} op"
        )
    return value


@functools.cache
def _extended_class(v1_class: type) -> type:
    return type(v1_class.__name__, (V1Sparse, v1_class), {"__module__": __name__})


def extend(optimizer: Any) -> Any:
    """Make ``optimizer`` (a ``tf.compat.v1.train.Optimizer``) train dynamic embeddings
    too, in place, and return it."""
    optimizer.__class__ = _extended_class(type(optimizer))  # type: ignore[arg-type]
    return optimizer
