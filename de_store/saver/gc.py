"""Removing checkpoint data nobody can restore any more.

- Orphans: committed KV checkpoints written for a TF checkpoint whose bundle is gone
  (``CheckpointManager(max_to_keep=...)`` deleted it, or the user did), unless a kept
  checkpoint is a delta that needs it (an ancestor in its incremental chain).
- Abandoned saves: staging folders and uncommitted checkpoint folders.
"""

from __future__ import annotations

import dataclasses

from de_store.backends.base import Backend
from de_store.errors import CheckpointError
from de_store.saver.chain import parent_folder
from de_store.saver.commit import (
    PENDING_SUFFIX,
    REPLACED_INFIX,
    committed_folder,
    read_manifest,
)
from de_store.saver.manifest import Manifest


@dataclasses.dataclass(frozen=True)
class Garbage:
    """A folder ``gc`` removes (or would remove, in a dry run), and why."""

    folder: str
    reason: str


def top_folders(backend: Backend) -> list[str]:
    """The names of the folders directly under the backend's root."""
    return sorted({path.split("/", 1)[0] for path in backend.list("") if "/" in path})


def find_orphans(backend: Backend, keep: str | None = None) -> list[Garbage]:
    """Committed checkpoints whose TF checkpoint (``manifest.metadata['tf_prefix']``) is
    gone, and that no other kept checkpoint's chain needs."""
    manifests = _committed_manifests(backend)
    orphans = {}
    for folder, manifest in manifests.items():
        prefix = manifest.metadata.get("tf_prefix")
        if folder == keep or not prefix:
            continue
        import tensorflow as tf  # only for checkpoints saved through tf.train.Checkpoint

        if not tf.io.gfile.exists(prefix + ".index"):
            orphans[folder] = Garbage(folder, f"its TF checkpoint {prefix} no longer exists")
    needed = _ancestors(backend, manifests, [f for f in manifests if f not in orphans])
    return [garbage for folder, garbage in orphans.items() if folder not in needed]


def _committed_manifests(backend: Backend) -> dict[str, Manifest]:
    manifests = {}
    for folder in top_folders(backend):
        if committed_folder(backend, folder) != folder:
            continue
        try:
            manifests[folder] = read_manifest(backend, folder)[1]
        except CheckpointError:
            continue
    return manifests


def _ancestors(backend: Backend, manifests: dict[str, Manifest], kept: list[str]) -> set[str]:
    """Every folder the chains of ``kept`` checkpoints go through (their parents, theirs...)."""
    needed: set[str] = set()
    for folder in kept:
        manifest = manifests.get(folder)
        while manifest is not None and manifest.parent is not None:
            try:
                folder = parent_folder(backend, folder, manifest.parent)
            except CheckpointError:
                break  # a parent in another location: not ours to collect
            if folder in needed:
                break
            needed.add(folder)
            manifest = manifests.get(folder)
    return needed


def find_abandoned(backend: Backend) -> list[Garbage]:
    """Staging folders and folders without a commit record."""
    found = []
    for folder in top_folders(backend):
        if folder.endswith(PENDING_SUFFIX):
            found.append(Garbage(folder, "staging folder of a save that never committed"))
        elif REPLACED_INFIX in folder:
            base = folder.split(REPLACED_INFIX, 1)[0]
            if committed_folder(backend, base) == base:
                found.append(Garbage(folder, f"older copy of {base}, replaced by a rewrite"))
        elif committed_folder(backend, folder) is None:
            found.append(Garbage(folder, "no commit record: an interrupted or failed save"))
    return found


def remove_orphans(backend: Backend, keep: str | None = None) -> list[Garbage]:
    """Delete orphaned checkpoints (never ``keep``); return what was deleted."""
    garbage = find_orphans(backend, keep)
    for item in garbage:
        backend.delete(item.folder, recursive=True)
    return garbage


def collect(backend: Backend, *, dry_run: bool = False) -> list[Garbage]:
    """Find (and unless ``dry_run`` delete) abandoned and orphaned checkpoint data."""
    garbage = find_abandoned(backend) + find_orphans(backend)
    if not dry_run:
        for item in garbage:
            backend.delete(item.folder, recursive=True)
    return garbage
