"""The saver: sharded KV checkpoints with a merged manifest and an atomic commit.

The data path, and back:  table -> export rows -> shard format -> backend -> rank manifest
-> barrier -> merged manifest -> commit  (see :mod:`de_store.saver.core`).

The public names are imported on first use: the modules that only read checkpoints
(``commit``, ``manifest``, ``gc``, ``verify``) work without importing TensorFlow. The TF
checkpoint saver (:mod:`de_store.saver.tf_hook`) is registered when ``de_store.variable``
is imported, i.e. before any Variable exists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from de_store.saver.api import SaveHandle, restore, save
    from de_store.saver.filesystem_saver import FileSystemSaver

_LAZY_NAMES = {
    "FileSystemSaver": "de_store.saver.filesystem_saver",
    "SaveHandle": "de_store.saver.api",
    "restore": "de_store.saver.api",
    "save": "de_store.saver.api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        importlib.import_module("de_store.saver.tf_hook")  # registers the TF checkpoint saver
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'de_store.saver' has no attribute {name!r}")


__all__ = ["FileSystemSaver", "SaveHandle", "restore", "save"]
