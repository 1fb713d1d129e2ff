"""``FileSystemSaver``: TFRA's saver, plugged in through ``kv_creator``.

``de_store.HashTableCreator(saver=FileSystemSaver(...))`` makes every variable it creates
save its tables through this saver whenever TensorFlow saves a checkpoint or SavedModel
(see :mod:`de_store.saver.tf_hook`). Only the KV data's location goes into TF's bundle.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

from de_store.formats import FORMATS
from de_store.saver.barrier import Barrier
from de_store.saver.core import IOOptions
from de_store.saver.topology import Topology, detect_topology

#: Folder beside a TF checkpoint that holds its KV data when no ``save_path`` is given.
DEFAULT_KV_FOLDER = "de_store"


class FileSystemSaver:
    """Saves the keys and values of dynamic embedding variables to any fsspec filesystem.

    Each TF checkpoint ``PREFIX`` gets its own KV checkpoint folder: ``{save_path}/{basename
    of PREFIX}``, or ``{dirname of PREFIX}/de_store/{basename}`` without ``save_path``
    (TFRA writes one ``TFRADynamicEmbedding`` folder that every save overwrites).

    Parameters
    ----------
    proc_size, proc_rank:
        Number of processes saving together and this one's rank. Detected from
        ``TF_CONFIG`` or MPI/PMI launch variables when not given (see ``topology``).
        All ranks must save checkpoints with the same basename and see the same
        ``save_path``.
    save_path:
        Root URL of the KV checkpoints (any fsspec URL: a path, ``s3://``, ``gs://``, ...).
    buffer_size:
        Rows per shard part on write and per batch on read.
    format:
        Shard format: ``"parquet"`` (default), ``"arrow"`` or ``"binary"``.
    storage_options:
        Passed to fsspec for ``save_path`` (credentials, endpoint, ...).
    barrier:
        How ranks wait for each other; default: through the storage itself.
    barrier_timeout_s:
        How long a rank waits for the others before failing with the missing ranks named.
    """

    def __init__(
        self,
        proc_size: int | None = None,
        proc_rank: int | None = None,
        save_path: str | None = None,
        buffer_size: int = 65536,
        format: str = "parquet",
        storage_options: dict[str, Any] | None = None,
        barrier: Barrier | None = None,
        barrier_timeout_s: float = 600.0,
    ) -> None:
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        if format not in FORMATS:
            raise ValueError(f"format {format!r} is not one of {sorted(FORMATS)}")
        if barrier_timeout_s <= 0:
            raise ValueError(f"barrier_timeout_s must be > 0, got {barrier_timeout_s!r}")
        self.topology: Topology = detect_topology(proc_size, proc_rank)
        self.save_path = save_path.rstrip("/") if save_path else None
        self.storage_options = dict(storage_options or {})
        self.options = IOOptions(format, buffer_size, barrier_timeout_s)
        self.barrier = barrier

    @property
    def proc_size(self) -> int:
        return self.topology.proc_size

    @property
    def proc_rank(self) -> int:
        return self.topology.proc_rank

    @property
    def buffer_size(self) -> int:
        return self.options.buffer_size

    def kv_url(self, tf_prefix: str) -> str:
        """The KV checkpoint folder for the TF checkpoint ``tf_prefix``."""
        head, base = posixpath.split(tf_prefix.rstrip("/"))
        root = self.save_path or posixpath.join(head, DEFAULT_KV_FOLDER)
        return f"{root}/{base}"

    def with_options(self, **changes: Any) -> FileSystemSaver:
        """A copy with some IO options changed (``format``, ``buffer_size``, ...)."""
        copy = object.__new__(FileSystemSaver)
        copy.__dict__.update(self.__dict__)
        copy.options = dataclasses.replace(self.options, **changes)
        return copy

    def __repr__(self) -> str:
        return (
            f"FileSystemSaver(proc_size={self.proc_size}, proc_rank={self.proc_rank}, "
            f"save_path={self.save_path!r}, buffer_size={self.buffer_size}, "
            f"format={self.options.format!r})"
        )
