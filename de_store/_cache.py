"""The cache directory of traced kernels (nothing in it is ever needed).

A new process pays for tracing a table's kernels before their first call; the traced
kernels are kept here so that later processes load them instead
(:mod:`de_store.tables._kernel_cache`). Only de_store's own kernels are kept: TensorFlow's
settings are left as they are. Bulk calls (big inserts, restores, saves) run their ops one
by one and need no trace, and their XLA compiles run in the background
(:mod:`de_store.tables._xla`); a user who wants TensorFlow to keep XLA executables across
processes sets ``TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=<dir>`` before starting
TensorFlow, for every XLA compile of the process, a choice of their own.

The directory is ``$DE_STORE_CACHE_DIR``, by default ``de_store`` under
``$XDG_CACHE_HOME`` or ``~/.cache``; ``DE_STORE_CACHE_DIR=off`` turns the cache off.
Deleting it costs the next process its traces, nothing else.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_root"]

_OFF = ("", "off", "0", "false", "none")


def cache_root() -> pathlib.Path | None:
    """The cache directory, or ``None`` when the cache is off."""
    root = os.environ.get("DE_STORE_CACHE_DIR")
    if root is not None:
        return None if root.strip().lower() in _OFF else pathlib.Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "de_store"
