"""Differentiable lookups: ``embedding_lookup`` and the per-batch ``TrainableWrapper``.

A lookup reads the rows of the batch's unique ids into a dense, trainable ``tf.Variable``
(the wrapper's ``rows``) and gathers the output from it, so ``tf.GradientTape`` sees an
ordinary variable gradient (``IndexedSlices``; duplicate ids aggregate). A de_store
optimizer recognises the wrapper and writes the update back to the tables for those ids.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from de_store.variable import Variable


class TrainableWrapper:
    """The rows, ids and existence flags of the last batch looked up under one name.

    Attributes
    ----------
    params: the :class:`Variable` the rows came from.
    rows: trainable ``[u, dim]`` variable holding the rows of the batch's unique ids.
    ids: ``[u]`` unique ids of the batch.
    existed: ``[u]`` whether each id was in the table at lookup time.
    """

    def __init__(self, params: Variable, name: str) -> None:
        self.params = params
        device = params.devices[0]
        with tf.init_scope():
            with tf.device(device):
                self.rows = tf.Variable(
                    tf.zeros([0, params.dim], params.value_dtype),
                    shape=tf.TensorShape([None, params.dim]),
                    trainable=params.trainable,
                    name=f"{params.name}/{name}/rows".replace(":", "_"),
                )
                self.existed = tf.Variable(
                    tf.zeros([0], tf.bool), shape=tf.TensorShape([None]), trainable=False
                )
            with tf.device("/device:CPU:0" if params.key_dtype == tf.string else device):
                self.ids = tf.Variable(
                    tf.zeros([0], params.key_dtype), shape=tf.TensorShape([None]), trainable=False
                )
        self.rows._de_store_wrapper = self  # type: ignore[attr-defined]

    def load(self, unique_ids: tf.Tensor) -> None:
        """Read the rows of ``unique_ids`` from the tables into ``rows``."""
        values, existed = self.params.lookup(unique_ids, return_exists=True)
        self.ids.assign(unique_ids)
        self.existed.assign(existed)
        self.rows.assign(values)


def trainable_wrapper(params: Variable, name: str = "lookup") -> TrainableWrapper:
    """Get or create the wrapper of ``params`` for lookups called ``name``."""
    wrappers: dict[str, TrainableWrapper] = params._wrappers  # type: ignore[attr-defined]
    wrapper = wrappers.get(name)
    if wrapper is None:
        wrapper = wrappers[name] = TrainableWrapper(params, name)
    return wrapper


def wrapper_of(variable: Any) -> TrainableWrapper | None:
    """The :class:`TrainableWrapper` whose ``rows`` is ``variable``, else ``None``."""
    return getattr(variable, "_de_store_wrapper", None)


def embedding_lookup(
    params: Variable,
    ids: Any,
    name: str = "lookup",
    max_norm: float | None = None,
    return_trainable: bool = False,
) -> Any:
    """Look ``ids`` up in ``params``, differentiably; shape ``ids.shape + [dim]``.

    Parameters
    ----------
    params:
        The dynamic embedding :class:`~de_store.Variable`.
    ids:
        Keys of any shape, of ``params.key_dtype``.
    name:
        Lookups with different names keep separate batch rows, so several lookups (or
        workers) on one Variable can be trained in one step.
    max_norm:
        If set, rows whose L2 norm exceeds it are scaled down to it (in the output only).
    return_trainable:
        Also return the :class:`TrainableWrapper` whose ``rows`` receives the gradient.
    """
    ids = params._keys(ids)
    unique_ids, positions = tf.unique(tf.reshape(ids, [-1]), out_idx=tf.int32)
    wrapper = trainable_wrapper(params, name)
    wrapper.load(unique_ids)
    flat = tf.gather(wrapper.rows, positions)
    if max_norm is not None:
        flat = tf.clip_by_norm(flat, max_norm, axes=[1])
    out = tf.reshape(flat, tf.concat([tf.shape(ids), [params.dim]], axis=0))
    return (out, wrapper) if return_trainable else out
