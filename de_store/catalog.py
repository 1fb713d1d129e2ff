"""Finding and describing checkpoints without TensorFlow (``de-store ls`` and ``inspect``).

A checkpoint is a folder holding a ``COMMIT-*`` record, a ``manifest-*.json``, a ``_ranks/``
folder of per-rank manifests, or a staging folder ``NAME.pending``. Only a ``COMMIT-*``
record makes it committed (see :mod:`de_store.saver.commit`).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from typing import Any

import fsspec

from de_store.backends import Backend, open_backend
from de_store.saver.commit import (
    ABORT_NAME,
    COMMIT_PREFIX,
    MANIFEST_PREFIX,
    PENDING_SUFFIX,
    RANKS_DIR,
    commit_name,
    committed_folder,
    latest_generation,
    read_manifest,
)
from de_store.saver.manifest import Manifest

_STEP = re.compile(r"(\d+)$")


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Backend, str]:
    """The backend of ``url``'s parent folder and the checkpoint's name inside it."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"checkpoint URL {url!r} must name a folder under a parent path")
    return open_backend(parent or ".", storage_options), name


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """One checkpoint found by :func:`list_checkpoints`.

    Attributes
    ----------
    path: folder relative to the listed URL ("" when the URL is the checkpoint itself).
    status: "committed", "uncommitted" (a save in progress or interrupted) or "aborted".
    step: from the folder name (``ckpt-12`` -> 12) or the manifest's ``step`` metadata.
    committed: commit time (seconds since the epoch), None when not committed.
    bytes: shard bytes of a committed checkpoint (from its manifest), else of all its files.
    variables: number of variables (committed checkpoints), else None.
    """

    path: str
    status: str
    step: int | None
    committed: float | None
    bytes: int
    variables: int | None


def _marker_folder(path: str) -> str | None:
    """The checkpoint folder that a file ``path`` marks as one, if it does.

    Anything inside a staging folder ``NAME.pending`` belongs to that (uncommitted) folder,
    even a commit record written just before a rename that never happened.
    """
    parts = path.split("/")
    for index, part in enumerate(parts[:-1]):
        if part.endswith(PENDING_SUFFIX):
            return "/".join(parts[: index + 1])
    head, base = posixpath.split(path)
    if base.startswith(COMMIT_PREFIX) or (
        base.startswith(MANIFEST_PREFIX) and base.endswith(".json")
    ):
        return head
    if RANKS_DIR in parts[:-1]:
        return "/".join(parts[: parts.index(RANKS_DIR)])
    return None


def find_checkpoint_folders(backend: Backend) -> dict[str, list[str]]:
    """Checkpoint folders under ``backend`` (any depth) -> their files."""
    paths = backend.list("")
    folders = {f for p in paths if (f := _marker_folder(p)) is not None}
    found: dict[str, list[str]] = {f: [] for f in folders}
    for path in paths:
        for folder in folders:
            if not folder or path.startswith(folder + "/"):
                found[folder].append(path)
    return found


def _step_of(folder: str, manifest: Manifest | None) -> int | None:
    if manifest is not None and isinstance(manifest.metadata.get("step"), int):
        return int(manifest.metadata["step"])
    name = posixpath.basename(folder).removesuffix(PENDING_SUFFIX)
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def summarize(backend: Backend, folder: str, files: list[str]) -> CheckpointSummary:
    """Status, step, commit time and size of the checkpoint ``folder``."""
    if folder and committed_folder(backend, folder) == folder:
        _, manifest = read_manifest(backend, folder)
        record = json.loads(
            backend.read_bytes(
                backend.join(folder, commit_name(latest_generation(backend, folder)))
            )
        )
        return CheckpointSummary(
            folder,
            "orphaned" if _tf_checkpoint_gone(manifest) else "committed",
            _step_of(folder, manifest),
            float(record["committed"]),
            manifest.bytes,
            len(manifest.variables),
        )
    aborted = any(posixpath.basename(p) == ABORT_NAME for p in files)
    return CheckpointSummary(
        folder,
        "aborted" if aborted else "uncommitted",
        _step_of(folder, None),
        None,
        sum(backend.size(p) for p in files),
        None,
    )


def _tf_checkpoint_gone(manifest: Manifest) -> bool:
    """Whether the TF checkpoint this KV checkpoint was saved for has been deleted.

    ``CheckpointManager`` deletes TF checkpoints behind the saver's back; their KV data is
    removed by the next save or ``de-store gc``, and until then is listed as orphaned.
    """
    prefix = manifest.metadata.get("tf_prefix")
    if not isinstance(prefix, str) or not prefix:
        return False
    try:
        fs, path = fsspec.core.url_to_fs(prefix + ".index")
        return not fs.exists(path)
    except Exception:
        return False


def list_checkpoints(
    url: str, storage_options: dict[str, Any] | None = None
) -> list[CheckpointSummary]:
    """Every checkpoint under ``url``, committed or not, ordered by step then path."""
    backend = open_backend(url, storage_options)
    found = find_checkpoint_folders(backend)
    if "" in found:  # the URL is a checkpoint folder itself
        parent, name = open_location(url, storage_options)
        return [dataclasses.replace(summarize(parent, name, []), path="")]
    summaries = [summarize(backend, folder, files) for folder, files in sorted(found.items())]
    return sorted(summaries, key=lambda s: (s.step is None, s.step or 0, s.path))


def describe(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the committed checkpoint ``url`` holds, as a JSON-serialisable dict.

    Keys: ``url``, ``folder``, ``generation``, ``committed``, ``format_version``, ``created``,
    ``bytes``, ``rows``, ``topology`` (``proc_size``, ``shards_per_rank``), ``metadata``,
    ``versions`` and ``variables``: name -> ``dim``, ``key_dtype``, ``value_dtype``,
    ``columns`` (name -> dtype, dim), ``format``, ``rows``, ``shards``, ``bytes``,
    ``files`` and ``ranks`` (rank -> shard count).

    Raises
    ------
    CheckpointNotFoundError
        ``url`` holds no committed checkpoint.
    """
    backend, name = open_location(url, storage_options)
    folder, manifest = read_manifest(backend, name)
    generation = latest_generation(backend, folder)
    record = json.loads(backend.read_bytes(backend.join(folder, commit_name(generation))))
    variables = {}
    shards_per_rank: dict[int, int] = {}
    for var_name, entry in sorted(manifest.variables.items()):
        ranks: dict[int, int] = {}
        for shard in entry.shards:
            ranks[shard.rank] = ranks.get(shard.rank, 0) + 1
            shards_per_rank[shard.rank] = shards_per_rank.get(shard.rank, 0) + 1
        variables[var_name] = {
            "dim": entry.dim,
            "key_dtype": entry.key_dtype,
            "value_dtype": entry.value_dtype,
            "columns": {c: dataclasses.asdict(s) for c, s in entry.columns.items()},
            "format": entry.format,
            "rows": entry.rows,
            "shards": entry.shard_count,
            "bytes": entry.bytes,
            "files": [f["path"] for s in entry.shards for f in s.info["files"]],
            "ranks": {str(r): n for r, n in sorted(ranks.items())},
        }
    return {
        "url": url,
        "folder": folder,
        "generation": generation,
        "committed": record["committed"],
        "format_version": manifest.format_version,
        "created": manifest.created,
        "bytes": manifest.bytes,
        "rows": sum(v["rows"] for v in variables.values()),
        "topology": {
            "proc_size": manifest.proc_size,
            "shards_per_rank": {str(r): n for r, n in sorted(shards_per_rank.items())},
        },
        "metadata": manifest.metadata,
        "versions": manifest.versions,
        "variables": variables,
    }


def checkpoint_manifest(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Backend, Manifest]:
    """The committed checkpoint's folder (as a backend) and its manifest."""
    backend, name = open_location(url, storage_options)
    folder, manifest = read_manifest(backend, name)
    return backend.sub(folder), manifest
