"""Record batches of keys, values and extra columns: numpy conversion, checks, splits.

A batch has columns ``key`` (int64, int32 or string), ``value`` (``fixed_size_list`` of the
value dtype, ``dim`` wide) and optional extra columns. bfloat16 has no Arrow type: it is
stored as its raw 16-bit pattern (uint16) and the field's metadata records
``de_store.dtype = bfloat16``, so it comes back bit for bit as ``ml_dtypes.bfloat16``.
The dtype tables and the Arrow schema come from :mod:`._schema`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from de_store.errors import FormatError

from ._schema import (
    DTYPE_KEY,
    KEY_DTYPES,
    PACKED_DTYPES,
    VALUE_DTYPES,
    Key,
    SchemaInfo,
    arrow_schema,
    check_schema_info,
    list_type,
)

__all__ = [
    "DTYPE_KEY",
    "KEY_DTYPES",
    "VALUE_DTYPES",
    "SchemaInfo",
    "arrow_schema",
    "batch_from_numpy",
    "batch_to_numpy",
    "check_schema_info",
    "column_to_numpy",
    "conform",
    "key_range",
    "list_type",
    "select",
    "split",
]


def _dtype_name(array: np.ndarray) -> str:
    if array.dtype.kind in "OUT":
        return "string"
    return str(array.dtype.name)


def _column(
    name: str, array: np.ndarray, with_width: bool, packed: pa.DataType | None = None
) -> tuple[pa.Field, pa.Array]:
    """A numpy column ([n] or [n, w]) as an Arrow field and array, zero-copy if contiguous;
    ``packed``: a ``fixed_size_binary`` type the rows' bytes are stored as."""
    dtype = _dtype_name(array)
    if dtype == "bfloat16":
        array = array.view(np.uint16)
    if packed is not None:
        data = pa.py_buffer(np.ascontiguousarray(array))
        column: pa.Array = pa.Array.from_buffers(packed, len(array), [None, data])
    elif with_width:
        flat = np.ascontiguousarray(array).reshape(-1)
        element = pa.array(flat)
        column = pa.FixedSizeListArray.from_arrays(
            element, type=list_type(element.type, array.shape[1])
        )
    else:
        column = pa.array(array, type=pa.string() if dtype == "string" else None)
    field = pa.field(name, column.type, nullable=False, metadata={DTYPE_KEY: dtype.encode()})
    return field, column


def batch_from_numpy(
    keys: np.ndarray,
    values: np.ndarray,
    extras: Mapping[str, np.ndarray] | None = None,
    *,
    schema: pa.Schema | None = None,
) -> pa.RecordBatch:
    """Build a batch from ``keys [n]``, ``values [n, dim]`` and extra columns.

    Numeric arrays that are C-contiguous are wrapped without copying. An extra column of
    shape ``[n, w]`` becomes a ``fixed_size_list`` column, one of shape ``[n]`` a scalar one;
    a column that ``schema`` types ``fixed_size_binary`` holds each row's bytes (a packed
    dtype, see ``_schema.PACKED_DTYPES``). Every field's metadata records its logical dtype
    (``de_store.dtype``).

    Parameters
    ----------
    keys:
        Integer keys, or strings (``str``/object arrays) for ``key_dtype="string"``.
    values:
        Values, shape ``[n, dim]``; ``ml_dtypes.bfloat16`` is stored as its bit pattern.
    extras:
        Extra columns by name, in order.
    schema:
        When given (e.g. ``SchemaInfo.arrow_schema()``), the batch carries that schema.
    """
    if values.ndim != 2 or len(values) != len(keys):
        raise ValueError(
            f"values must be [n, dim] with n = len(keys) = {len(keys)}, got {values.shape}"
        )
    packed = _packed_types(schema)
    columns = [_column("key", keys, False), _column("value", values, True, packed.get("value"))]
    for name, array in (extras or {}).items():
        if len(array) != len(keys):
            raise ValueError(f"extra column {name!r} has {len(array)} rows, keys have {len(keys)}")
        columns.append(_column(name, array, array.ndim == 2, packed.get(name)))
    arrays = [array for _, array in columns]
    if schema is None:
        schema = pa.schema([field for field, _ in columns])
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _packed_types(schema: pa.Schema | None) -> dict[str, pa.DataType]:
    """The ``fixed_size_binary`` columns of ``schema`` by name (packed rows)."""
    if schema is None:
        return {}
    return {f.name: f.type for f in schema if pa.types.is_fixed_size_binary(f.type)}


def packed_to_numpy(array: pa.Array, dtype: str) -> np.ndarray:
    """A ``fixed_size_binary`` column of rows packed as ``dtype`` elements, as numpy
    ``[n, w]`` (zero-copy; bfloat16 as ``ml_dtypes.bfloat16``)."""
    element = np.dtype("<u2" if dtype == "bfloat16" else dtype).newbyteorder("<")
    width = array.type.byte_width // element.itemsize
    data = array.buffers()[1]
    start = array.offset * array.type.byte_width
    out = np.frombuffer(data, element, count=len(array) * width, offset=start)
    out = out.reshape(len(array), width)
    if dtype == "bfloat16":
        import ml_dtypes

        out = out.view(ml_dtypes.bfloat16)
    return out


def column_to_numpy(array: pa.Array, field: pa.Field) -> np.ndarray:
    """One column as numpy: ``[n]`` or ``[n, w]`` for ``fixed_size_list`` and packed rows;
    bfloat16 restored."""
    logical = (field.metadata or {}).get(DTYPE_KEY, b"").decode()
    if logical in PACKED_DTYPES:
        return packed_to_numpy(array, PACKED_DTYPES[logical])
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        flat = array.flatten().to_numpy(zero_copy_only=False)
        out = flat.reshape(len(array), width)
    elif pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        out = array.to_numpy(zero_copy_only=False)
    else:
        out = array.to_numpy(zero_copy_only=False)
    if logical == "bfloat16":
        import ml_dtypes

        out = out.view(ml_dtypes.bfloat16)
    return out


def batch_to_numpy(
    batch: pa.RecordBatch | pa.Table,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Inverse of :func:`batch_from_numpy`: ``(keys, values, extras)``; zero-copy if possible."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else _empty(batch.schema)
    columns = {f.name: column_to_numpy(batch.column(i), f) for i, f in enumerate(batch.schema)}
    keys, values = columns.pop("key"), columns.pop("value")
    return keys, values, columns


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


def conform(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """``batch`` relabelled with ``schema`` (no copy); FormatError if names or types differ."""
    found = [(f.name, _storage(f.type)) for f in batch.schema]
    wanted = [(f.name, _storage(f.type)) for f in schema]
    if found != wanted:
        raise FormatError(
            f"batch written to {where} does not match the shard's schema: "
            f"expected columns {_describe(wanted)}, found {_describe(found)}"
        )
    for column, field in zip(batch.columns, schema, strict=True):
        nulls = _null_count(column)
        if nulls:
            raise FormatError(
                f"batch written to {where}: column {field.name!r} holds {nulls} null "
                "value(s); shard columns hold no nulls"
            )
    columns = [
        c if c.type == f.type else c.cast(f.type)
        for c, f in zip(batch.columns, schema, strict=True)
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _null_count(column: pa.Array) -> int:
    """Nulls in ``column``, or in the elements of its fixed-size lists."""
    if pa.types.is_fixed_size_list(column.type):
        return int(column.null_count + column.flatten().null_count)
    return int(column.null_count)


def _storage(type_: pa.DataType) -> str:
    """A type as its physical layout, ignoring list element names and nullability."""
    if pa.types.is_fixed_size_list(type_):
        return f"{type_.value_type}[{type_.list_size}]"
    return str(type_)


def _describe(columns: list[tuple[str, str]]) -> str:
    return "[" + ", ".join(f"{n}: {t}" for n, t in columns) + "]"


def split(batch: pa.RecordBatch, rows: int) -> Iterator[pa.RecordBatch]:
    """Zero-copy slices of ``batch`` with at most ``rows`` rows each (none if empty)."""
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


def key_range(keys: pa.Array) -> tuple[Key, Key]:
    """Smallest and largest key, or ``(None, None)`` when empty."""
    if len(keys) == 0:
        return None, None
    result: Any = pc.min_max(keys)
    return result["min"].as_py(), result["max"].as_py()


def select(batch: pa.RecordBatch, columns: list[str] | None, where: str) -> pa.RecordBatch:
    """Only ``columns`` of ``batch``, in that order; FormatError naming a missing one."""
    if columns is None:
        return batch
    missing = [c for c in columns if c not in batch.schema.names]
    if missing:
        raise FormatError(f"{where} has no column {missing}: found {batch.schema.names}")
    return batch.select(columns)
