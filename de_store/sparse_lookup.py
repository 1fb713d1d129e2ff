"""Sparse and unique lookups with TFRA's names and signatures.

Each looks the distinct ids up once through :func:`de_store.embedding_lookup` (so the
gradient reaches one :class:`~de_store.TrainableWrapper`) and combines the rows with
TensorFlow's own dense-table functions on positions into those rows: the combiners
(``sum``, ``mean``, ``sqrtn``), weights and ``max_norm`` mean exactly what they mean in
``tf.nn.embedding_lookup_sparse``. ``safe_embedding_lookup_sparse`` follows TFRA: every id
is a valid key (negative ones too), weights ``<= 0`` are dropped unless ``combiner`` is
``"sum"``, an empty row looks up ``default_id`` (or key 0) and, without ``default_id``,
gives zeros; ids of rank above 2 are flattened to rank 2 and the result shaped back.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from de_store.embedding import embedding_lookup
from de_store.variable import Variable

_COMBINERS = ("mean", "sqrtn", "sum")


def embedding_lookup_sparse(
    params: Variable,
    sp_ids: tf.SparseTensor,
    sp_weights: tf.SparseTensor | None,
    partition_strategy: Any = None,
    name: str = "embedding_lookup_sparse",
    combiner: str = "mean",
    max_norm: float | None = None,
    return_trainable: bool = False,
) -> Any:
    """Combine the rows of each row of ``sp_ids`` ``[d0, d1]`` into one: ``[d0, dim]``.

    ``sp_weights`` (same indices as ``sp_ids``, or ``None`` for weight 1) scale the rows;
    ``combiner`` is ``"sum"``, ``"mean"`` (weighted mean) or ``"sqrtn"`` (weighted sum
    divided by the root of the sum of squared weights).
    """
    del partition_strategy
    _check_sparse(params, sp_ids, sp_weights, combiner)
    unique_ids, positions = tf.unique(sp_ids.values, out_idx=tf.int64)
    rows, wrapper = embedding_lookup(
        params, unique_ids, name=name, max_norm=max_norm, return_trainable=True
    )
    if rows.dtype in (tf.float16, tf.bfloat16):
        rows = tf.cast(rows, tf.float32)
    local = tf.SparseTensor(sp_ids.indices, positions, sp_ids.dense_shape)
    out = tf.nn.embedding_lookup_sparse(rows, local, sp_weights, combiner=combiner)
    return (out, wrapper) if return_trainable else out


def safe_embedding_lookup_sparse(
    embedding_weights: Variable,
    sparse_ids: tf.SparseTensor,
    sparse_weights: tf.SparseTensor | None = None,
    combiner: str = "mean",
    default_id: Any = None,
    name: str = "safe_embedding_lookup_sparse",
    partition_strategy: Any = None,
    max_norm: float | None = None,
    return_trainable: bool = False,
) -> Any:
    """:func:`embedding_lookup_sparse` for ids of any rank ``>= 2`` ``[d0, ..., dn]``,
    with empty rows allowed: the result is ``[d0, ..., d(n-1), dim]``."""
    del partition_strategy
    _check_sparse(embedding_weights, sparse_ids, sparse_weights, combiner)
    shape = tf.cast(sparse_ids.dense_shape, tf.int64)
    rank = tf.size(shape)
    flat_shape = tf.stack([tf.reduce_prod(shape[:-1]), shape[-1]])
    sparse_ids = tf.sparse.reshape(sparse_ids, flat_shape)
    if sparse_weights is not None:
        sparse_weights = tf.SparseTensor(sparse_ids.indices, sparse_weights.values, flat_shape)
        if combiner != "sum":
            valid = sparse_weights.values > 0
            sparse_ids = tf.sparse.retain(sparse_ids, valid)
            sparse_weights = tf.sparse.retain(sparse_weights, valid)
    fill = tf.constant(default_id or 0, sparse_ids.dtype)
    sparse_ids, empty = tf.sparse.fill_empty_rows(sparse_ids, fill)
    if sparse_weights is not None:
        sparse_weights, _ = tf.sparse.fill_empty_rows(
            sparse_weights, tf.constant(1, sparse_weights.dtype)
        )
    result, wrapper = embedding_lookup_sparse(
        embedding_weights,
        sparse_ids,
        sparse_weights,
        name=f"{name}/embedding_lookup_sparse",
        combiner=combiner,
        max_norm=max_norm,
        return_trainable=True,
    )
    if default_id is None:
        result = tf.where(empty[:, None], tf.zeros_like(result), result)
    out_shape = tf.concat([tf.cast(shape[: rank - 1], tf.int32), tf.shape(result)[1:]], 0)
    out = tf.reshape(result, out_shape)
    return (out, wrapper) if return_trainable else out


def embedding_lookup_unique(
    params: Variable,
    ids: Any,
    partition_strategy: Any = None,
    name: str | None = None,
    validate_indices: Any = None,
    max_norm: float | None = None,
    return_trainable: bool = False,
) -> Any:
    """:func:`de_store.embedding_lookup` (which looks each distinct id up once already),
    under TFRA's name and signature: ``ids.shape + [dim]``."""
    return embedding_lookup(
        params, ids, partition_strategy, name, validate_indices, max_norm, return_trainable
    )


def _check_sparse(params: Any, ids: Any, weights: Any, combiner: str) -> None:
    where = f"variable '{getattr(params, 'name', params)}'"
    if combiner not in _COMBINERS:
        raise ValueError(
            f"{where}: combiner must be one of 'mean', 'sqrtn' or 'sum', got {combiner!r}"
        )
    if not isinstance(ids, tf.SparseTensor):
        raise TypeError(f"{where}: sparse ids must be a tf.SparseTensor, got {type(ids).__name__}")
    if weights is not None and not isinstance(weights, tf.SparseTensor):
        raise TypeError(
            f"{where}: sparse weights must be None or a tf.SparseTensor, "
            f"got {type(weights).__name__}"
        )
