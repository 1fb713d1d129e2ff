"""Finding and describing checkpoints without TensorFlow (``de-store ls`` and ``inspect``).

A checkpoint is a folder holding a ``COMMIT-*`` record, a ``manifest-*.json``, a ``_ranks/``
folder of per-rank manifests, or a staging folder ``NAME.pending``. Only a ``COMMIT-*``
record makes it committed (see :mod:`de_store.checkpoint.commit`). An incremental checkpoint
("delta") names its parent; its chain is the full checkpoint and the deltas up to it (see
:mod:`de_store.checkpoint.chain`).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from collections.abc import Callable
from typing import Any

from de_store.backends import Backend, open_backend, open_location
from de_store.checkpoint import gc, names
from de_store.checkpoint.chain import iter_manifests, parent_folder
from de_store.checkpoint.commit import (
    commit_time,
    committed_folder,
    latest_generation,
    read_manifest,
)
from de_store.checkpoint.manifest import Manifest
from de_store.errors import CheckpointError

_STEP = re.compile(r"(\d+)$")


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """One checkpoint found by :func:`list_checkpoints`.

    Attributes
    ----------
    path: folder relative to the listed URL ("" when the URL is the checkpoint itself).
    status: "committed"; "orphaned" (committed, its TF checkpoint deleted: gc removes it);
        "parent" (committed, its TF checkpoint deleted, but a kept checkpoint's chain
        needs it: gc keeps it); "broken" (committed, but a delta whose chain cannot be
        restored: a link is missing, not committed, or rewritten since); "damaged" (its
        commit record or manifest cannot be read: ``problem`` says why); "uncommitted" (a
        save in progress or interrupted) or "aborted".
    step: from the folder name (``ckpt-12`` -> 12) or the manifest's ``step`` metadata.
    committed: commit time (seconds since the epoch), None when not committed.
    bytes: shard bytes of a committed checkpoint (from its manifest), else of all its files.
    variables: number of variables (committed checkpoints), else None.
    kind: "full" or "delta" (an incremental checkpoint) when committed, else None.
    parent: a delta's parent checkpoint as its manifest names it, else None.
    problem: why a "damaged" checkpoint cannot be read, else None.
    """

    path: str
    status: str
    step: int | None
    committed: float | None
    bytes: int
    variables: int | None
    kind: str | None = None
    parent: str | None = None
    problem: str | None = None


def _marker_folder(path: str) -> str | None:
    """The checkpoint folder that a file ``path`` marks as one, if it does.

    Anything inside a staging folder ``NAME.pending`` belongs to that (uncommitted) folder,
    even a commit record written just before a rename that never happened.
    """
    parts = path.split("/")
    for index, part in enumerate(parts[:-1]):
        if names.is_pending(part):
            return "/".join(parts[: index + 1])
    head, base = posixpath.split(path)
    if base.startswith(names.COMMIT_PREFIX) or (
        base.startswith(names.MANIFEST_PREFIX) and base.endswith(".json")
    ):
        return head
    if names.RANKS_DIR in parts[:-1]:
        return "/".join(parts[: parts.index(names.RANKS_DIR)])
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
    name = names.checkpoint_of_pending(posixpath.basename(folder))
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def summarize(backend: Backend, folder: str, files: list[str]) -> CheckpointSummary:
    """Status, step, commit time and size of the checkpoint ``folder``.

    A committed checkpoint whose commit record or manifest cannot be read is "damaged",
    with the reason in ``problem``; the others are listed as usual.
    """
    if folder and committed_folder(backend, folder) == folder:
        try:
            return _committed_summary(backend, folder)
        except CheckpointError as err:
            return dataclasses.replace(
                _files_summary(backend, folder, files, "damaged"), problem=str(err)
            )
    aborted = any(posixpath.basename(p) == names.ABORT_NAME for p in files)
    return _files_summary(backend, folder, files, "aborted" if aborted else "uncommitted")


def _committed_summary(backend: Backend, folder: str) -> CheckpointSummary:
    _, manifest = read_manifest(backend, folder)
    committed = commit_time(backend, folder, latest_generation(backend, folder))
    return CheckpointSummary(
        folder,
        "committed",
        _step_of(folder, manifest),
        committed,
        manifest.bytes,
        len(manifest.variables),
        "delta" if manifest.incremental else "full",
        manifest.parent,
    )


def _files_summary(
    backend: Backend, folder: str, files: list[str], status: str
) -> CheckpointSummary:
    """A checkpoint described by its files alone (no readable manifest)."""
    size = sum(backend.size(p) for p in files)
    return CheckpointSummary(folder, status, _step_of(folder, None), None, size, None)


def _mark_orphans(backend: Backend, summaries: list[CheckpointSummary]) -> list[CheckpointSummary]:
    """Committed checkpoints whose TF checkpoint is gone, as "orphaned".

    ``CheckpointManager`` deletes TF checkpoints behind the saver's back; their KV data is
    removed by the next save or ``de-store gc``, and until then is listed as orphaned. What
    counts as gone is what gc deletes (:func:`de_store.checkpoint.gc.tf_checkpoints_gone`).
    """
    if not any(s.status == "committed" for s in summaries):
        return summaries
    gone = gc.tf_checkpoints_gone(backend)
    return [
        dataclasses.replace(s, status="orphaned")
        if s.status == "committed" and s.path in gone
        else s
        for s in summaries
    ]


def list_checkpoints(
    url: str, storage_options: dict[str, Any] | None = None
) -> list[CheckpointSummary]:
    """Every checkpoint under ``url``, committed or not, ordered by step then path."""
    backend = open_backend(url, storage_options)
    found = find_checkpoint_folders(backend)
    if "" in found:  # the URL is a checkpoint folder itself
        parent, name = open_location(url, storage_options)
        (summary,) = _mark_broken(parent, _mark_orphans(parent, [summarize(parent, name, [])]))
        return [dataclasses.replace(summary, path="")]
    summaries = [summarize(backend, folder, files) for folder, files in sorted(found.items())]
    summaries = _mark_broken(backend, _mark_orphans(backend, summaries))
    summaries = _mark_parents(backend, summaries)
    return sorted(summaries, key=lambda s: (s.step is None, s.step or 0, s.path))


def _mark_broken(backend: Backend, summaries: list[CheckpointSummary]) -> list[CheckpointSummary]:
    """Committed deltas whose chain cannot be restored, as "broken": a link missing, not
    committed or rewritten since (checked as a restore checks it), or a broken parent. Each
    link is read once; a chain that leaves the listed location is not judged."""
    by_path = {s.path: s for s in summaries}
    verdicts: dict[str, bool] = {}

    def broken(summary: CheckpointSummary) -> bool:
        if summary.kind != "delta" or summary.parent is None:
            return False
        if summary.path not in verdicts:
            verdicts[summary.path] = True  # a chain that comes back to itself is broken
            verdicts[summary.path] = _link_broken(backend, summary, by_path, broken)
        return verdicts[summary.path]

    return [dataclasses.replace(s, status="broken") if broken(s) else s for s in summaries]


def _link_broken(
    backend: Backend,
    summary: CheckpointSummary,
    by_path: dict[str, CheckpointSummary],
    broken: Callable[[CheckpointSummary], bool],
) -> bool:
    """Whether the delta's parent is missing, not committed or rewritten since, or broken."""
    try:
        parent = parent_folder(backend, summary.path, summary.parent or "")
    except CheckpointError:
        return False  # outside the listed location: not judged here
    links = iter_manifests(backend, summary.path)
    try:
        next(links)
        next(links)  # the parent, checked against the delta as a restore checks it
        if parent in by_path:
            return broken(by_path[parent])
        for _ in links:  # the rest of the chain is not listed: check it here
            pass
    except CheckpointError:
        return True
    return False


def _mark_parents(backend: Backend, summaries: list[CheckpointSummary]) -> list[CheckpointSummary]:
    """Orphaned checkpoints that a kept (committed) checkpoint's chain needs, as "parent"."""
    by_path = {s.path: s for s in summaries}
    needed: set[str] = set()
    for summary in summaries:
        if summary.status != "committed":
            continue
        link = summary
        while link.parent is not None:
            try:
                folder = parent_folder(backend, link.path, link.parent)
            except CheckpointError:
                break  # outside the listed location
            if folder in needed or folder not in by_path:
                break
            needed.add(folder)
            link = by_path[folder]
    return [
        dataclasses.replace(s, status="parent")
        if s.status == "orphaned" and s.path in needed
        else s
        for s in summaries
    ]


def describe(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the committed checkpoint ``url`` holds, as a JSON-serialisable dict.

    Keys: ``url``, ``folder``, ``generation``, ``committed``, ``format_version``, ``created``,
    ``bytes``, ``rows``, ``topology`` (``proc_size``, ``shards_per_rank``), ``metadata``,
    ``versions``, ``kind`` ("full" or "delta"), ``parent`` (as the manifest names it, or
    None), ``chain`` (see :func:`describe_chain`), ``chain_error`` (why the chain cannot be
    restored, or None) and ``variables``: name -> ``dim``, ``key_dtype``, ``value_dtype``,
    ``columns`` (name -> dtype, dim), ``format``, ``compression`` (the codec, "none"),
    ``compression_level``, ``value_precision`` (what ``value`` is stored at: its own dtype
    or ``bfloat16``, ``float16``, ``int8``), ``stored_columns`` (the columns as stored where
    they differ: name -> dtype, dim), ``rows``, ``shards``, ``bytes``,
    ``files``, ``ranks`` (rank -> shard count), ``incremental``, ``removed`` (tombstones:
    keys removed since the parent), ``removed_files`` (the tombstone shard files) and
    ``chain_links`` (checkpoints its restore reads).

    Raises
    ------
    CheckpointNotFoundError
        ``url`` holds no committed checkpoint.
    """
    backend, name = open_location(url, storage_options)
    folder, manifest = read_manifest(backend, name)
    generation = latest_generation(backend, folder)
    record = json.loads(backend.read_bytes(backend.join(folder, names.commit_name(generation))))
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
            "compression": entry.compression,
            "compression_level": entry.compression_level,
            "value_precision": entry.value_precision or entry.value_dtype,
            "stored_columns": {c: dataclasses.asdict(s) for c, s in entry.stored_columns.items()},
            "rows": entry.rows,
            "shards": entry.shard_count,
            "bytes": entry.bytes,
            "files": [f["path"] for s in entry.shards for f in s.info["files"]],
            "removed_files": [f["path"] for s in entry.removed for f in s.info["files"]],
            "ranks": {str(r): n for r, n in sorted(ranks.items())},
            "incremental": entry.incremental,
            "removed": entry.removed_rows,
        }
    chain, chain_error = describe_chain(backend, folder)
    for var_name, var in variables.items():
        var["chain_links"] = _links_of(var_name, chain)
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
        "kind": "delta" if manifest.incremental else "full",
        "parent": manifest.parent,
        "chain": chain,
        "chain_error": chain_error,
        "variables": variables,
    }


def describe_chain(backend: Backend, name: str) -> tuple[list[dict[str, Any]], str | None]:
    """The chain of the committed checkpoint ``name``, oldest (a full one) first, and why it
    is broken (None when every link is there and committed).

    Each link: ``folder`` (within ``backend``), ``kind`` ("full" or "delta"), ``rows``,
    ``removed`` (tombstones), ``bytes``, ``created`` and ``incremental``: the variables
    saved as deltas in it. A full checkpoint is a chain of one link. A broken chain starts
    with the link that could not be read, of kind "missing" (not there, not committed or
    rewritten since).
    """
    links: list[dict[str, Any]] = []
    parent: str | None = None
    try:
        for folder, manifest in iter_manifests(backend, name):
            parent = manifest.parent and parent_folder(backend, folder, manifest.parent)
            links.append(
                {
                    "folder": folder,
                    "kind": "delta" if manifest.incremental else "full",
                    "rows": sum(e.rows for e in manifest.variables.values()),
                    "removed": sum(e.removed_rows for e in manifest.variables.values()),
                    "bytes": manifest.bytes,
                    "created": manifest.created,
                    "incremental": sorted(
                        n for n, e in manifest.variables.items() if e.incremental
                    ),
                }
            )
            if not manifest.incremental:
                break
    except CheckpointError as err:
        if parent is not None:  # the link that could not be read
            links.append({"folder": parent, "kind": "missing", "rows": 0, "removed": 0,
                          "bytes": 0, "created": None, "incremental": []})  # fmt: skip
        return links[::-1], str(err)
    return links[::-1], None


def _links_of(variable: str, chain: list[dict[str, Any]]) -> int:
    """How many links of ``chain`` (oldest first) a restore of ``variable`` reads."""
    count = 0
    for link in reversed(chain):
        count += 1
        if variable not in link["incremental"]:
            break
    return count


def checkpoint_manifest(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Backend, Manifest]:
    """The committed checkpoint's folder (as a backend) and its manifest."""
    backend, name = open_location(url, storage_options)
    folder, manifest = read_manifest(backend, name)
    return backend.sub(folder), manifest
