"""``FileSystemSaver``: TFRA's saver, plugged in through ``kv_creator``.

``de_store.HashTableCreator(saver=FileSystemSaver(...))`` makes every variable it creates
save its tables through this saver whenever TensorFlow saves a checkpoint or SavedModel
(see :mod:`de_store.saver.tf_hook`). Only the KV data's location goes into TF's bundle.
"""

from __future__ import annotations

import posixpath
from typing import Any

from de_store.checkpoint.barrier import Barrier
from de_store.checkpoint.retry import RetryPolicy
from de_store.checkpoint.topology import Topology, detect_topology
from de_store.saver.core import IOOptions
from de_store.saver.incremental import IncrementalPolicy, policy_of

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
        Rows per shard part on write and per batch on read. None (default): parts of
        about 16 MiB (262,144 rows of a 16-wide float32 table, in multiples of 65,536
        rows: fewer parts cost a save less work), batches of at most 65,536 rows.
    format:
        Shard format: ``"parquet"`` (default), ``"arrow"`` or ``"binary"``.
    storage_options:
        Passed to fsspec for ``save_path`` (credentials, endpoint, ...).
    barrier:
        How ranks wait for each other; default: through the storage itself.
    barrier_timeout_s:
        How long a rank waits for the others before failing with the missing ranks named.
    retry:
        How failed storage steps are retried (default ``RetryPolicy()``: 4 tries with
        exponential backoff); ``RetryPolicy(attempts=1)`` disables retries.
    progress:
        Draw progress bars of the rows saved and restored on stderr, when it is a terminal.
    job_id:
        Names the job for a multi-process save, the same on every rank: the ranks of one
        job stage in their own folder, apart from another job saving the same checkpoint.
        Detected from launch variables (``core.JOB_ID_VARIABLES``) when not given; a single
        process needs none (each save draws its own).
    incremental:
        Save only what changed since the variable's last committed checkpoint (a delta on
        it), with full saves as the ``IncrementalPolicy`` says; ``True`` is the default
        policy, ``False`` (default) saves every row each time. See docs/checkpoints.md.
    bucketed:
        Group each shard's rows by key bucket, so that each process of a job restoring
        with several reads only its share. ``None`` (default): when ``proc_size > 1`` or
        ``incremental`` (compaction merges a chain a key group at a time). Otherwise a
        process writes rows in the order its tables hold them, the fastest save; a
        restore by several processes then reads every row on each. See
        docs/checkpoints.md, *Resharding*.
    compression:
        The shard files' codec: ``"none"`` (default), ``"zstd"`` or ``"lz4"`` for the
        parquet and arrow formats (parquet also ``"snappy"``); the binary format has none
        (ValueError). ``compression_level``: the codec's level (None: its default).
    value_precision:
        The precision float32 values are stored at: ``None`` or ``"float32"`` (default:
        every variable's own dtype, unchanged), ``"bfloat16"`` or ``"float16"`` (each value
        rounded to nearest as ``tf.cast`` rounds), or ``"int8"`` (one float16 scale per
        row; lossy: each value within about ``max|row| / 254``; see
        :mod:`de_store.formats.precision`). A restore converts the values back to float32.
        Only the values change, optimizer slots stay exact; a variable whose values are not
        float32 cannot be saved at another precision (ValueError naming it). See
        docs/checkpoints.md, *Smaller checkpoints*.
    """

    def __init__(
        self,
        proc_size: int | None = None,
        proc_rank: int | None = None,
        save_path: str | None = None,
        buffer_size: int | None = None,
        format: str = "parquet",
        storage_options: dict[str, Any] | None = None,
        barrier: Barrier | None = None,
        barrier_timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        job_id: str | None = None,
        progress: bool = False,
        incremental: IncrementalPolicy | bool = False,
        bucketed: bool | None = None,
        compression: str = "none",
        compression_level: int | None = None,
        value_precision: str | None = None,
    ) -> None:
        self.options = IOOptions(
            format, buffer_size, barrier_timeout_s, retry or RetryPolicy(), progress, bucketed,
            compression, compression_level, value_precision,
        )  # fmt: skip
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        self.topology: Topology = detect_topology(proc_size, proc_rank)
        self.save_path = save_path.rstrip("/") if save_path else None
        self.storage_options = dict(storage_options or {})
        self.barrier = barrier
        self.job_id = job_id
        #: The incremental policy, or None when every save is full.
        self.incremental: IncrementalPolicy | None = policy_of(incremental)

    @property
    def proc_size(self) -> int:
        return self.topology.proc_size

    @property
    def proc_rank(self) -> int:
        return self.topology.proc_rank

    @property
    def buffer_size(self) -> int | None:
        return self.options.buffer_size

    def kv_url(self, tf_prefix: str) -> str:
        """The KV checkpoint folder for the TF checkpoint ``tf_prefix``."""
        head, base = posixpath.split(tf_prefix.rstrip("/"))
        root = self.save_path or posixpath.join(head, DEFAULT_KV_FOLDER)
        return f"{root}/{base}"

    def __repr__(self) -> str:
        return (
            f"FileSystemSaver(proc_size={self.proc_size}, proc_rank={self.proc_rank}, "
            f"save_path={self.save_path!r}, buffer_size={self.buffer_size}, "
            f"format={self.options.format!r}, compression={self.options.compression!r}, "
            f"value_precision={self.options.value_precision!r}, "
            f"incremental={self.incremental!r})"
        )
