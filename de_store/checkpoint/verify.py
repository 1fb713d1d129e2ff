"""Checking a committed checkpoint end to end (``de-store verify``).

Every shard of every variable is read in full with its recorded ``ShardInfo``, so the
format checks every byte against the crc32c of its part and of its file; before that,
each file's presence and size are checked against the manifest. The shard records and the
rows read go through the checks a restore makes (:mod:`de_store.checkpoint.checks`: every rank
and shard there, byte ranges inside their files, no null key, each key in its part's
bucket), and no key may be held twice. A delta's tombstone shards are read like its row
shards, and every link of its chain must exist and be committed. Needs no TensorFlow
except to hash string keys (to check their buckets).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint.chain import resolve_chain
from de_store.checkpoint.checks import (
    Problem,
    link_problems,
    read_checked,
    repeated_key,
    size_problems,
)
from de_store.checkpoint.commit import read_manifest
from de_store.checkpoint.manifest import Manifest, ShardRecord
from de_store.errors import CheckpointError, DeStoreError
from de_store.formats import ShardInfo
from de_store.formats.base import DEFAULT_BUFFER_SIZE
from de_store.progress import NO_PROGRESS, Progress

__all__ = ["Problem", "VerifyReport", "verify_checkpoint"]


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
    where = Location(backend, name).url
    try:
        folder, manifest = read_manifest(backend, name)
    except CheckpointError as err:
        return VerifyReport(0, 0, 0, [Problem(where, str(err))])
    folder_backend = backend.sub(folder)
    progress.total = manifest.bytes
    problems = _chain_problems(backend, name, manifest)
    files = rows = removed = 0
    for entry in manifest.variables.values():
        found = link_problems(backend, folder, manifest.proc_size, [entry])
        problems += found
        damaged = _damaged(folder_backend, [*entry.shards, *entry.removed], found)
        for tombstones, records in ((False, entry.shards), (True, entry.removed)):
            keys: list[tuple[str, np.ndarray]] = []  # rows, then tombstones of a delta
            for record in records:
                if id(record) in damaged:  # its numbers cannot be trusted: not read
                    progress.update(_size(record))
                    continue
                info = ShardInfo.from_dict(record.info)
                files += len(info.files)
                problems += _check_shard(folder_backend, record, info, entry.key_dtype, keys,
                                         progress)  # fmt: skip
                removed += info.rows if tombstones else 0
                rows += 0 if tombstones else info.rows
            if (repeat := repeated_key(keys)) is not None:
                problems.append(repeat)
    return VerifyReport(files, manifest.bytes, rows, problems, removed)


def _damaged(folder: Backend, records: list[ShardRecord], found: list[Problem]) -> set[int]:
    """The ids of ``records`` that ``found`` names (by the shard's or a file's path); all
    of them when a problem is the entry's own (its numbers are not to be trusted)."""
    named: dict[str, set[int]] = {}
    for record in records:
        info = record.info if isinstance(record.info, dict) else {}
        files = info.get("files")
        listed = files if isinstance(files, list) else []
        paths = [info.get("path"), *(f.get("path") for f in listed if isinstance(f, dict))]
        for path in paths:
            named.setdefault(Location(folder, str(path)).url, set()).add(id(record))
    damaged: set[int] = set()
    for problem in found:
        damaged |= named.get(problem.path, {id(r) for r in records})
    return damaged


def _size(record: ShardRecord) -> int:
    size = record.info.get("bytes") if isinstance(record.info, dict) else None
    return size if isinstance(size, int) else 0


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


def _check_shard(
    folder: Backend,
    record: ShardRecord,
    info: ShardInfo,
    key_dtype: str,
    keys: list[tuple[str, np.ndarray]],
    progress: Progress,
) -> list[Problem]:
    """Presence and size of each file, then a full verified and checked read (as a restore
    reads); the keys read go to ``keys``."""
    problems = size_problems(folder, [record])
    if problems:
        progress.update(info.bytes)
        return problems
    parts = list(range(len(info.parts)))
    try:
        for batch_keys, *_ in read_checked(folder, record, parts, key_dtype=key_dtype,
                                           buffer_size=DEFAULT_BUFFER_SIZE):  # fmt: skip
            keys.append((record.path, batch_keys))
    except (DeStoreError, OSError) as err:
        path = info.files[0].path if len(info.files) == 1 else info.path
        problems.append(Problem(path, str(err)))
    progress.update(info.bytes)
    return problems
