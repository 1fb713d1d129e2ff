"""The checkpoint manifest: what a committed checkpoint holds.

Each rank writes a :class:`RankManifest` for the shards it wrote; after the barrier rank 0
merges them into one :class:`Manifest` (as ``MergeV2Checkpoints`` merges TF's index files)
and commits it. Readers trust only the merged manifest of a committed checkpoint.

An incremental checkpoint (format version 2) names its ``parent``; its incremental entries
hold only the rows changed since the parent and tombstone shards of the keys removed since
(see :mod:`de_store.checkpoint.chain`). A manifest without incremental entries is written as
version 1, so readers that predate incremental checkpoints keep reading full ones.

A checkpoint saved for a TF checkpoint (through ``tf.train.Checkpoint``) records which
one in its own field ``tf_checkpoint`` (:class:`TFCheckpointRef`), apart from the user's
``metadata``; such manifests are version 3, so older readers refuse them by their version
instead of failing on the unknown field.

A variable saved compressed or with its values at another precision (bfloat16, float16,
int8: :mod:`de_store.formats.precision`) records both in its entry, with the columns as
stored (``stored_columns``), and each shard record names its precision, so a reader of one
shard converts its values back. Such manifests are version 4; entries without these fields
hold values at their own dtype, uncompressed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from typing import Any

from de_store.errors import CheckpointError

#: The newest manifest version this de_store reads and writes.
FORMAT_VERSION = 4
#: The version of manifests without incremental entries (what older readers understand).
FULL_FORMAT_VERSION = 1
#: The version of manifests with incremental entries and no ``tf_checkpoint``.
INCREMENTAL_FORMAT_VERSION = 2
#: The version of manifests with ``tf_checkpoint`` and no compression or precision.
TF_FORMAT_VERSION = 3
#: The value precisions this de_store reads (``None``: the variable's own dtype).
VALUE_PRECISIONS = ("bfloat16", "float16", "int8")


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
    part: ``part_buckets[i]`` is the bucket held by part ``i`` of the file (a shard in
    table order has ``num_buckets`` 1, every part in bucket 0).
    ``value_precision``: the precision its ``value`` column is stored at, which a reader
    converts back from (None: the variable's own dtype).
    """

    rank: int
    shard: int
    info: dict[str, Any]
    num_buckets: int
    part_buckets: list[int]
    value_precision: str | None = None

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
    #: True: the rows apply on top of the same variable in the parent checkpoint's chain.
    incremental: bool = False
    #: Tombstone shards (incremental entries only): the keys removed since the parent,
    #: bucketed like the rows, with a ``value`` column of dim 1 int64 (unused).
    removed: list[ShardRecord] = dataclasses.field(default_factory=list)
    #: The codec of every shard file of the entry ("none": stored at full width).
    compression: str = "none"
    #: The codec's level (None: its default).
    compression_level: int | None = None
    #: The precision ``value`` is stored at (None: ``value_dtype``, unchanged).
    value_precision: str | None = None
    #: The columns as the shards store them, where they differ from ``value_dtype`` and
    #: ``columns`` (``value`` at its precision, int8's ``value_scale``); empty otherwise.
    stored_columns: dict[str, ColumnSpec] = dataclasses.field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def removed_rows(self) -> int:
        return sum(s.rows for s in self.removed)

    @property
    def bytes(self) -> int:
        """Bytes of every shard file of the entry, tombstones included."""
        return sum(s.bytes for s in self.shards) + sum(s.bytes for s in self.removed)


@dataclasses.dataclass(frozen=True)
class RankManifest:
    """What one rank wrote; its presence is that rank's arrival at the barrier."""

    rank: int
    proc_size: int
    variables: dict[str, VariableEntry]
    #: The parent checkpoint of this rank's incremental entries (see ``Manifest.parent``).
    parent: str | None = None
    parent_created: float | None = None


@dataclasses.dataclass(frozen=True)
class TFCheckpointRef:
    """The TF checkpoint a KV checkpoint was saved for: de_store's own record of it.

    Attributes
    ----------
    path: the TF checkpoint's prefix relative to the KV checkpoint folder (``relative``,
        e.g. ``../../ckpt-3`` for ``run/ckpt-3`` and ``run/de_store/ckpt-3``) when both are
        on one filesystem, so the pair can move together; else its absolute URL, only
        ever compared with the location of a TF checkpoint being saved now.
    relative: whether ``path`` is relative to the KV checkpoint folder.
    checkpoint_id: random id of the TF save, also saved in the TF checkpoint itself; a
        restore refuses a KV checkpoint whose id differs from the TF checkpoint's.
    """

    path: str
    relative: bool
    checkpoint_id: str

    def __post_init__(self) -> None:
        types = (type(self.path), type(self.relative), type(self.checkpoint_id))
        if types != (str, bool, str) or not self.path or not self.checkpoint_id:
            raise TypeError(
                "tf_checkpoint needs a non-empty str path, a bool relative and a non-empty "
                f"str checkpoint_id, found {dataclasses.asdict(self)}"
            )


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The merged manifest of a checkpoint.

    ``parent`` (incremental checkpoints): the checkpoint its incremental entries apply on,
    its bare folder name when it is a sibling folder (the usual case), else its absolute
    URL. ``parent_created`` is the parent manifest's ``created`` when this one was saved: a
    parent rewritten since no longer matches, and restoring the chain fails instead of
    mixing generations.
    """

    format_version: int
    created: float
    proc_size: int
    variables: dict[str, VariableEntry]
    versions: dict[str, str]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    parent: str | None = None
    parent_created: float | None = None
    #: The TF checkpoint this one was saved for (de_store's own field), None otherwise.
    tf_checkpoint: TFCheckpointRef | None = None

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.variables.values())

    @property
    def incremental(self) -> bool:
        """Whether any variable of the checkpoint is saved as a delta on ``parent``."""
        return any(v.incremental for v in self.variables.values())

    def variable(self, name: str, where: str) -> VariableEntry:
        """The entry of ``name``; a ``CheckpointError`` naming the checkpoint when absent."""
        try:
            return self.variables[name]
        except KeyError:
            known = ", ".join(sorted(self.variables)) or "none"
            hint = ""
            if "/" in name and name.replace("/", "_") in self.variables:
                hint = (
                    f" (TFRA writes {name!r} as {name.replace('/', '_')!r}: import it with "
                    f"`de-store convert ... --name {name}`)"
                )
            raise CheckpointError(
                f"checkpoint {where} has no variable {name!r}; it holds: {known}{hint}"
            ) from None


def library_versions() -> dict[str, str]:
    """Versions of the libraries that wrote a checkpoint."""
    return dict(_installed_versions())


@functools.cache
def _installed_versions() -> dict[str, str]:
    # read once a process: each package's metadata is a file read (docs/benchmarks.md)
    from importlib import metadata

    versions = {}
    for dist in ("de_store", "tensorflow", "pyarrow", "fsspec", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def merge_rank_manifests(
    ranks: Sequence[RankManifest],
    *,
    metadata: dict[str, Any] | None = None,
    tf_checkpoint: TFCheckpointRef | None = None,
) -> Manifest:
    """Merge every rank's manifest into one; all ranks must agree on each variable and on
    the parent checkpoint (a ``CheckpointError`` names the rank that does not).
    ``tf_checkpoint``: the TF checkpoint this one is saved for (the TF hook's saves)."""
    ordered = sorted(ranks, key=lambda m: m.rank)
    proc_size = ordered[0].proc_size
    parent = (ordered[0].parent, ordered[0].parent_created)
    merged: dict[str, VariableEntry] = {}
    for rank_manifest in ordered:
        theirs = (rank_manifest.parent, rank_manifest.parent_created)
        if theirs != parent:
            raise CheckpointError(
                f"rank {rank_manifest.rank} saved on parent checkpoint (name, created) = "
                f"{theirs}, rank {ordered[0].rank} on {parent}: all ranks must save deltas "
                "on the same committed checkpoint"
            )
        for name, entry in rank_manifest.variables.items():
            merged[name] = _merge_entry(merged.get(name), entry, rank_manifest.rank)
    incremental = any(e.incremental for e in merged.values())
    encoded = any(is_encoded(e) for e in merged.values())
    return Manifest(
        format_version=_version(incremental, tf_checkpoint, encoded),
        created=time.time(),
        proc_size=proc_size,
        variables=merged,
        versions=library_versions(),
        metadata=dict(metadata or {}),
        parent=parent[0] if incremental else None,
        parent_created=parent[1] if incremental else None,
        tf_checkpoint=tf_checkpoint,
    )


def _version(
    incremental: bool, tf_checkpoint: TFCheckpointRef | None, encoded: bool = False
) -> int:
    """The oldest version that holds what the manifest holds (``encoded``: a variable is
    compressed or stored at another precision)."""
    if encoded:
        return FORMAT_VERSION
    if tf_checkpoint is not None:
        return TF_FORMAT_VERSION
    return INCREMENTAL_FORMAT_VERSION if incremental else FULL_FORMAT_VERSION


def _merge_entry(into: VariableEntry | None, entry: VariableEntry, rank: int) -> VariableEntry:
    if into is None:
        return entry
    fields = (into.key_dtype, into.value_dtype, into.dim, into.columns, into.format)
    mine = (*fields, *_encoding(into), into.incremental)
    theirs = (entry.key_dtype, entry.value_dtype, entry.dim, entry.columns, entry.format,
              *_encoding(entry), entry.incremental)  # fmt: skip
    if mine != theirs:
        raise CheckpointError(
            f"variable {entry.name!r}: rank {rank} saved (key_dtype, value_dtype, dim, "
            f"columns, format, compression, compression_level, value_precision, incremental)"
            f" = {theirs}, other ranks saved {mine}"
        )
    return dataclasses.replace(
        into,
        shard_count=into.shard_count + entry.shard_count,
        shards=into.shards + entry.shards,
        removed=into.removed + entry.removed,
    )


def _encoding(entry: VariableEntry) -> tuple[str, int | None, str | None]:
    return (entry.compression, entry.compression_level, entry.value_precision)


def is_encoded(entry: VariableEntry) -> bool:
    """Whether ``entry``'s shards are compressed or hold values at another precision."""
    return _encoding(entry) != ("none", None, None)


# --- JSON -----------------------------------------------------------------------------
def to_json(obj: Manifest | RankManifest) -> bytes:
    """Serialise a manifest to UTF-8 JSON (stable key order).

    The fields of incremental checkpoints and ``tf_checkpoint`` are left out where they
    hold their defaults, so a full checkpoint's manifest reads as before (version 1) to
    older readers.
    """
    d = _plain(obj)
    if d.get("parent_created") is None:
        d.pop("parent_created", None)
    if d.get("tf_checkpoint", 0) is None:
        del d["tf_checkpoint"]
    if isinstance(obj, RankManifest) and d["parent"] is None:
        d.pop("parent")
    for entry in d["variables"].values():
        if not entry["incremental"] and not entry["removed"]:
            del entry["incremental"], entry["removed"]
        _drop_defaults(entry)
    # no indent: json uses its C encoder only then (a manifest can list many thousand parts)
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def _plain(obj: Any) -> Any:
    """A manifest dataclass as JSON-ready dicts and lists, without copying the shard
    ``info`` dicts, which are plain already (``dataclasses.asdict`` deep-copies them)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()} if _has_dataclass(obj.values()) else obj
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj] if _has_dataclass(obj) else list(obj)
    return obj


#: Entry fields left out of the JSON where they hold these defaults: a manifest of values
#: at their own dtype, uncompressed, reads as it did before the fields existed.
_ENTRY_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("compression", "none"),
    ("compression_level", None),
    ("value_precision", None),
    ("stored_columns", {}),
)


def _drop_defaults(entry: dict[str, Any]) -> None:
    for name, default in _ENTRY_DEFAULTS:
        if name in entry and entry[name] == default:
            del entry[name]
    for record in (*entry["shards"], *entry.get("removed", ())):
        if record.get("value_precision", 0) is None:
            del record["value_precision"]


def _has_dataclass(values: Any) -> bool:
    return any(dataclasses.is_dataclass(v) for v in values)


def _entry_from_dict(d: dict[str, Any], where: str) -> VariableEntry:
    entry = VariableEntry(
        **{
            **d,
            "columns": {k: ColumnSpec(**c) for k, c in d["columns"].items()},
            "shards": [ShardRecord(**s) for s in d["shards"]],
            "removed": [ShardRecord(**s) for s in d.get("removed", [])],
            "stored_columns": {k: ColumnSpec(**c) for k, c in d.get("stored_columns", {}).items()},
        }
    )
    for precision in (entry.value_precision, *(r.value_precision for r in entry.shards)):
        if precision is not None and precision not in VALUE_PRECISIONS:
            raise CheckpointError(
                f"{where}: variable {entry.name!r} is stored at value_precision "
                f"{precision!r}, which this de_store does not read (it reads "
                f"{list(VALUE_PRECISIONS)}); upgrade de_store"
            )
    return entry


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
        variables = {k: _entry_from_dict(v, where) for k, v in d["variables"].items()}
        ref = d.get("tf_checkpoint")
        tf_checkpoint = TFCheckpointRef(**ref) if ref is not None else None
        return Manifest(**{**d, "variables": variables, "tf_checkpoint": tf_checkpoint})
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: manifest is not valid ({err})") from err


def rank_manifest_from_json(data: bytes, where: str) -> RankManifest:
    """Parse a per-rank manifest."""
    try:
        d = json.loads(data)
        variables = {k: _entry_from_dict(v, where) for k, v in d["variables"].items()}
        return RankManifest(
            rank=d["rank"],
            proc_size=d["proc_size"],
            variables=variables,
            parent=d.get("parent"),
            parent_created=d.get("parent_created"),
        )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: rank manifest is not valid ({err})") from err
