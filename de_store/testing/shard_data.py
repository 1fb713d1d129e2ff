"""Rows for shard format tests: distinct keys and random values of every supported dtype,
and exact comparison of what was read back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pyarrow as pa

from de_store.formats import batch_to_numpy


def make_keys(n: int, key_dtype: str, seed: int = 0) -> np.ndarray:
    """``n`` distinct keys, negative and beyond 2**31 for int64."""
    rng = np.random.default_rng(seed)
    if key_dtype == "string":
        return np.array([f"feature/{i}:{rng.integers(1 << 40)}" for i in range(n)], dtype=object)
    info = np.iinfo(key_dtype)
    keys = rng.choice(np.arange(-(n * 50), n * 50), n, replace=False) if n else np.array([])
    if key_dtype == "int64":
        keys = keys * (info.max // (n * 50 + 1))
    return keys.astype(key_dtype)


def make_values(n: int, dim: int, dtype: str, seed: int = 1) -> np.ndarray:
    """``[n, dim]`` values of ``dtype`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
    rng = np.random.default_rng(seed)
    if dtype in ("int32", "int64", "int8", "uint8"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, (n, dim), dtype=dtype, endpoint=True)
    values = rng.standard_normal((n, dim)) * 3
    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality, bit for bit for floats (dtype included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "O":
        return bool(np.array_equal(a, b))
    return bool(np.array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")))


def concat(batches: list[pa.RecordBatch]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Batches read back as one ``(keys, values, extras)`` triple."""
    table = pa.Table.from_batches(batches) if batches else None
    if table is None:
        raise AssertionError("no batches")
    return batch_to_numpy(table)
