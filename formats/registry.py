"""Shard format registry: a name maps to a lazily imported class."""

from __future__ import annotations

import importlib
from typing import Any

from .base import ShardFormat

#: Format name -> "module:Class" (modules relative to de_store.formats).
FORMATS: dict[str, str] = {
    "parquet": "parquet:ParquetFormat",
    "arrow": "arrow:ArrowFormat",
    "binary": "binary:BinaryFormat",
}


def format_class(name: str) -> type[ShardFormat]:
    """The :class:`ShardFormat` class registered as ``name``.

    Raises
    ------
    ValueError
        ``name`` is not a registered format; the message lists the known ones.
    """
    try:
        target = FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown shard format {name!r}; known formats: {sorted(FORMATS)}"
        ) from None
    module, _, attr = target.partition(":")
    cls: type[ShardFormat] = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
    return cls


def get_format(name: str, **options: Any) -> ShardFormat:
    """An instance of format ``name`` built with ``options`` (e.g. ``compression="zstd"``)."""
    return format_class(name)(**options)
