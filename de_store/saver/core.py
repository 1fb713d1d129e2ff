"""The save and restore flows, one screen each.

Save (every rank):  rows (all, or a delta + tombstones) -> bucketed shard files (format)
                    -> backend -> rank manifest (+ parent) -> barrier
                    -> rank 0: merge manifests -> commit;  others: wait for commit.
Restore (any rank): committed manifest -> its chain (full + deltas) -> parts that can hold
                    this rank's keys -> rows (checksums verified) of every link
                    -> only then replace the tables' content and apply the deltas in order
                    (an empty variable that one process restores loads its full link's
                    rows as they are read, its deltas read first, and is emptied again on
                    any failure: :mod:`de_store.saver.streamed`; a variable on parameter
                    servers has them read and load its rows: :mod:`de_store.saver.device_restore`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from de_store.backends import Backend, Location
from de_store.checkpoint import events, names
from de_store.checkpoint.barrier import Barrier, StorageBarrier, job_poll_max_s
from de_store.checkpoint.chain import chain_links, parent_reference
from de_store.checkpoint.checks import Problem, check_link, has_repeated_key, repeated_key
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
    VariableEntry,
    merge_rank_manifests,
    rank_manifest_from_json,
    to_json,
)
from de_store.checkpoint.request import check_save_request
from de_store.checkpoint.retry import RetryPolicy, is_transient
from de_store.checkpoint.topology import Topology
from de_store.errors import (
    BarrierTimeoutError,
    CheckpointCorruptError,
    CheckpointError,
    RepeatedKeysError,
    SaveInterruptedError,
)
from de_store.formats import FORMATS
from de_store.progress import Progress, progress_for
from de_store.saver import device_load, device_restore, incremental, shards
from de_store.saver.rows import (
    RestoredVariable,
    SavedVariable,
    ShardRows,
    VariableRows,
    apply_delta,
    apply_rows,
    check_compatible,
    grow_for_restore,
    restore_shares,
)
from de_store.saver.streamed import load_while_reading, streams

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
    buffer_size: rows per part on write and most rows per batch on read.
    barrier_timeout_s: how long ranks wait for each other before failing.
    retry: how failed storage steps (one shard file, a manifest, the commit, one read)
        are retried; ``RetryPolicy(attempts=1)`` disables retries.
    progress: draw progress bars (rows saved / restored) on stderr when it is a terminal.
    bucketed: group each shard's rows by key bucket (see ``shards.write_shard``); None:
        when several processes save together or the save is incremental
        (``bucketed_for``).
    """

    format: str = "parquet"
    buffer_size: int = 65536
    barrier_timeout_s: float = 600.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    progress: bool = False
    bucketed: bool | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {sorted(FORMATS)}")
        if not isinstance(self.buffer_size, int) or self.buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {self.buffer_size!r}")
        if not self.barrier_timeout_s > 0:
            raise ValueError(f"barrier_timeout_s must be > 0, got {self.barrier_timeout_s!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        if self.bucketed not in (None, True, False):
            raise ValueError(f"bucketed must be True, False or None, got {self.bucketed!r}")

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
    ``cancel`` set stops it before the next shard file."""
    entries = {}
    bar = progress_for(sum(r.rows for r in variables), "save", quiet=not options.progress,
                       unit="rows")  # fmt: skip
    write = functools.partial(_write_shards, backend, topology=topology, options=options,
                              bar=bar, cancel=cancel)  # fmt: skip
    for rows in variables:
        records = write(rows, tombstone=False)
        removed = write(shards.tombstone_rows(rows), tombstone=True)
        entries[rows.name] = shards.entry_for(rows, records, options.format, removed)
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
        shards.write_shard,
        backend,
        rows,
        rank=topology.proc_rank,
        format_name=options.format,
        buffer_size=options.buffer_size,
        bucketed=options.bucketed_for(topology, chained=rows.mark is not None),
        tombstone=tombstone,
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
    work = strategy.backend.sub(strategy.work)
    strategy.retry.call(lambda: work.delete(names.BARRIER_DIR, recursive=True))  # all have arrived
    manifest = merge_rank_manifests(ranks, metadata=metadata, tf_checkpoint=tf_checkpoint)
    strategy.commit(manifest)
    return manifest


#: Rank manifests rank 0 reads at once: on an object store each is a request of its own,
#: and the commit waits for the last of them.
RANK_MANIFEST_READERS = 16


def _read_rank_manifests(strategy: CommitStrategy, topology: Topology) -> list[RankManifest]:
    """The manifests of ranks 1 to ``proc_size - 1`` of this attempt, read in parallel."""
    others = range(1, topology.proc_size)
    if len(others) <= 1:
        return [_read_rank_manifest(strategy, topology, r) for r in others]
    workers = min(RANK_MANIFEST_READERS, len(others))
    with concurrent.futures.ThreadPoolExecutor(workers, "de_store-manifests") as pool:
        return list(pool.map(functools.partial(_read_rank_manifest, strategy, topology), others))


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


# --- restore ----------------------------------------------------------------------------
#: One link of a variable's chain: its folder, manifest and entry.
Link = tuple[str, Manifest, VariableEntry]
#: Rows read from one shard file, with the file's path (to name it in errors).
FileRows = tuple[str, ShardRows]


def restore_checkpoint(
    variables: Sequence[RestoredVariable],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
    check_manifest: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Restore each variable's keys that belong to this rank; all or nothing.

    An incremental checkpoint restores its chain: every link's rows are read first, then
    the full link replaces the tables' content and each delta applies in order. Afterwards
    each variable's next incremental save is a delta on this checkpoint.

    Every link is checked as ``de-store verify`` checks it (:mod:`de_store.checkpoint.checks`):
    its manifest's numbers and its files' sizes before any read, its rows as they are
    read, and no key held twice before any variable that holds rows is emptied. A refused
    restore leaves every variable as it was.

    A variable that holds nothing, restored by one process, loads its full link's rows
    while they are read (:mod:`de_store.saver.streamed`), its chain's deltas read and
    checked before and applied after; when the streaming fails it is emptied and its
    chain is read whole, with retries, like the others'. When the restore fails, every
    variable loaded that way is emptied again: as it was.

    ``check_manifest`` is called with the manifest before anything else is read (the TF
    hook checks there that it is bound to the TF checkpoint being restored).

    Raises
    ------
    CheckpointCorruptError
        A check failed; the message names the file.
    """
    start = time.perf_counter()
    folder, manifest = options.retry.call(lambda: read_manifest(backend, name))
    if check_manifest is not None:
        check_manifest(manifest)
    where = f"{backend.url.rstrip('/')}/{name}"
    chains = [_chain_of(backend, name, folder, manifest, v.name, options) for v in variables]
    urls = [[f"{backend.url.rstrip('/')}/{link}" for link, *_ in chain] for chain in chains]
    for variable, chain, chain_urls in zip(variables, chains, urls, strict=True):
        for (link, link_manifest, entry), url in zip(chain, chain_urls, strict=True):
            # nothing is sized, compared or looped over from a number not checked first
            check_link(backend, link, link_manifest.proc_size, entry, where)
            check_compatible(variable, entry, url)
    total = sum(entry.rows + entry.removed_rows for chain in chains for *_, entry in chain)
    # None: read by this process; else read by the tasks of its tables (parameter servers)
    plans = [device_restore.plan_for(v, c, backend, topology.proc_size)
             for v, c in zip(variables, chains, strict=True)]  # fmt: skip
    # Empty variables grow for their rows while the shards are read (rows.grow_for_restore)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="de_store-grow") as pool:
        parts = [_parts_to_read(chain, topology) for chain in chains]
        counts = [sum(rows for *_, rows in p) for p in parts]
        shares = [restore_shares(v, p) for v, p in zip(variables, parts, strict=True)]
        # before the growing starts: it makes the tables of an empty variable hold room
        stream = [p is None and streams(v, c, topology.proc_size)
                  for v, c, p in zip(variables, chains, plans, strict=True)]  # fmt: skip
        growing = [
            pool.submit(grow_for_restore, v, n, s)
            for v, n, s in zip(variables, counts, shares, strict=True)
        ]
        streamed: list[RestoredVariable] = []
        try:
            with progress_for(total, "restore", quiet=not options.progress, unit="rows") as bar:
                held = [p if p is None else device_restore.read_on_devices(p, bar) for p in plans]
                # a streamed chain's deltas are read (and checked) before its full link
                loaded = [
                    _read_chain(backend, c[1:] if s else c, topology, options, bar)
                    if p is None else []  # read on the tasks above
                    for c, s, p in zip(chains, stream, plans, strict=True)
                ]  # fmt: skip
                for i, variable in enumerate(variables):
                    if not stream[i]:
                        continue
                    _check_deltas(variable, urls[i][1:], loaded[i])
                    at, _, entry = chains[i][0]
                    full = sum(rows for *_, rows in _parts_to_read(chains[i][:1], topology))
                    if load_while_reading(variable, backend.sub(at), entry, full, shares[i],
                                          ready=growing[i].result,
                                          buffer_size=options.buffer_size, bar=bar):  # fmt: skip
                        streamed.append(variable)
                    else:  # read it whole: retried, or its damage reported
                        stream[i] = False
                        loaded[i] = _read_chain(backend, chains[i], topology, options, bar)
            for grown in growing:
                grown.result()
            # what a load would find, found before any variable that holds rows is emptied
            for variable, chain_urls, links, s, h in zip(variables, urls, loaded, stream, held,
                                                         strict=True):  # fmt: skip
                if h is not None:
                    device_load.check_repeats(variable, h, chain_urls[0])
                elif not s:
                    _check_chain_rows(variable, chain_urls, links)
            for variable, chain, links, s in zip(variables, chains, loaded, stream, strict=True):
                if s:  # its deltas, on the full link loaded while it was read
                    with variable.exclusive():
                        _apply_deltas(variable, [entry for *_, entry in chain[1:]], links)
        except BaseException:
            for variable in streamed:  # they held nothing: all or nothing
                variable.clear()
            raise
    for variable, chain, folders, links, share, s, h in zip(
        variables, chains, urls, loaded, shares, stream, held, strict=True
    ):
        entries = [entry for *_, entry in chain]
        if h is not None:
            device_load.load_on_devices(variable, h, folders[0])
        elif not s:
            _apply_chain(variable, entries, links, folders, share)
        incremental.record_restore(variable, where, manifest, entries)
    rows = sum(r.rows for links in loaded for link_rows, _ in links for _, r in link_rows)
    rows += sum(n for n, s in zip(counts, stream, strict=True) if s)
    rows += sum(h.rows for h in held if h is not None)
    size = sum(entry.bytes for chain in chains for *_, entry in chain)
    events.restored(where, topology, rows, max(map(len, chains), default=0), size, start)
    return manifest


def _parts_to_read(chain: list[Link], topology: Topology) -> list[tuple[int, int, int]]:
    """``(num_buckets, bucket, rows)`` of every part this rank reads of a chain's rows."""
    return [
        part
        for *_, entry in chain
        for record in entry.shards
        for part in shards.bucket_rows(record, topology.proc_rank, topology.proc_size)
    ]


def _chain_of(
    backend: Backend,
    name: str,
    folder: str,
    manifest: Manifest,
    variable_name: str,
    options: IOOptions,
) -> list[Link]:
    entry = manifest.variable(variable_name, f"{backend.url.rstrip('/')}/{name}")
    if not entry.incremental:
        return [(folder, manifest, entry)]
    return chain_links(backend, name, variable_name, options.retry)


def _apply_chain(
    variable: RestoredVariable,
    entries: list[VariableEntry],
    links: list[tuple[list[FileRows], list[FileRows]]],
    folders: list[str],
    shares: Sequence[int],
) -> None:
    """The full link replaces the content; each delta removes its keys, upserts its rows.
    Each table shard is grown first for its entry of ``shares``, the rows it receives.

    The rows were checked by :func:`_check_chain_rows`; a key the table still finds
    repeated (which that check rules out) empties the variable, named in the error.
    """
    first = [rows for _, rows in links[0][0]]
    # Eager calls from other threads (a training loop) wait: the size check below and the
    # chain see this restore's rows only, and the restore is one step to them.
    with variable.exclusive():
        try:
            apply_rows(variable, entries[0].columns, first, shares)
            repeated = int(variable.size()) != sum(batch.rows for batch in first)
        except RepeatedKeysError:
            repeated = True
        if repeated:
            variable.clear()
            found = repeated_key((path, r.keys) for path, r in links[0][0])
            _refuse_repeated(variable, folders[0], found, " (the variable was emptied)")
        _apply_deltas(variable, entries[1:], links[1:])


def _check_chain_rows(
    variable: SavedVariable,
    folders: list[str],
    links: list[tuple[list[FileRows], list[FileRows]]],
) -> None:
    """Refuse a chain (links in checkpoints ``folders``) whose full link or a delta holds a
    key twice, before anything is applied, naming the key and the files that hold it."""
    rows = links[0][0]
    if has_repeated_key([r.keys for _, r in rows]):
        _refuse_repeated(variable, folders[0], repeated_key((path, r.keys) for path, r in rows))
    _check_deltas(variable, folders[1:], links[1:])


def _check_deltas(
    variable: SavedVariable,
    folders: list[str],
    deltas: list[tuple[list[FileRows], list[FileRows]]],
) -> None:
    """Refuse a chain whose delta (in checkpoint ``folders[i]``) holds a key twice, before
    anything is applied: a sort of its rows (deltas are upserted, which finds no repeat)."""
    for folder, (rows, _) in zip(folders, deltas, strict=True):
        if (found := repeated_key((path, r.keys) for path, r in rows)) is not None:
            _refuse_repeated(variable, folder, found)


def _apply_deltas(
    variable: RestoredVariable,
    entries: list[VariableEntry],
    deltas: list[tuple[list[FileRows], list[FileRows]]],
) -> None:
    """Each delta in order: its removed keys dropped, its rows upserted."""
    for entry, (rows, removed) in zip(entries, deltas, strict=True):
        apply_delta(variable, entry.columns, [r for _, r in rows], [r for _, r in removed])


def _refuse_repeated(
    variable: SavedVariable, folder: str, found: Problem | None, emptied: str = ""
) -> None:
    """Raise :class:`CheckpointCorruptError` for the repeated key ``found`` in the
    checkpoint ``folder`` (None: the table found a repeat that the rows do not show)."""
    detail = f"{folder}/{found.path}: {found.message}" if found else "a key is repeated"
    raise CheckpointCorruptError(
        f"variable {variable.name!r}: checkpoint {folder} is damaged: {detail}{emptied}"
    )


def _read_chain(
    backend: Backend, chain: list[Link], topology: Topology, options: IOOptions, bar: Progress
) -> list[tuple[list[FileRows], list[FileRows]]]:
    """This rank's rows and removed keys of every link of a chain, in order."""
    return [_read_link(backend.sub(at), entry, topology, options, bar) for at, _, entry in chain]


def _read_link(
    folder: Backend,
    entry: VariableEntry,
    topology: Topology,
    options: IOOptions,
    bar: Progress,
) -> tuple[list[FileRows], list[FileRows]]:
    """This rank's rows and removed keys (tombstones) of one link."""
    rows = _read_records(folder, entry.shards, entry.key_dtype, topology, options, bar)
    removed = _read_records(folder, entry.removed, entry.key_dtype, topology, options, bar)
    return rows, removed


def _read_records(
    folder: Backend,
    records: list[ShardRecord],
    key_dtype: str,
    topology: Topology,
    options: IOOptions,
    bar: Progress,
) -> list[FileRows]:
    out = []
    for record in records:
        parts = shards.parts_for_rank(record, topology.proc_rank, topology.proc_size)
        if not parts:
            bar.update(record.rows)
            continue
        read = functools.partial(_read_parts, folder, record, parts, key_dtype, topology,
                                 options)  # fmt: skip
        out += [(record.path, rows) for rows in options.retry.call(read)]
        bar.update(record.rows)  # shards done, of all the checkpoint's
    return out


def _read_parts(
    folder: Backend,
    record: ShardRecord,
    parts: list[int],
    key_dtype: str,
    topology: Topology,
    options: IOOptions,
) -> list[ShardRows]:
    """This rank's rows of one shard's parts, read whole and checked: the retried step of
    a restore."""
    rows = shards.read_shard_rows(
        folder,
        record,
        parts,
        buffer_size=options.buffer_size,
        key_dtype=key_dtype,
        proc_rank=topology.proc_rank,
        proc_size=topology.proc_size,
    )
    return list(rows)
