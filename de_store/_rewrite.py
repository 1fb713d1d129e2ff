"""Writing a new committed checkpoint outside a save: the steps ``convert`` and
``compact`` share (pick variables, check the target format, stage, commit)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np

from de_store.backends import Backend, Location
from de_store.checkpoint import names
from de_store.checkpoint.commit import CommitStrategy, commit_strategy
from de_store.checkpoint.manifest import (
    ColumnSpec,
    RankManifest,
    VariableEntry,
    merge_rank_manifests,
    to_json,
)
from de_store.errors import CheckpointError, FormatError

#: One table shard's rows: ``(keys [n], {column: rows [n, dim]})``.
Rows = tuple[np.ndarray, dict[str, np.ndarray]]
#: Reads one table shard's rows when called.
RowsLoader = Callable[[], Rows]


@dataclasses.dataclass
class SourceVariable:
    """A variable to rewrite: its schema and, per rank, loaders of its shards in order."""

    name: str
    key_dtype: str
    value_dtype: str
    dim: int
    columns: dict[str, ColumnSpec]
    proc_size: int
    #: rank -> [(global shard id, loader of its rows)]
    shards: dict[int, list[tuple[int, RowsLoader]]]


class _HasName(Protocol):
    name: str


_Named = TypeVar("_Named", bound=_HasName)


def select(variables: list[_Named], names: tuple[str, ...], src: str) -> list[_Named]:
    """The variables called ``names``, in that order; an error naming those ``src`` lacks."""
    known = {v.name: v for v in variables}
    missing = [n for n in names if n not in known]
    if missing:
        raise CheckpointError(f"{src} has no variable {missing}; it holds: {sorted(known)}")
    return [known[n] for n in names]


def concat_rows(batches: list[Rows], info: Mapping[str, Any]) -> Rows:
    """The batches of one shard as one ``(keys, {column: rows})``."""
    if not batches:
        raise CheckpointError(f"shard {info['path']} yielded no batch")
    keys = np.concatenate([k for k, _ in batches])
    columns = {c: np.concatenate([cols[c] for _, cols in batches]) for c in batches[0][1]}
    return keys, columns


def commit_ranks(
    strategy: CommitStrategy,
    entries: dict[int, dict[str, VariableEntry]],
    metadata: dict[str, Any] | None,
) -> None:
    """Write each rank's manifest into the staging folder, then merge and commit them."""
    staging = strategy.backend.sub(strategy.staging)
    ranks = [RankManifest(r, len(entries), entries[r]) for r in range(len(entries))]
    for manifest in ranks:
        staging.write_bytes(names.rank_manifest_path(manifest.rank, None), to_json(manifest))
    strategy.commit(merge_rank_manifests(ranks, metadata=metadata))


@contextlib.contextmanager
def new_checkpoint(backend: Backend, name: str) -> Iterator[CommitStrategy]:
    """The commit strategy of the new checkpoint ``name`` (an error if it exists already);
    what was staged is removed if the block fails before the commit."""
    if backend.exists(name):
        raise CheckpointError(
            f"{Location(backend, name).url} exists already: convert writes a new checkpoint"
        )
    strategy = commit_strategy(backend, name)
    try:
        yield strategy
    except BaseException:
        if strategy.committed_state() is None:
            with contextlib.suppress(Exception):
                backend.delete(strategy.staging, recursive=True)
        raise


def check_columns(name: str, key_dtype: str, columns: dict[str, ColumnSpec], to: str) -> None:
    """A ``FormatError`` if format ``to`` cannot hold the keys of variable ``name``."""
    if to in ("binary", "tfra") and key_dtype == "string":
        raise FormatError(
            f"variable {name!r} cannot be written as {to}: it stores integer keys only, "
            "the variable has key_dtype='string'; use --to parquet or arrow"
        )
