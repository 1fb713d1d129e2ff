"""What a shard holds and how it maps to Arrow: dtype tables, schema, schema checks.

The lowest module of the formats: ``base`` (the contract and its records) and ``batches``
(numpy conversion, batch checks) both build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

#: Version of the layout and metadata de_store writes; stored in every shard's metadata.
FORMAT_VERSION = 1

Key = int | str | None


@dataclasses.dataclass(frozen=True)
class ExtraColumn:
    """An extra column stored next to ``key`` and ``value`` (optimizer slot, status).

    Attributes
    ----------
    name:
        Column name, e.g. ``"adam_m"`` or ``"timestamp"``.
    dtype:
        Logical dtype name (see :data:`VALUE_DTYPES`).
    width:
        Values per row (a ``fixed_size_list`` column), or None for one scalar per row.
    """

    name: str
    dtype: str
    width: int | None = None


@dataclasses.dataclass(frozen=True)
class SchemaInfo:
    """What a shard holds: the variable, its dim and dtypes, and its extra columns.

    Attributes
    ----------
    name:
        Variable name (stored in the shard's metadata).
    dim:
        Values per key.
    key_dtype:
        ``"int64"``, ``"int32"`` or ``"string"``.
    value_dtype:
        ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``, ``"int32"`` or ``"int64"``.
    shard_id:
        Index of this shard among the variable's shards (stored in the metadata).
    extras:
        Extra columns, in order, after ``key`` and ``value``.
    """

    name: str
    dim: int
    key_dtype: str = "int64"
    value_dtype: str = "float32"
    shard_id: int = 0
    extras: tuple[ExtraColumn, ...] = ()

    def __post_init__(self) -> None:
        check_schema_info(self)

    @property
    def columns(self) -> tuple[str, ...]:
        """Column names in order."""
        return ("key", "value", *(e.name for e in self.extras))

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema of the batches (bfloat16 stored as uint16, see ``batches``)."""
        return arrow_schema(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchemaInfo:
        """Inverse of :meth:`to_dict`."""
        extras = tuple(ExtraColumn(**e) for e in data.get("extras", ()))
        return cls(**{**data, "extras": extras})


#: Key dtype name -> Arrow type.
KEY_DTYPES: dict[str, pa.DataType] = {
    "int64": pa.int64(),
    "int32": pa.int32(),
    "string": pa.string(),
}
#: Value (and extra column) dtype name -> Arrow storage type.
VALUE_DTYPES: dict[str, pa.DataType] = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float64": pa.float64(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "packed_int8": pa.int8(),
    "packed_float16": pa.float16(),
    "packed_bfloat16": pa.uint16(),
}
#: Packed dtype -> the dtype of its elements. A column of a packed dtype holds each row's
#: ``width`` elements as one ``fixed_size_binary(width * element size)`` value, their
#: little-endian bytes: Parquet then stores them at their width, where a list of int8 or
#: uint16 would take 4 bytes an element (Parquet's smallest integer is 32 bits). Values
#: stored at a lower precision use them (:mod:`de_store.formats.precision`).
PACKED_DTYPES: dict[str, str] = {
    "packed_int8": "int8",
    "packed_float16": "float16",
    "packed_bfloat16": "bfloat16",
}
#: Field metadata key holding the logical dtype.
DTYPE_KEY = b"de_store.dtype"


def check_schema_info(info: SchemaInfo) -> None:
    """Raise ValueError for an unknown dtype, a bad dim or clashing column names."""
    if info.key_dtype not in KEY_DTYPES:
        raise ValueError(
            f"key_dtype {info.key_dtype!r} of {info.name!r} is not one of {list(KEY_DTYPES)}"
        )
    for what, count in (("dim", info.dim), *((e.name, e.width) for e in info.extras if e.width)):
        if not is_count(count, 1):
            raise ValueError(f"{what} of {info.name!r} must be an integer >= 1, got {count!r}")
    for dtype in (info.value_dtype, *(e.dtype for e in info.extras)):
        if dtype not in VALUE_DTYPES:
            raise ValueError(f"dtype {dtype!r} in {info.name!r} is not one of {list(VALUE_DTYPES)}")
    names = info.columns
    if len(set(names)) != len(names):
        raise ValueError(f"column names of {info.name!r} repeat: {names}")


def is_count(value: object, least: int = 0, below: int | None = None) -> bool:
    """``value`` is an integer (not a bool, not a float) in ``[least, below)``: what a
    count, size or index read from storage must be before anything uses it."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= least
            and (below is None or value < below))  # fmt: skip


def column_row_bytes(info: SchemaInfo) -> list[int]:
    """Bytes a row takes in each column (key, value, extras) when stored uncompressed at
    fixed width: the element's size times the values a row; a string key counts the
    4-byte offset or length that Arrow and Parquet store for each string at least."""
    key = 4 if info.key_dtype == "string" else KEY_DTYPES[info.key_dtype].byte_width
    columns = [(info.value_dtype, info.dim), *((e.dtype, e.width or 1) for e in info.extras)]
    return [key, *(VALUE_DTYPES[dtype].byte_width * width for dtype, width in columns)]


def list_type(storage: pa.DataType, width: int) -> pa.DataType:
    """``fixed_size_list`` of non-null elements: Parquet then needs no definition levels."""
    return pa.list_(pa.field("element", storage, nullable=False), width)


def _field(name: str, dtype: str, width: int | None) -> pa.Field:
    storage = VALUE_DTYPES.get(dtype) or KEY_DTYPES[dtype]
    if dtype in PACKED_DTYPES:
        type_ = pa.binary(storage.byte_width * (width or 1))
    else:
        type_ = storage if width is None else list_type(storage, width)
    return pa.field(name, type_, nullable=False, metadata={DTYPE_KEY: dtype.encode()})


def arrow_schema(info: SchemaInfo) -> pa.Schema:
    """The Arrow schema for ``info``, with de_store's metadata (name, dim, dtypes, ...)."""
    fields = [_field("key", info.key_dtype, None), _field("value", info.value_dtype, info.dim)]
    fields += [_field(e.name, e.dtype, e.width) for e in info.extras]
    metadata = {
        "de_store.variable": info.name,
        "de_store.dim": str(info.dim),
        "de_store.key_dtype": info.key_dtype,
        "de_store.value_dtype": info.value_dtype,
        "de_store.shard_id": str(info.shard_id),
        "de_store.format_version": str(FORMAT_VERSION),
    }
    return pa.schema(fields, metadata=metadata)
