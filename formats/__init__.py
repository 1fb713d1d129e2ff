"""Shard formats: Parquet, Arrow IPC, raw binary (TFRA layout).

Get one by name with :func:`get_format`; the contract is :class:`ShardFormat`. Batches are
Arrow record batches with columns ``key``, ``value`` and optional extra columns; build them
from numpy with :func:`batch_from_numpy` and back with :func:`batch_to_numpy`.
:mod:`de_store.formats.tfra` imports and exports TFRA 0.8.1 checkpoint folders.
"""

from .base import (
    DEFAULT_BUFFER_SIZE,
    FORMAT_VERSION,
    ByteRange,
    ExtraColumn,
    FileInfo,
    PartInfo,
    SchemaInfo,
    ShardFormat,
    ShardInfo,
)
from .batches import arrow_schema, batch_from_numpy, batch_to_numpy
from .registry import FORMATS, format_class, get_format

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "FORMATS",
    "FORMAT_VERSION",
    "ByteRange",
    "ExtraColumn",
    "FileInfo",
    "PartInfo",
    "SchemaInfo",
    "ShardFormat",
    "ShardInfo",
    "arrow_schema",
    "batch_from_numpy",
    "batch_to_numpy",
    "format_class",
    "get_format",
]
