"""The save and restore flows, one screen each.

Save (every rank):  rows -> bucketed shard files (format) -> backend -> rank manifest
                    -> barrier -> rank 0: merge manifests -> commit;  others: wait for commit.
Restore (any rank): committed manifest -> parts that can hold this rank's keys -> rows
                    (checksums verified) -> only then replace the tables' content.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from de_store.backends import Backend, open_backend
from de_store.errors import BarrierTimeoutError, CheckpointError
from de_store.saver import shards
from de_store.saver.barrier import BARRIER_DIR, Barrier, StorageBarrier
from de_store.saver.commit import (
    ABORT_NAME,
    RANKS_DIR,
    CommitStrategy,
    commit_strategy,
    committed_folder,
    read_manifest,
)
from de_store.saver.manifest import (
    Manifest,
    RankManifest,
    VariableEntry,
    merge_rank_manifests,
    rank_manifest_from_json,
    to_json,
)
from de_store.saver.rows import ShardRows, VariableRows, apply_rows, check_compatible
from de_store.saver.topology import Topology


@dataclasses.dataclass(frozen=True)
class IOOptions:
    """How shards are written and read.

    Attributes
    ----------
    format: shard format name: "parquet" (default), "arrow" or "binary".
    buffer_size: rows per part on write and most rows per batch on read.
    barrier_timeout_s: how long ranks wait for each other before failing.
    """

    format: str = "parquet"
    buffer_size: int = 65536
    barrier_timeout_s: float = 600.0


def open_location(url: str, storage_options: dict[str, Any] | None) -> tuple[Backend, str]:
    """The backend of ``url``'s parent folder and the checkpoint's name inside it."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"checkpoint URL {url!r} must name a folder under a parent path")
    return open_backend(parent or ".", storage_options), name


def save_checkpoint(
    variables: Sequence[VariableRows],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
    *,
    barrier: Barrier | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write this rank's rows and, once all ranks have, commit the checkpoint ``name``."""
    strategy = commit_strategy(backend, name)
    barrier = barrier or StorageBarrier(backend, strategy.staging, topology)
    try:
        rank_manifest = write_rank(variables, backend.sub(strategy.staging), topology, options)
        barrier.wait("shards-written", options.barrier_timeout_s)
    except BaseException as err:
        if topology.is_chief:
            strategy.abort(f"rank 0 failed before commit: {err!r}")
        raise
    if topology.is_chief:
        _merge_and_commit(strategy, topology, rank_manifest, metadata)
    else:
        _wait_for_commit(strategy, topology, options.barrier_timeout_s)


def write_rank(
    variables: Sequence[VariableRows],
    backend: Backend,
    topology: Topology,
    options: IOOptions,
) -> RankManifest:
    """Write every shard of this rank under ``backend`` (the staging folder), then its rank
    manifest. Shard paths are relative to the checkpoint folder, so a rename keeps them."""
    entries = {}
    for rows in variables:
        records = [
            shards.write_shard(
                backend,
                rows,
                index,
                rank=topology.proc_rank,
                global_shard=topology.proc_rank * len(rows.shards) + index,
                format_name=options.format,
                buffer_size=options.buffer_size,
            )
            for index in range(len(rows.shards))
        ]
        entries[rows.name] = shards.entry_for(rows, records, options.format)
    manifest = RankManifest(topology.proc_rank, topology.proc_size, entries)
    backend.write_bytes(_rank_manifest_path(topology.proc_rank), to_json(manifest))
    return manifest


def _rank_manifest_path(rank: int) -> str:
    return f"{RANKS_DIR}/rank-{rank:05d}.json"


def _merge_and_commit(
    strategy: CommitStrategy,
    topology: Topology,
    own: RankManifest,
    metadata: dict[str, Any] | None,
) -> None:
    staging = strategy.backend.sub(strategy.staging)
    ranks = [own]
    for rank in range(1, topology.proc_size):
        path = _rank_manifest_path(rank)
        ranks.append(rank_manifest_from_json(staging.read_bytes(path), f"{staging.url}/{path}"))
    staging.delete(BARRIER_DIR, recursive=True)  # every rank has arrived: no longer needed
    strategy.commit(merge_rank_manifests(ranks, metadata=metadata))


def _wait_for_commit(strategy: CommitStrategy, topology: Topology, timeout_s: float) -> None:
    """Block a non-chief rank until rank 0 committed, aborted, or the timeout passed."""
    backend = strategy.backend
    abort_path = backend.join(strategy.staging, ABORT_NAME)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while committed_folder(backend, strategy.name) is None:
        if backend.exists(abort_path):
            reason = backend.read_bytes(abort_path).decode(errors="replace")
            raise CheckpointError(f"save of {strategy.where} was aborted: {reason}")
        if time.monotonic() >= deadline:
            raise BarrierTimeoutError(
                f"rank {topology.proc_rank}: rank 0 did not commit {strategy.where} "
                f"within {timeout_s:g} s"
            )
        time.sleep(delay)
        delay = min(2 * delay, 0.25)


# --- restore ----------------------------------------------------------------------------
def restore_checkpoint(
    variables: Sequence[Any],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
) -> Manifest:
    """Restore each variable's keys that belong to this rank; all or nothing."""
    folder, manifest = read_manifest(backend, name)
    where = f"{backend.url.rstrip('/')}/{name}"
    entries = [manifest.variable(v.name, where) for v in variables]
    for variable, entry in zip(variables, entries, strict=True):
        check_compatible(variable, entry, where)
    loaded = [_read_entry(backend.sub(folder), e, topology, options) for e in entries]
    for variable, entry, rows in zip(variables, entries, loaded, strict=True):
        apply_rows(variable, entry.columns, rows)
    return manifest


def _read_entry(
    folder: Backend, entry: VariableEntry, topology: Topology, options: IOOptions
) -> list[ShardRows]:
    out = []
    for record in entry.shards:
        parts = shards.parts_for_rank(record, topology.proc_rank, topology.proc_size)
        if not parts:
            continue
        for rows in shards.read_shard_rows(folder, record, parts, buffer_size=options.buffer_size):
            out.append(
                shards.select_rank_rows(
                    rows, entry.key_dtype, topology.proc_rank, topology.proc_size
                )
            )
    return out
