"""Checking a committed checkpoint end to end (``de-store verify``).

Every shard of every variable is read in full with its recorded ``ShardInfo``, so the
format checks every byte against the crc32c of its part and of its file; before that,
each file's presence and size are checked against the manifest, and every rank's shards
against the manifest's topology. A delta's tombstone shards are read like its row shards,
and every link of its chain must exist and be committed. Needs no TensorFlow.
"""

from __future__ import annotations

import dataclasses

from de_store.backends.base import Backend
from de_store.errors import CheckpointError, DeStoreError
from de_store.formats import ShardInfo, get_format
from de_store.progress import NO_PROGRESS, Progress
from de_store.saver.chain import resolve_chain
from de_store.saver.commit import read_manifest
from de_store.saver.manifest import Manifest, VariableEntry


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file (or "manifest") and what is wrong."""

    path: str
    message: str


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` checked and found."""

    files: int
    bytes: int
    rows: int
    problems: list[Problem]
    #: Tombstones read (keys a delta removes from its parent), not counted in ``rows``.
    removed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    backend: Backend, name: str, *, progress: Progress = NO_PROGRESS
) -> VerifyReport:
    """Check the committed checkpoint ``name`` under ``backend``; never raises for bad data.

    ``progress`` is told the bytes read; its ``total`` is set from the manifest.
    """
    where = f"{backend.url.rstrip('/')}/{name.strip('/')}"
    try:
        folder, manifest = read_manifest(backend, name)
    except CheckpointError as err:
        return VerifyReport(0, 0, 0, [Problem(where, str(err))])
    folder_backend = backend.sub(folder)
    progress.total = manifest.bytes
    problems = _topology_problems(manifest) + _chain_problems(backend, name, manifest)
    files = rows = removed = 0
    for entry in manifest.variables.values():
        tagged = [(r, False) for r in entry.shards] + [(r, True) for r in entry.removed]
        for record, tombstones in tagged:  # rows, then tombstones of a delta
            info = ShardInfo.from_dict(record.info)
            files += len(info.files)
            problems += _check_shard(folder_backend, info, progress)
            removed += info.rows if tombstones else 0
            rows += 0 if tombstones else info.rows
    return VerifyReport(files, manifest.bytes, rows, problems, removed)


def _chain_problems(backend: Backend, name: str, manifest: Manifest) -> list[Problem]:
    """A delta's links must all be there and committed (their files are checked when
    they are verified themselves)."""
    problems = []
    for entry in manifest.variables.values():
        if entry.incremental:
            try:
                resolve_chain(backend, name, entry.name)
            except DeStoreError as err:
                problems.append(Problem("chain", str(err)))
    return problems


def _topology_problems(manifest: Manifest) -> list[Problem]:
    problems = []
    for entry in manifest.variables.values():
        problems += _entry_problems(entry, manifest.proc_size)
    return problems


def _entry_problems(entry: VariableEntry, proc_size: int) -> list[Problem]:
    ranks = {record.rank for record in entry.shards}
    missing = sorted(set(range(proc_size)) - ranks)
    problems = []
    if missing:
        problems.append(
            Problem("manifest", f"variable {entry.name!r}: no shards of rank(s) {missing}")
        )
    if entry.shard_count != len(entry.shards):
        problems.append(
            Problem(
                "manifest",
                f"variable {entry.name!r}: shard_count is {entry.shard_count}, "
                f"found {len(entry.shards)} shard records",
            )
        )
    return problems


def _check_shard(folder: Backend, info: ShardInfo, progress: Progress) -> list[Problem]:
    """Presence and size of each file, then a full verified read."""
    problems = []
    for file in info.files:
        if not folder.exists(file.path):
            problems.append(Problem(file.path, "missing"))
        elif (size := folder.size(file.path)) != file.bytes:
            problems.append(Problem(file.path, f"expected {file.bytes} bytes, found {size}"))
    if problems:
        progress.update(info.bytes)
        return problems
    try:
        for _ in get_format(info.format).read(folder, info.path, expected=info):
            pass
    except (DeStoreError, OSError) as err:
        path = info.files[0].path if len(info.files) == 1 else info.path
        problems.append(Problem(path, str(err)))
    progress.update(info.bytes)
    return problems
