"""The checkpoint manifest: what a committed checkpoint holds.

Each rank writes a :class:`RankManifest` for the shards it wrote; after the barrier rank 0
merges them into one :class:`Manifest` (as ``MergeV2Checkpoints`` merges TF's index files)
and commits it. Readers trust only the merged manifest of a committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from de_store.errors import CheckpointError

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """One per-key column: ``value`` or a companion (optimizer slot, policy status)."""

    dtype: str
    dim: int


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One shard file: which rank and table shard wrote it, and what it holds.

    ``info`` is the format's ``ShardInfo.to_dict()`` (rows, bytes, crc32c, parts, ...).
    Rows are grouped by key bucket ``floormod(hash(key), num_buckets)``, one bucket per
    part: ``part_buckets[i]`` is the bucket held by part ``i`` of the file.
    """

    rank: int
    shard: int
    info: dict[str, Any]
    num_buckets: int
    part_buckets: list[int]

    @property
    def path(self) -> str:
        return str(self.info["path"])

    @property
    def rows(self) -> int:
        return int(self.info["rows"])

    @property
    def bytes(self) -> int:
        return int(self.info["bytes"])


@dataclasses.dataclass(frozen=True)
class VariableEntry:
    """Everything saved for one variable, across all ranks."""

    name: str
    key_dtype: str
    value_dtype: str
    dim: int
    columns: dict[str, ColumnSpec]
    format: str
    shard_count: int
    shards: list[ShardRecord]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


@dataclasses.dataclass(frozen=True)
class RankManifest:
    """What one rank wrote; its presence is that rank's arrival at the barrier."""

    rank: int
    proc_size: int
    variables: dict[str, VariableEntry]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The merged manifest of a checkpoint."""

    format_version: int
    created: float
    proc_size: int
    variables: dict[str, VariableEntry]
    versions: dict[str, str]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    parent: str | None = None

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.variables.values())

    def variable(self, name: str, where: str) -> VariableEntry:
        """The entry of ``name``; a ``CheckpointError`` naming the checkpoint when absent."""
        try:
            return self.variables[name]
        except KeyError:
            known = ", ".join(sorted(self.variables)) or "none"
            raise CheckpointError(
                f"checkpoint {where} has no variable {name!r}; it holds: {known}"
            ) from None


def library_versions() -> dict[str, str]:
    """Versions of the libraries that wrote a checkpoint."""
    from importlib import metadata

    versions = {}
    for dist in ("de_store", "tensorflow", "pyarrow", "fsspec", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def merge_rank_manifests(
    ranks: Sequence[RankManifest], *, metadata: dict[str, Any] | None = None
) -> Manifest:
    """Merge every rank's manifest into one; all ranks must agree on each variable."""
    proc_size = ranks[0].proc_size
    merged: dict[str, VariableEntry] = {}
    for rank_manifest in sorted(ranks, key=lambda m: m.rank):
        for name, entry in rank_manifest.variables.items():
            merged[name] = _merge_entry(merged.get(name), entry, rank_manifest.rank)
    return Manifest(
        format_version=FORMAT_VERSION,
        created=time.time(),
        proc_size=proc_size,
        variables=merged,
        versions=library_versions(),
        metadata=dict(metadata or {}),
    )


def _merge_entry(into: VariableEntry | None, entry: VariableEntry, rank: int) -> VariableEntry:
    if into is None:
        return entry
    mine = (into.key_dtype, into.value_dtype, into.dim, into.columns, into.format)
    theirs = (entry.key_dtype, entry.value_dtype, entry.dim, entry.columns, entry.format)
    if mine != theirs:
        raise CheckpointError(
            f"variable {entry.name!r}: rank {rank} saved (key_dtype, value_dtype, dim, "
            f"columns, format) = {theirs}, other ranks saved {mine}"
        )
    return dataclasses.replace(
        into,
        shard_count=into.shard_count + entry.shard_count,
        shards=into.shards + entry.shards,
    )


# --- JSON -----------------------------------------------------------------------------
def to_json(obj: Manifest | RankManifest) -> bytes:
    """Serialise a manifest to UTF-8 JSON (stable key order)."""
    return json.dumps(dataclasses.asdict(obj), indent=1, sort_keys=True).encode()


def _entry_from_dict(d: dict[str, Any]) -> VariableEntry:
    return VariableEntry(
        **{
            **d,
            "columns": {k: ColumnSpec(**c) for k, c in d["columns"].items()},
            "shards": [ShardRecord(**s) for s in d["shards"]],
        }
    )


def manifest_from_json(data: bytes, where: str) -> Manifest:
    """Parse a merged manifest; a ``CheckpointError`` naming ``where`` when malformed."""
    try:
        d = json.loads(data)
        version = d["format_version"]
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: manifest format_version {version} is newer than this "
                f"de_store understands ({FORMAT_VERSION}); upgrade de_store"
            )
        variables = {k: _entry_from_dict(v) for k, v in d["variables"].items()}
        return Manifest(**{**d, "variables": variables})
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: manifest is not valid ({err})") from err


def rank_manifest_from_json(data: bytes, where: str) -> RankManifest:
    """Parse a per-rank manifest."""
    try:
        d = json.loads(data)
        variables = {k: _entry_from_dict(v) for k, v in d["variables"].items()}
        return RankManifest(rank=d["rank"], proc_size=d["proc_size"], variables=variables)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: rank manifest is not valid ({err})") from err
