"""Removing checkpoint data nobody can restore any more.

- Orphans: committed KV checkpoints written for a TF checkpoint whose bundle is gone
  (``CheckpointManager(max_to_keep=...)`` deleted it, or the user did).
- Abandoned saves: staging folders and uncommitted checkpoint folders.
"""

from __future__ import annotations

import dataclasses

from de_store.backends.base import Backend
from de_store.errors import CheckpointError
from de_store.saver.commit import (
    PENDING_SUFFIX,
    REPLACED_INFIX,
    committed_folder,
    read_manifest,
)


@dataclasses.dataclass(frozen=True)
class Garbage:
    """A folder ``gc`` removes (or would remove, in a dry run), and why."""

    folder: str
    reason: str


def top_folders(backend: Backend) -> list[str]:
    """The names of the folders directly under the backend's root."""
    return sorted({path.split("/", 1)[0] for path in backend.list("") if "/" in path})


def find_orphans(backend: Backend, keep: str | None = None) -> list[Garbage]:
    """Committed checkpoints whose TF checkpoint (``manifest.metadata['tf_prefix']``) is gone."""
    found = []
    for folder in top_folders(backend):
        if folder == keep or committed_folder(backend, folder) != folder:
            continue
        try:
            _, manifest = read_manifest(backend, folder)
        except CheckpointError:
            continue
        prefix = manifest.metadata.get("tf_prefix")
        if not prefix:
            continue
        import tensorflow as tf  # only for checkpoints saved through tf.train.Checkpoint

        if not tf.io.gfile.exists(prefix + ".index"):
            found.append(Garbage(folder, f"its TF checkpoint {prefix} no longer exists"))
    return found


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
