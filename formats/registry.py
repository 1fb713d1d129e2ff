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


def compressed_format(
    name: str, compression: str = "none", level: int | None = None
) -> ShardFormat:
    """An instance of format ``name`` writing with the codec ``compression`` at ``level``
    (None: the codec's default).

    Raises
    ------
    ValueError
        The format offers no such codec (the message names the format and what it
        offers), or a level is given without a codec.
    """
    cls = format_class(name)
    if compression not in cls.compressions:
        raise ValueError(
            f"shard format {name!r} has no compression {compression!r}: it offers "
            f"{list(cls.compressions)}"
        )
    if compression == "none":
        if level is not None:
            raise ValueError(f"compression_level {level!r} needs a compression, got 'none'")
        return cls()
    return cls(compression=compression, compression_level=level)  # type: ignore[call-arg]
