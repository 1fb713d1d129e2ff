"""The Variables :func:`~de_store.variable.get_variable` made, by variable-scoped name.

As TFRA's, variables are kept per graph (eager code shares one; a new ``tf.Graph`` starts
without any) and only while they are alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from de_store.errors import VariableError

#: graph -> name -> Variable
_REGISTRY: weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def scoped_name(name: str, short_file_name: bool) -> str:
    """``name`` prefixed by the enclosing ``tf.compat.v1.variable_scope`` names (not by
    ``tf.name_scope``; not at all with ``short_file_name``)."""
    scope = tf.compat.v1.get_variable_scope()
    return f"{scope.name}/{name}" if scope.name and not short_file_name else name


def existing_variable(full_name: str, key_dtype: Any, value_dtype: Any, dim: int) -> Any:
    """The live Variable called ``full_name`` in the current graph, or None.

    Raises
    ------
    ValueError
        It exists and the variable scope says ``reuse=False`` in a graph (TFRA's message).
    VariableError
        It exists with another ``key_dtype``, ``value_dtype`` or ``dim``.
    """
    variables, eager = _graph_variables()
    existing = variables.get(full_name)
    if existing is None:
        return None
    if tf.compat.v1.get_variable_scope().reuse is False and not eager:
        raise ValueError(
            f"Variable {full_name} already exists, disallowed. Did you mean to set "
            "reuse=True or reuse=tf.AUTO_REUSE in VarScope?"
        )
    _check_same(existing, tf.as_dtype(key_dtype), tf.as_dtype(value_dtype), dim)
    return existing


def register(full_name: str, variable: Any) -> None:
    """Keep ``variable`` as the current graph's ``full_name`` while it is alive."""
    variables, _ = _graph_variables()
    variables[full_name] = variable


def _graph_variables() -> tuple[weakref.WeakValueDictionary[str, Any], bool]:
    """The current graph's variables by name, and whether it runs eagerly (both outside
    any ``tf.function`` being traced)."""
    with tf.init_scope():
        graph = tf.compat.v1.get_default_graph()
        eager = tf.executing_eagerly()
    return _REGISTRY.setdefault(graph, weakref.WeakValueDictionary()), eager


def _check_same(existing: Any, key_dtype: tf.DType, value_dtype: tf.DType, dim: int) -> None:
    asked = (key_dtype.name, value_dtype.name, dim)
    held = (existing.key_dtype.name, existing.value_dtype.name, existing.dim)
    if asked != held:
        raise VariableError(
            f"variable '{existing.name}' exists with (key_dtype, value_dtype, dim) = {held}; "
            f"get_variable asked for {asked}"
        )
