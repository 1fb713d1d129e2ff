"""Where a checkpoint's files go and how it becomes visible (committed).

The strategy follows from the backend's declared capabilities:

- :class:`RenameCommit` (``supports_atomic_rename``, POSIX disks): ranks write into
  ``NAME.pending/``; rank 0 adds the merged manifest and the commit record there and
  renames the folder to ``NAME`` in one atomic step.
- :class:`MarkerCommit` (object stores): ranks write under the final ``NAME/`` folder;
  rank 0 writes the manifest, then creates ``NAME/COMMIT-<generation>`` write-once.

Either way a checkpoint is committed if and only if a ``COMMIT-<generation>`` record exists
in its folder, and readers never look at anything else first. The record holds the size and
crc32c of ``manifest-<generation>.json``.
"""

from __future__ import annotations

import abc
import json
import time
import uuid

import google_crc32c

from de_store.backends.base import Backend
from de_store.errors import CheckpointError, CheckpointNotFoundError
from de_store.saver.manifest import Manifest, manifest_from_json, to_json

COMMIT_PREFIX = "COMMIT-"
MANIFEST_PREFIX = "manifest-"
ABORT_NAME = "ABORT"
PENDING_SUFFIX = ".pending"
REPLACED_INFIX = ".replaced-"
RANKS_DIR = "_ranks"


def commit_name(generation: int) -> str:
    return f"{COMMIT_PREFIX}{generation:06d}"


def manifest_name(generation: int) -> str:
    return f"{MANIFEST_PREFIX}{generation:06d}.json"


class CommitStrategy(abc.ABC):
    """Names the folder ranks write into and publishes it once complete."""

    def __init__(self, backend: Backend, name: str) -> None:
        self.backend = backend
        self.name = name.strip("/")

    @property
    @abc.abstractmethod
    def staging(self) -> str:
        """Folder (relative to the backend root) that ranks write into."""

    @abc.abstractmethod
    def commit(self, manifest: Manifest) -> None:
        """Write the merged manifest and publish the checkpoint atomically (rank 0 only)."""

    def abort(self, reason: str) -> None:
        """Record why the save failed, so waiting ranks stop with that reason."""
        self.backend.write_bytes(self.backend.join(self.staging, ABORT_NAME), reason.encode())

    @property
    def where(self) -> str:
        return f"{self.backend.url.rstrip('/')}/{self.name}"

    def _write_manifest(self, folder: str, generation: int, manifest: Manifest) -> bytes:
        data = to_json(manifest)
        self.backend.write_bytes(self.backend.join(folder, manifest_name(generation)), data)
        return json.dumps(
            {
                "generation": generation,
                "manifest_crc32c": google_crc32c.value(data),
                "manifest_bytes": len(data),
                "committed": time.time(),
            }
        ).encode()


class RenameCommit(CommitStrategy):
    """Stage in ``NAME.pending/``, then one atomic directory rename to ``NAME``.

    Rewriting a committed ``NAME`` moves the old folder aside first; a crash between the
    two renames leaves the old checkpoint under ``NAME.replaced-*``, which readers use.
    """

    @property
    def staging(self) -> str:
        return self.name + PENDING_SUFFIX

    def commit(self, manifest: Manifest) -> None:
        record = self._write_manifest(self.staging, 1, manifest)
        self.backend.write_bytes(self.backend.join(self.staging, commit_name(1)), record)
        aside = None
        if self.backend.exists(self.name):
            aside = f"{self.name}{REPLACED_INFIX}{uuid.uuid4().hex[:12]}"
            self.backend.publish(self.name, aside)
        self.backend.publish(self.staging, self.name)
        if aside is not None:
            self.backend.delete(aside, recursive=True)


class MarkerCommit(CommitStrategy):
    """Write under ``NAME/`` and create ``NAME/COMMIT-<generation>`` write-once.

    Data files carry a per-save unique suffix, so a rewrite never touches the files of the
    committed generation; the highest committed generation is the checkpoint.
    """

    @property
    def staging(self) -> str:
        return self.name

    def commit(self, manifest: Manifest) -> None:
        generation = latest_generation(self.backend, self.name) + 1
        record = self._write_manifest(self.name, generation, manifest)
        self.backend.write_once(self.backend.join(self.name, commit_name(generation)), record)


def commit_strategy(backend: Backend, name: str) -> CommitStrategy:
    """The commit strategy the backend's capabilities call for."""
    if backend.capabilities.supports_atomic_rename:
        return RenameCommit(backend, name)
    return MarkerCommit(backend, name)


# --- reading committed checkpoints ------------------------------------------------------
def _generations(backend: Backend, folder: str) -> list[int]:
    found = []
    for path in backend.list(folder):
        base = path.rsplit("/", 1)[-1]
        if path.count("/") == folder.count("/") + 1 and base.startswith(COMMIT_PREFIX):
            suffix = base[len(COMMIT_PREFIX) :]
            if suffix.isdigit():
                found.append(int(suffix))
    return sorted(found)


def latest_generation(backend: Backend, folder: str) -> int:
    """The highest committed generation in ``folder``; 0 when none is committed."""
    generations = _generations(backend, folder)
    return generations[-1] if generations else 0


def committed_folder(backend: Backend, name: str) -> str | None:
    """The folder holding the committed checkpoint ``name``, or None.

    Normally ``name`` itself; after a crash in the middle of replacing a committed folder
    (rename strategy), the old one moved aside as ``name.replaced-*``.
    """
    name = name.strip("/")
    if latest_generation(backend, name):
        return name
    parent, _, base = name.rpartition("/")
    for path in backend.list(parent):
        rel = path[len(parent) + 1 :] if parent else path
        first = rel.split("/", 1)[0]
        if first.startswith(base + REPLACED_INFIX):
            folder = backend.join(parent, first)
            if latest_generation(backend, folder):
                return folder
    return None


def is_committed(backend: Backend, name: str) -> bool:
    """Whether ``name`` holds a committed checkpoint."""
    return committed_folder(backend, name) is not None


def read_manifest(backend: Backend, name: str) -> tuple[str, Manifest]:
    """``(folder, manifest)`` of the committed checkpoint ``name``, checked against its commit.

    Raises
    ------
    CheckpointNotFoundError
        ``name`` holds no committed checkpoint.
    CheckpointError
        The manifest is missing, truncated or altered since commit.
    """
    folder = committed_folder(backend, name)
    where = f"{backend.url.rstrip('/')}/{name.strip('/')}"
    if folder is None:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {where}: expected a {COMMIT_PREFIX}* marker there"
        )
    generation = latest_generation(backend, folder)
    record = json.loads(backend.read_bytes(backend.join(folder, commit_name(generation))))
    path = backend.join(folder, manifest_name(generation))
    try:
        data = backend.read_bytes(path)
    except FileNotFoundError as err:
        raise CheckpointError(f"{where}: committed but {path} is missing") from err
    crc = google_crc32c.value(data)
    if len(data) != record["manifest_bytes"] or crc != record["manifest_crc32c"]:
        raise CheckpointError(
            f"{backend.url.rstrip('/')}/{path}: expected {record['manifest_bytes']} bytes "
            f"with crc32c {record['manifest_crc32c']}, found {len(data)} bytes with crc32c {crc}"
        )
    return folder, manifest_from_json(data, where)
