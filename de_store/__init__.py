"""Dynamic embedding tables for TensorFlow with fast, safe checkpoints.

The TensorFlow-dependent names are imported on first use, so the ``de-store`` command and
tools that only read checkpoints (``de_store.backends``, ``de_store.formats``) start without
importing TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

try:
    __version__ = importlib.metadata.version("de_store")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    __version__ = "0+unknown"

from de_store.errors import (
    AlreadyExistsError,
    BackendError,
    BarrierTimeoutError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    DestinationError,
    DeStoreError,
    FormatError,
    GCRefusedError,
    MissingDependencyError,
    RepeatedKeysError,
    SaveInterruptedError,
    StorageNotFoundError,
    StorageOptionError,
    StorageUnreachableError,
    TableError,
    UnknownProtocolError,
    VariableError,
)

if TYPE_CHECKING:
    from de_store._variable_args import InvalidValuesError
    from de_store.compaction import compact
    from de_store.embedding import TrainableWrapper, embedding_lookup, trainable_wrapper_filter
    from de_store.following import Follower, follow
    from de_store.modes import ModelMode, enable_inference_mode, enable_train_mode, get_model_mode
    from de_store.optimizers import DynamicEmbeddingOptimizer
    from de_store.partition import default_partition_fn
    from de_store.restrict import (
        FrequencyRestrictPolicy,
        RestrictPolicy,
        TimestampRestrictPolicy,
    )
    from de_store.saver import FileSystemSaver, SaveHandle, restore, save
    from de_store.saver.incremental import IncrementalPolicy
    from de_store.sparse_lookup import (
        embedding_lookup_sparse,
        embedding_lookup_unique,
        safe_embedding_lookup_sparse,
    )
    from de_store.table_creators import CuckooHashTableCreator, HashTableCreator
    from de_store.variable import Variable, get_variable

#: public name -> module that defines it (imported on first access)
_LAZY_NAMES = {
    "TrainableWrapper": "de_store.embedding",
    "embedding_lookup": "de_store.embedding",
    "ModelMode": "de_store.modes",
    "enable_inference_mode": "de_store.modes",
    "enable_train_mode": "de_store.modes",
    "get_model_mode": "de_store.modes",
    "DynamicEmbeddingOptimizer": "de_store.optimizers",
    "embedding_lookup_sparse": "de_store.sparse_lookup",
    "embedding_lookup_unique": "de_store.sparse_lookup",
    "safe_embedding_lookup_sparse": "de_store.sparse_lookup",
    "default_partition_fn": "de_store.partition",
    "FrequencyRestrictPolicy": "de_store.restrict",
    "RestrictPolicy": "de_store.restrict",
    "TimestampRestrictPolicy": "de_store.restrict",
    "FileSystemSaver": "de_store.saver",
    "IncrementalPolicy": "de_store.saver.incremental",
    "compact": "de_store.compaction",
    "follow": "de_store.following",
    "Follower": "de_store.following",
    "SaveHandle": "de_store.saver",
    "restore": "de_store.saver",
    "save": "de_store.saver",
    "HashTableCreator": "de_store.table_creators",
    "CuckooHashTableCreator": "de_store.table_creators",
    "trainable_wrapper_filter": "de_store.embedding",
    "Variable": "de_store.variable",
    "get_variable": "de_store.variable",
    "InvalidValuesError": "de_store._variable_args",  # also TensorFlow's InvalidArgumentError
}
_LAZY_SUBMODULES = ("keras", "optimizers")  # import keras only when asked for


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"de_store.{name}")
    raise AttributeError(f"module 'de_store' has no attribute {name!r}")


def _alias_compact_module() -> None:
    """Make ``from de_store.compact import compact`` reach :mod:`de_store.compaction`.

    A submodule named ``de_store.compact`` would replace the function ``de_store.compact``
    when imported (Python's import system sets it on the package), so the compaction
    module is registered under both names up front, loaded on first use; an import of
    either name then finds it and sets nothing on the package.
    """
    spec = importlib.util.find_spec("de_store.compaction")
    if spec is None or spec.loader is None:
        return
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["de_store.compaction"] = sys.modules["de_store.compact"] = module
    globals()["compaction"] = module
    loader.exec_module(module)


_alias_compact_module()


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_NAMES, *_LAZY_SUBMODULES])


__all__ = [
    "compact",
    "follow",
    "Follower",
    "default_partition_fn",
    "DynamicEmbeddingOptimizer",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "embedding_lookup_unique",
    "enable_inference_mode",
    "enable_train_mode",
    "FileSystemSaver",
    "FrequencyRestrictPolicy",
    "get_model_mode",
    "get_variable",
    "CuckooHashTableCreator",
    "HashTableCreator",
    "IncrementalPolicy",
    "ModelMode",
    "restore",
    "RestrictPolicy",
    "safe_embedding_lookup_sparse",
    "save",
    "SaveHandle",
    "TimestampRestrictPolicy",
    "TrainableWrapper",
    "trainable_wrapper_filter",
    "Variable",
    "__version__",
    # errors (de_store.errors; docs/errors.md says when each is raised)
    "AlreadyExistsError",
    "BackendError",
    "BarrierTimeoutError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "DestinationError",
    "DeStoreError",
    "FormatError",
    "GCRefusedError",
    "InvalidValuesError",
    "MissingDependencyError",
    "RepeatedKeysError",
    "SaveInterruptedError",
    "StorageNotFoundError",
    "StorageOptionError",
    "StorageUnreachableError",
    "TableError",
    "UnknownProtocolError",
    "VariableError",
]
