"""The save flow, one screen.

Save (every rank):  rows (all, or a delta + tombstones) -> bucketed shard files (format)
                    -> backend -> rank manifest (+ parent) -> barrier
                    -> rank 0: merge manifests -> commit;  others: wait for commit.

A restore (plan, read, load) is :mod:`de_store.saver.restore_flow`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from de_store._memory import release_freed_memory
from de_store.backends import Backend, Location
from de_store.checkpoint import events, names, shards
from de_store.checkpoint.barrier import Barrier, StorageBarrier, job_poll_max_s
from de_store.checkpoint.chain import parent_reference
from de_store.checkpoint.commit import (
    CommitStrategy,
    commit_strategy,
    read_manifest,
    record_save_id,
)
from de_store.checkpoint.manifest import (
    Manifest,
    RankManifest,
    ShardRecord,
    TFCheckpointRef,
    merge_rank_manifests,
    rank_manifest_from_json,
    to_json,
)
from de_store.checkpoint.parallel import map_in_threads
from de_store.checkpoint.request import check_save_request
from de_store.checkpoint.retry import RetryPolicy, is_transient
from de_store.checkpoint.topology import Topology
from de_store.errors import (
    BarrierTimeoutError,
    CheckpointError,
    SaveInterruptedError,
)
from de_store.formats import DEFAULT_BUFFER_SIZE, FORMATS
from de_store.formats.precision import PRECISIONS
from de_store.formats.registry import compressed_format
from de_store.progress import Progress, progress_for
from de_store.saver import device_shards, incremental
from de_store.saver.rows import (
    SavedVariable,
    VariableRows,
)

#: Launch variables naming the job, tried in order when no ``job_id`` is given.
JOB_ID_VARIABLES = (
    "DE_STORE_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE",
)


@dataclasses.dataclass(frozen=True)
class IOOptions:
    """How shards are written and read.

    Attributes
    ----------
    format: shard format name: "parquet" (default), "arrow" or "binary".
    buffer_size: rows per part on write and most rows per batch on read; None (default):
        parts of about 16 MiB (``de_store.formats.base.part_rows``: 262,144 rows of a
        16-wide float32 table) and batches of at most 65,536 rows (``read_batch_rows``).
    barrier_timeout_s: how long ranks wait for each other before failing.
    retry: how failed storage steps (one shard file, a manifest, the commit, one read)
        are retried; ``RetryPolicy(attempts=1)`` disables retries.
    progress: draw progress bars (rows saved / restored) on stderr when it is a terminal.
    bucketed: group each shard's rows by key bucket (see ``shards.write_shard``); None:
        when several processes save together or the save is incremental
        (``bucketed_for``).
    compression: the format's codec: "none" (default), "zstd" or "lz4" (parquet also
        "snappy"); binary shards have none.
    compression_level: the codec's level (None: its default).
    value_precision: the precision float32 values are stored at: None or "float32"
        (default: each variable's own dtype), "bfloat16", "float16" or "int8" (a scale per
        row, lossy; see ``de_store.formats.precision``).
    """

    format: str = "parquet"
    buffer_size: int | None = None
    barrier_timeout_s: float = 600.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    progress: bool = False
    bucketed: bool | None = None
    compression: str = "none"
    compression_level: int | None = None
    value_precision: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {sorted(FORMATS)}")
        compressed_format(self.format, self.compression, self.compression_level)
        if self.value_precision == "float32":
            object.__setattr__(self, "value_precision", None)
        if self.value_precision not in (None, *PRECISIONS):
            raise ValueError(f"value_precision must be one of {['float32', *PRECISIONS]}, "
                             f"got {self.value_precision!r}")  # fmt: skip
        if self.buffer_size is not None and (
            not isinstance(self.buffer_size, int) or self.buffer_size < 1
        ):
            raise ValueError(f"buffer_size must be an int >= 1 or None, got {self.buffer_size!r}")
        if not self.barrier_timeout_s > 0:
            raise ValueError(f"barrier_timeout_s must be > 0, got {self.barrier_timeout_s!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        if self.bucketed not in (None, True, False):
            raise ValueError(f"bucketed must be True, False or None, got {self.bucketed!r}")

    @property
    def read_batch_rows(self) -> int:
        """The most rows per batch a restore reads: ``buffer_size``, or 65,536."""
        return self.buffer_size or DEFAULT_BUFFER_SIZE

    def encoding(self) -> dict[str, Any]:
        """How shards are encoded: ``compression``, ``compression_level`` and
        ``value_precision``, as ``shards.write_shard`` and ``shards.entry_for`` take them."""
        return {
            "compression": self.compression,
            "compression_level": self.compression_level,
            "value_precision": self.value_precision,
        }

    def bucketed_for(self, topology: Topology, chained: bool = False) -> bool:
        """Whether a save by ``topology`` groups rows by key bucket: as set, or when more
        than one process saves (a job of several processes restores with several, each
        reading its buckets only; one process restoring reads every row anyway), or when
        the save is ``chained``, a link of a chain of incremental saves (compaction merges
        a chain one key group at a time, reading the full link's buckets)."""
        if self.bucketed is not None:
            return self.bucketed
        return topology.proc_size > 1 or chained


class SaverSettings(Protocol):
    """What a save takes from its saver (a ``FileSystemSaver``, which builds on this
    module's :class:`IOOptions`)."""

    topology: Topology
    options: IOOptions
    barrier: Barrier | None
    job_id: str | None


def job_token(topology: Topology, job_id: str | None = None) -> str:
    """The staging token shared by every rank of one save, different for another job.

    ``job_id`` if given, else the first of :data:`JOB_ID_VARIABLES` set; a single process
    draws a random one per save. A multi-process job without any gets "" (shared folders).
    """
    if topology.proc_size == 1 and job_id is None:
        return uuid.uuid4().hex[:16]
    if job_id is None:
        job_id = next((os.environ[v] for v in JOB_ID_VARIABLES if os.environ.get(v)), "")
        if job_id and os.environ.get("SLURM_STEP_ID") and job_id == os.environ.get("SLURM_JOB_ID"):
            job_id += "." + os.environ["SLURM_STEP_ID"]
    return names.job_token_of(job_id)


def save_checkpoint(
    variables: Sequence[VariableRows],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
    **settings: Any,
) -> Manifest | None:
    """Check the request, then :func:`write_and_commit` (``settings``: its keyword
    arguments): the way into a save for a caller that has not checked it.

    Raises
    ------
    ValueError, DestinationError
        The request is refused before anything is written
        (:func:`~de_store.checkpoint.request.check_save_request`).
    """
    check_save_request(Location(backend, name), [rows.name for rows in variables])
    return write_and_commit(variables, backend, name, topology, options, **settings)


def write_and_commit(
    variables: Sequence[VariableRows],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
    *,
    barrier: Barrier | None = None,
    metadata: dict[str, Any] | None = None,
    job_id: str | None = None,
    cancel: threading.Event | None = None,
    tf_checkpoint: TFCheckpointRef | None = None,
) -> Manifest | None:
    """Write this rank's rows and, once all ranks have, commit the checkpoint ``name``;
    its caller has checked the request
    (:func:`~de_store.checkpoint.request.check_save_request`).

    Every attempt of a save has its own identity (the ``save_id`` rank 0 draws): the ranks
    agree on it before anything is written, write their rank manifests under it, and rank
    0 merges only the rank manifests of its attempt, never those an earlier (crashed)
    attempt of the same job left. ``cancel`` set stops the save before its commit with
    :class:`SaveInterruptedError` (checked before each shard file and before the commit).
    ``tf_checkpoint``: the TF checkpoint this one is saved for, recorded in its manifest
    apart from the user's ``metadata`` (the TF hook's saves).

    Returns the committed manifest: rank 0 always, other ranks when some rows were taken
    for incremental saves (``VariableRows.mark``; they read it after the commit).
    """
    start = time.perf_counter()
    parent = _parent_of(variables, backend, name)
    strategy = commit_strategy(backend, name, job_token(topology, job_id), options.retry)
    if topology.is_chief:
        strategy.begin()  # nothing written yet: a refused save must not ABORT the other one
    barrier = barrier or StorageBarrier(backend, strategy.work, topology, options.retry)
    try:
        before = _join_attempt(barrier, strategy, topology, options)
        manifest_path = _rank_manifest_path(strategy, topology.proc_rank)
        staging = backend.sub(strategy.staging)
        rank_manifest = write_rank(variables, staging, topology, options, manifest_path, parent,
                                   cancel=cancel)  # fmt: skip
        events.rank_saved(strategy.where, topology, rank_manifest, start)
        barrier.wait(f"shards-written-{strategy.save_id}", options.barrier_timeout_s)
        if topology.is_chief:
            _check_cancel(cancel, strategy.where)
            committed = _merge_and_commit(
                strategy, topology, rank_manifest, metadata, tf_checkpoint
            )
            events.committed(strategy.where, committed, start)
            return committed
    except BaseException as err:
        if topology.is_chief:
            strategy.abort(f"rank 0 failed before commit: {err!r}")
        raise
    _wait_for_commit(strategy, topology, options.barrier_timeout_s, before, cancel)
    if all(rows.mark is None for rows in variables):
        return None
    return options.retry.call(lambda: read_manifest(backend, name))[1]


def _join_attempt(
    barrier: Barrier, strategy: CommitStrategy, topology: Topology, options: IOOptions
) -> bytes | None:
    """Agree on rank 0's ``save_id`` (this attempt's identity) before anything is written.

    Returns the commit record a non-chief rank waits to see replaced, read once rank 0 has
    begun the save (None on rank 0 and for a single process).
    """
    if topology.proc_size == 1:
        return None
    try:
        strategy.save_id = barrier.agree("attempt", strategy.save_id, options.barrier_timeout_s)
    except BarrierTimeoutError as err:
        if topology.is_chief:
            raise
        raise BarrierTimeoutError(
            f"rank {topology.proc_rank}: rank 0 did not commit {strategy.where}: it never "
            f"started this save with this rank ({err})"
        ) from err
    if topology.is_chief:
        return None
    return options.retry.call(strategy.committed_state)


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise SaveInterruptedError(
            f"save of {where} was interrupted (KeyboardInterrupt) before its commit; "
            "nothing was committed"
        )


def _parent_of(
    variables: Sequence[VariableRows], backend: Backend, name: str
) -> tuple[str | None, float | None]:
    """``(parent, parent_created)`` of the checkpoint: the base of its deltas, a sibling."""
    bases = {(rows.base.url, rows.base.created) for rows in variables if rows.base is not None}
    if not bases:
        return None, None
    where = Location(backend, name).url
    if len(bases) > 1:
        raise CheckpointError(
            f"cannot save {where}: its variables are deltas on different checkpoints "
            f"{sorted(url for url, _ in bases)}; a checkpoint's deltas have one parent"
        )
    (url, created), = bases  # fmt: skip
    if not incremental.is_sibling(url, where):
        raise CheckpointError(
            f"cannot save {where} as a delta on {url}: an incremental save goes to a new "
            "folder beside its base (async snapshots are taken before the folder is known: "
            "save each into a new folder, as CheckpointManager does)"
        )
    return parent_reference(url, where), created


def save_variables(
    variables: Sequence[SavedVariable],
    rows: Sequence[VariableRows],
    backend: Backend,
    name: str,
    saver: SaverSettings,
    *,
    metadata: dict[str, Any] | None = None,
    cancel: threading.Event | None = None,
    tf_checkpoint: TFCheckpointRef | None = None,
) -> Manifest | None:
    """:func:`write_and_commit` with ``saver``'s topology and options, then each variable's
    change base: the new checkpoint once committed; none (the next save is full) if the
    save failed. Returns the committed manifest (None where this rank does not know it).
    The caller has checked the request
    (:func:`~de_store.checkpoint.request.check_save_request`)."""
    target = Location(backend, name).url
    try:
        manifest = write_and_commit(
            rows,
            backend,
            name,
            saver.topology,
            saver.options,
            barrier=saver.barrier,
            metadata=metadata,
            job_id=saver.job_id,
            cancel=cancel,
            tf_checkpoint=tf_checkpoint,
        )
    except BaseException:
        for variable, saved in zip(variables, rows, strict=True):
            if saved.mark is not None:
                incremental.record_failure(variable)
        raise
    if manifest is not None:
        for variable, saved in zip(variables, rows, strict=True):
            incremental.record_commit(variable, saved, target, manifest)
    return manifest


def write_rank(
    variables: Sequence[VariableRows],
    backend: Backend,
    topology: Topology,
    options: IOOptions,
    manifest_path: str,
    parent: tuple[str | None, float | None] = (None, None),
    *,
    cancel: threading.Event | None = None,
) -> RankManifest:
    """Write every shard of this rank under ``backend`` (the staging folder), then its rank
    manifest at ``manifest_path``. Shard paths are relative to the checkpoint folder, so a
    rename keeps them. Each shard file is one retried step (a new file name per attempt).
    A delta's removed keys go to tombstone shards (none for a shard without removals).
    ``cancel`` set stops it before the next shard file.

    First the free pages malloc keeps from what ran before the save (a fill's or a
    training loop's freed temporaries) go back to the system (:mod:`de_store._memory`,
    a few milliseconds): the process's peak while saving is then the table, the runtime
    and what the save itself holds, not what its past left behind."""
    release_freed_memory()
    entries = {}
    bar = progress_for(sum(r.rows for r in variables), "save", quiet=not options.progress,
                       unit="rows")  # fmt: skip
    write = functools.partial(_write_shards, backend, topology=topology, options=options,
                              bar=bar, cancel=cancel)  # fmt: skip
    for rows in variables:
        records = write(rows, tombstone=False)
        removed = write(shards.tombstone_rows(rows), tombstone=True)
        entries[rows.name] = shards.entry_for(rows, records, options.format, removed,
                                              **options.encoding())  # fmt: skip
    bar.close()
    manifest = RankManifest(topology.proc_rank, topology.proc_size, entries, *parent)
    data = to_json(manifest)
    options.retry.call(lambda: backend.write_bytes(manifest_path, data))
    return manifest


def _write_shards(
    backend: Backend,
    rows: VariableRows,
    topology: Topology,
    options: IOOptions,
    bar: Progress,
    tombstone: bool,
    cancel: threading.Event | None = None,
) -> list[ShardRecord]:
    write = functools.partial(
        device_shards.write_shard,
        backend,
        rows,
        rank=topology.proc_rank,
        format_name=options.format,
        buffer_size=options.buffer_size,
        bucketed=options.bucketed_for(topology, chained=rows.mark is not None),
        tombstone=tombstone,
        **options.encoding(),
    )
    records = []
    for index, shard_rows in enumerate(rows.shards):
        if tombstone and not shard_rows.rows:
            continue  # no tombstone file without removed keys
        _check_cancel(cancel, backend.url)
        shard = topology.proc_rank * len(rows.shards) + index
        records.append(options.retry.call(functools.partial(write, index, global_shard=shard)))
        bar.update(shard_rows.rows)
    return records


def _rank_manifest_path(strategy: CommitStrategy, rank: int) -> str:
    """Relative to the staging folder (the work folder is inside it), in the folder of
    this save attempt (``save_id``)."""
    work = strategy.work[len(strategy.staging) :].strip("/")
    return "/".join(p for p in (work, names.rank_manifest_path(rank, strategy.save_id)) if p)


def _merge_and_commit(
    strategy: CommitStrategy,
    topology: Topology,
    own: RankManifest,
    metadata: dict[str, Any] | None,
    tf_checkpoint: TFCheckpointRef | None,
) -> Manifest:
    ranks = [own, *_read_rank_manifests(strategy, topology)]
    if topology.proc_size > 1:  # all have arrived (one process writes no arrival file)
        work = strategy.backend.sub(strategy.work)
        strategy.retry.call(lambda: work.delete(names.BARRIER_DIR, recursive=True))
    manifest = merge_rank_manifests(ranks, metadata=metadata, tf_checkpoint=tf_checkpoint)
    strategy.commit(manifest)
    return manifest


#: Rank manifests rank 0 reads at once: on an object store each is a request of its own,
#: and the commit waits for the last of them.
RANK_MANIFEST_READERS = 16


def _read_rank_manifests(strategy: CommitStrategy, topology: Topology) -> list[RankManifest]:
    """The manifests of ranks 1 to ``proc_size - 1`` of this attempt, read in parallel."""
    read = functools.partial(_read_rank_manifest, strategy, topology)
    others = range(1, topology.proc_size)
    return map_in_threads(read, others, RANK_MANIFEST_READERS, "de_store-manifests")


def _read_rank_manifest(strategy: CommitStrategy, topology: Topology, rank: int) -> RankManifest:
    """The manifest ``rank`` wrote in this save attempt; a missing or foreign one is refused."""
    staging = strategy.backend.sub(strategy.staging)
    path = _rank_manifest_path(strategy, rank)
    where = Location(staging, path).url
    try:
        data = strategy.retry.call(functools.partial(staging.read_bytes, path))
    except FileNotFoundError as err:
        raise CheckpointError(
            f"cannot commit {strategy.where}: rank {rank} of {topology.proc_size} has no "
            f"manifest in this save attempt ({strategy.save_id}): {where} is missing"
        ) from err
    manifest = rank_manifest_from_json(data, where)
    if (manifest.rank, manifest.proc_size) != (rank, topology.proc_size):
        raise CheckpointError(
            f"{where}: expected the manifest of rank {rank} of {topology.proc_size}, found "
            f"rank {manifest.rank} of {manifest.proc_size}"
        )
    return manifest


def _wait_for_commit(
    strategy: CommitStrategy,
    topology: Topology,
    timeout_s: float,
    before: bytes | None,
    cancel: threading.Event | None = None,
) -> None:
    """Block a non-chief rank until rank 0 committed (the commit record of the checkpoint
    is no longer ``before``), aborted this attempt, or the timeout passed. A record written
    by another save (another ``save_id``) means this attempt did not commit."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while (record := _poll(strategy.committed_state, before)) == before:
        reason = _poll(strategy.aborted, None)
        if reason is not None:
            raise CheckpointError(f"save of {strategy.where} was aborted: {reason}")
        _check_cancel(cancel, strategy.where)
        if time.monotonic() >= deadline:
            raise BarrierTimeoutError(
                f"rank {topology.proc_rank}: rank 0 did not commit {strategy.where} "
                f"within {timeout_s:g} s"
            )
        time.sleep(delay)
        delay = min(2 * delay, job_poll_max_s(topology.proc_size, requests_per_poll=2))
    by = record_save_id(record)
    if by != strategy.save_id:
        raise CheckpointError(
            f"rank {topology.proc_rank}: {strategy.where} was committed by another save "
            f"(save id {by}) while this one ({strategy.save_id}) was waiting for rank 0; "
            "this save committed nothing"
        )


def _poll(check: Any, failed: Any) -> Any:
    """One poll of a wait loop; a failed check counts as "not yet" (the loop retries)."""
    try:
        return check()
    except Exception as err:
        if not is_transient(err):
            raise
        return failed
