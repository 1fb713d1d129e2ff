"""Dynamic embedding tables for TensorFlow with fast, safe checkpoints."""

from __future__ import annotations

import importlib
from typing import Any

from de_store.embedding import TrainableWrapper, embedding_lookup
from de_store.partition import default_partition_fn
from de_store.restrict import FrequencyRestrictPolicy, RestrictPolicy, TimestampRestrictPolicy
from de_store.saver import FileSystemSaver, SaveHandle, restore, save
from de_store.variable import HashTableCreator, Variable, get_variable

_LAZY_SUBMODULES = ("keras", "optimizers")  # import keras only when asked for


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"de_store.{name}")
    raise AttributeError(f"module 'de_store' has no attribute {name!r}")


__all__ = [
    "FileSystemSaver",
    "SaveHandle",
    "restore",
    "save",
    "FrequencyRestrictPolicy",
    "HashTableCreator",
    "RestrictPolicy",
    "TimestampRestrictPolicy",
    "TrainableWrapper",
    "Variable",
    "default_partition_fn",
    "embedding_lookup",
    "get_variable",
]
