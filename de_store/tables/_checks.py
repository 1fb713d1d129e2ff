"""Input validation shared by the table cores.

Static facts (dtype, rank, row width, known lengths) are checked in Python and raise
``TypeError``/``ValueError`` at once; a length only known at run time is checked by a
``tf.debugging`` assertion that callers run before any mutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

SUPPORTED_VALUE_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64, tf.int32, tf.int64)


def check_config(
    name: str,
    key_dtype: tf.DType,
    value_dtype: tf.DType,
    dim: int,
    key_dtypes: tuple[tf.DType, ...],
) -> None:
    """Reject an unsupported key dtype, value dtype or row width at construction."""
    if key_dtype not in key_dtypes:
        allowed = ", ".join(d.name for d in key_dtypes)
        raise TypeError(f"table {name!r}: key dtype must be one of {allowed}, got {key_dtype.name}")
    if value_dtype not in SUPPORTED_VALUE_DTYPES:
        allowed = ", ".join(d.name for d in SUPPORTED_VALUE_DTYPES)
        raise TypeError(
            f"table {name!r}: value dtype must be one of {allowed}, got {value_dtype.name}"
        )
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"table {name!r}: dim must be an int >= 1, got {dim!r}")


def check_sizing(name: str, max_load_factor: float, row_growth: float) -> None:
    """Reject a load factor outside ``[0.1, 0.9]`` or a row growth of at most 1."""
    if not 0.1 <= max_load_factor <= 0.9:
        raise ValueError(
            f"table {name!r}: max_load_factor must be in [0.1, 0.9], got {max_load_factor}"
        )
    if row_growth <= 1.0:
        raise ValueError(f"table {name!r}: row_growth must be > 1, got {row_growth}")


def check_keys(name: str, key_dtype: tf.DType, keys: Any) -> tf.Tensor:
    """Return ``keys`` as a rank-1 tensor of ``key_dtype`` or raise naming the table."""
    keys = tf.convert_to_tensor(keys, dtype_hint=key_dtype)
    if keys.dtype != key_dtype:
        raise TypeError(
            f"table {name!r}: expected keys of dtype {key_dtype.name}, got {keys.dtype.name}"
        )
    if keys.shape.rank != 1:
        raise ValueError(f"table {name!r}: expected keys of shape [n], got shape {keys.shape}")
    return keys


def check_rows(
    name: str, value_dtype: tf.DType, dim: int, keys: tf.Tensor, rows: Any, what: str = "values"
) -> tuple[tf.Tensor, list[tf.Operation]]:
    """Return ``rows`` as a ``[n, dim]`` tensor and the run-time length assertions.

    The assertions (empty when both lengths are statically known) must run before the
    table is changed.
    """
    rows = tf.convert_to_tensor(rows, dtype_hint=value_dtype)
    if rows.dtype != value_dtype:
        raise TypeError(
            f"table {name!r}: expected {what} of dtype {value_dtype.name}, got {rows.dtype.name}"
        )
    if rows.shape.rank != 2 or rows.shape[1] not in (None, dim):
        raise ValueError(
            f"table {name!r}: expected {what} of shape [n, {dim}], got shape {rows.shape}"
        )
    n_keys, n_rows = keys.shape[0], rows.shape[0]
    if n_keys is not None and n_rows is not None:
        if n_keys != n_rows:
            raise ValueError(
                f"table {name!r}: expected as many {what} rows as keys ({n_keys}), got {n_rows}"
            )
        return rows, []
    shape_rows = tf.shape(rows, out_type=tf.int64)
    message = f"table {name!r}: expected {what} of shape [n_keys, {dim}]"
    checks = [
        tf.debugging.assert_equal(tf.size(keys, out_type=tf.int64), shape_rows[0], message=message),
        tf.debugging.assert_equal(shape_rows[1], tf.constant(dim, tf.int64), message=message),
    ]
    return rows, [c for c in checks if c is not None]


def default_rows(
    name: str, value_dtype: tf.DType, dim: int, n: tf.Tensor, default_value: Any
) -> tf.Tensor:
    """Broadcast ``default_value`` (None, scalar, ``[dim]`` or ``[n, dim]``) to ``[n, dim]``."""
    shape = tf.stack([tf.cast(n, tf.int64), tf.constant(dim, tf.int64)])
    if default_value is None:
        return tf.zeros(shape, value_dtype)
    default = tf.convert_to_tensor(default_value, dtype_hint=value_dtype)
    if default.dtype != value_dtype:
        raise TypeError(
            f"table {name!r}: expected a default value of dtype {value_dtype.name}, "
            f"got {default.dtype.name}"
        )
    if default.shape.rank is not None and (
        default.shape.rank > 2 or (default.shape.rank >= 1 and default.shape[-1] not in (None, dim))
    ):
        raise ValueError(
            f"table {name!r}: expected a default value that broadcasts to [n, {dim}], "
            f"got shape {default.shape}"
        )
    return tf.broadcast_to(default, shape)


def table_name(name: str) -> str:
    """A ``tf.Module``-safe identifier derived from a free-form table name."""
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"t_{cleaned}"


def snapshot_batches(
    name: str, snapshot: tuple[tf.Tensor, tf.Tensor], batch_size: int
) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
    """Split an already-taken ``(keys, values)`` snapshot into batches.

    The snapshot is taken by the caller before this generator is created, so the batches
    do not see later changes to the table.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"table {name!r}: batch_size must be an int >= 1, got {batch_size!r}")
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"table {name!r}: export() iterates in Python; inside tf.function use export_all()"
        )
    keys, values = snapshot
    return _slices(keys, values, batch_size)


def _slices(
    keys: tf.Tensor, values: tf.Tensor, batch_size: int
) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
    total = int(keys.shape[0])
    for start in range(0, total, batch_size):
        yield keys[start : start + batch_size], values[start : start + batch_size]
