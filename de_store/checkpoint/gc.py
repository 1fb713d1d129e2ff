"""Removing checkpoint data nobody can restore any more, and nothing else.

gc works on a folder *of* checkpoints (``run/de_store``, holding ``ckpt-1/``, ``ckpt-2/``)
and deletes only what de_store wrote and can show to be abandoned, recognised by
de_store's own file names (:mod:`de_store.checkpoint.staging`):

- staging of saves that never committed: ``NAME.pending/`` folders (with their ``LOCK``),
  and on object stores (no atomic rename) an uncommitted ``NAME/`` folder, the
  ``_ranks/<token>/`` folder of a save attempt no commit record names, and shard files no
  committed manifest references;
- ``NAME.replaced-*``: the old copy of a rewritten checkpoint, left by a crash;
- orphans: committed KV checkpoints whose TF checkpoint is gone
  (``CheckpointManager(max_to_keep=...)`` deleted it), see :func:`find_orphans`.

It refuses a location that is itself a checkpoint, or that holds committed checkpoints
deeper than its direct children (:func:`check_target`). Anything modified within the
grace period is kept (a save may be writing it), as is anything whose age the store does
not report; right before each deletion gc looks again (:func:`delete`), so a save that
committed or wrote since the plan keeps its data.
"""

from __future__ import annotations

import collections
import dataclasses
import posixpath
import threading
import time
from collections.abc import Iterable

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import binding, names, staging
from de_store.checkpoint.chain import parent_folder
from de_store.checkpoint.commit import (
    checked_manifest,
    committed_generations_in,
    recorded_manifest,
)
from de_store.checkpoint.manifest import Manifest
from de_store.checkpoint.parallel import map_in_threads
from de_store.errors import CheckpointError, GCRefusedError

#: Default grace period: staging and orphans modified more recently are kept.
DEFAULT_GRACE_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Garbage:
    """A folder or file that ``gc`` removes (or would remove), and why.

    ``kind``: "staging" (``.pending``), "replaced", "uncommitted" (an object-store folder
    without commit record), "attempt" (``_ranks/<token>``), "shard" (an unreferenced
    shard file), "restore" (``.restore-*`` bundle indexes of a restore into parameter
    server tasks that did not finish) or "orphan".
    """

    folder: str
    reason: str
    kind: str = "staging"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What gc would remove (``remove``), and what it found but keeps (``kept``, with
    the reason it is kept: younger than the grace period, or of unknown age)."""

    remove: list[Garbage]
    kept: list[Garbage]


# --- where gc may work ------------------------------------------------------------------
def check_target(backend: Backend, paths: Iterable[str] | None = None) -> None:
    """Refuse a location that is a checkpoint or holds checkpoints below its children.

    Raises
    ------
    GCRefusedError
        The location holds a commit record, manifest or ``_ranks/`` folder itself, or a
        committed checkpoint deeper than one folder down (outside staging folders).
    """
    root = Location(backend)
    where = root.url
    for path in backend.list("") if paths is None else paths:
        parts = path.split("/")
        if (len(parts) == 1 and names.is_checkpoint_file(parts[0])) or parts[0] == names.RANKS_DIR:
            raise GCRefusedError(
                f"refusing to gc {where}: it is a checkpoint itself ({(root / path).url}); "
                "point gc at the folder that holds the checkpoints, e.g. its parent"
            )
        deep = len(parts) > 2 and not names.is_pending(parts[0])
        record = names.commit_generation(parts[-1]) is not None
        if deep and record and names.RANKS_DIR not in parts:
            holder = "/".join(parts[:-2])
            raise GCRefusedError(
                f"refusing to gc {where}: it holds the committed checkpoint "
                f"{(root / '/'.join(parts[:-1])).url} below its direct children; gc works on "
                f"a folder of checkpoints: point it at {(root / holder).url}"
            )


# --- what is garbage --------------------------------------------------------------------
def find_abandoned(backend: Backend, paths: Iterable[str] | None = None) -> list[Garbage]:
    """Staging of saves that never committed, and old copies of rewritten checkpoints,
    recognised by de_store's names (``paths``: the listing to look at, default all)."""
    listing = backend.list("") if paths is None else list(paths)
    by_top: dict[str, list[str]] = {}
    for path in listing:
        top, _, rest = path.partition("/")
        if rest:
            by_top.setdefault(top, []).append(rest)
    found = []
    rename = backend.capabilities.supports_atomic_rename
    for top, files in sorted(by_top.items()):
        found += [Garbage(f, r, k) for f, r, k in staging.abandoned_in(backend, top, files, rename)]
    return found


def find_orphans(
    backend: Backend, keep: str | None = None, kept: Manifest | None = None
) -> list[Garbage]:
    """Committed checkpoints whose TF checkpoint is gone, and that no kept checkpoint's
    incremental chain needs.

    Only de_store's own record (``Manifest.tf_checkpoint``) counts, never user metadata;
    checkpoints without one (saved by ``de_store.save``, or by versions that kept the TF
    prefix in ``metadata``) are kept. A TF checkpoint counts as gone only in a TF folder
    that is demonstrably the one this location serves: ``keep`` (the checkpoint being
    saved now) records it, or another checkpoint's TF checkpoint is there. A location
    moved away from its TF checkpoints therefore keeps everything. ``kept``: the manifest
    ``keep`` was just committed with, by this process (it is not read back).
    """
    manifests = _committed_manifests(backend, {keep: kept} if keep and kept else {})
    gone = tf_checkpoints_gone(backend, manifests, keep)
    if keep is not None and keep in manifests:  # nothing saved after this one is an orphan
        created = manifests[keep].created
        gone = {f for f in gone if manifests[f].created < created}
    needed = _ancestors(backend, manifests, [f for f in manifests if f not in gone])
    return [
        Garbage(folder, "its TF checkpoint no longer exists", "orphan")
        for folder in sorted(gone)
        if folder not in needed
    ]


def tf_checkpoints_gone(
    backend: Backend, manifests: dict[str, Manifest] | None = None, keep: str | None = None
) -> set[str]:
    """The committed checkpoints (folder names) whose TF checkpoint is gone; see
    :func:`find_orphans` for when that counts as known."""
    if manifests is None:
        manifests = _committed_manifests(backend)
    bound = []
    for folder, manifest in manifests.items():
        ref = manifest.tf_checkpoint
        located = binding.resolve(backend, folder, ref) if ref is not None else None
        if located is None or posixpath.basename(located[1]) != folder:
            continue  # no record of ours, or one that does not name this folder: keep
        bound.append((folder, *located))
    states = map_in_threads(
        lambda item: None if item[0] == keep else binding.tf_checkpoint_state(*item[1:]),
        bound,
        SEARCH_READERS,
        "de_store-search",
    )
    groups: dict[tuple[int, str], dict[str, bool | None]] = {}
    live: set[tuple[int, str]] = set()
    for (folder, fs, prefix), state in zip(bound, states, strict=True):
        group = (id(fs), posixpath.dirname(prefix))
        groups.setdefault(group, {})[folder] = state
        if folder == keep or state:
            live.add(group)
    return {f for g in live for f, state in groups[g].items() if state is False and f != keep}


#: Most requests the orphan search makes at once. On an object store each commit record,
#: manifest and TF checkpoint it looks at is a request of its own, and each save through a
#: ``tf.train.Checkpoint`` looks at all of them.
SEARCH_READERS = 16


def _committed_manifests(
    backend: Backend, known: dict[str, Manifest] | None = None
) -> dict[str, Manifest]:
    """The manifest of every committed top folder (a commit record right in it), from one
    listing, the folders read in parallel; a manifest read before in this process is not
    read again (see :func:`_manifest`), nor one in ``known`` (a folder this process just
    committed, by name). A folder whose commit record or manifest cannot be read is left
    out."""
    generations = committed_generations_in(backend.list(""))
    top = [(f, g) for f, g in sorted(generations.items()) if "/" not in f]

    def read(item: tuple[str, int]) -> Manifest | None:
        if known and item[0] in known:
            return known[item[0]]
        try:
            return _manifest(backend, *item)
        except CheckpointError:
            return None

    found = map_in_threads(read, top, SEARCH_READERS, "de_store-search")
    return {folder: m for (folder, _), m in zip(top, found, strict=True) if m is not None}


#: Manifests read by :func:`_manifest`, by checkpoint URL, generation and the size and
#: crc32c its commit record gives; the most recent :data:`_SEEN_MAX`.
_seen: collections.OrderedDict[tuple[str, int, tuple[int, int]], Manifest] = (
    collections.OrderedDict()
)
_SEEN_MAX = 64
_seen_lock = threading.Lock()


def _manifest(backend: Backend, folder: str, generation: int) -> Manifest:
    """The manifest committed in ``folder`` at ``generation``.

    Each save through a ``tf.train.Checkpoint`` looks for orphans, reading every committed
    checkpoint's manifest: on an object store, a request each. The commit record is read
    every time (a folder deleted and saved again may hold another manifest under the same
    generation); the manifest only when the size and crc32c it records are not those of a
    manifest read before.
    """
    where = Location(backend, folder).url
    expected = recorded_manifest(backend, folder, generation, where)
    key = (where, generation, expected)
    with _seen_lock:
        if key in _seen:
            _seen.move_to_end(key)
            return _seen[key]
    manifest = checked_manifest(backend, folder, generation, expected, where)
    with _seen_lock:
        _seen[key] = manifest
        while len(_seen) > _SEEN_MAX:
            _seen.popitem(last=False)
    return manifest


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


# --- plan, then delete ------------------------------------------------------------------
def plan(backend: Backend, grace_s: float = DEFAULT_GRACE_S, now: float | None = None) -> Plan:
    """What gc would remove under ``backend`` now, and what it keeps for its age.

    Raises
    ------
    GCRefusedError
        See :func:`check_target`.
    ValueError
        ``grace_s`` is negative.
    """
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0 seconds, got {grace_s!r}")
    listing = backend.list("")
    check_target(backend, listing)
    now = time.time() if now is None else now
    remove, kept = [], []
    for item in find_abandoned(backend, listing) + find_orphans(backend):
        why = _too_young(backend, item, grace_s, now)
        if why is None:
            remove.append(item)
        else:
            kept.append(dataclasses.replace(item, reason=why))
    return Plan(remove, kept)


def delete(
    backend: Backend, items: Iterable[Garbage], grace_s: float = DEFAULT_GRACE_S
) -> tuple[list[Garbage], list[Garbage]]:
    """Delete each planned item that is still abandoned and still old enough, looked at
    again right before its deletion; return ``(deleted, kept)``, kept with the reason."""
    deleted, kept = [], []
    orphans: set[str] | None = None
    for item in items:
        if item.kind == "orphan":
            if orphans is None:  # looked at again once, when the first orphan is due
                orphans = {g.folder for g in find_orphans(backend)}
            still = item.folder in orphans
        else:
            top = item.folder.split("/", 1)[0]
            still = item in find_abandoned(backend, backend.list(top))
        why = "no longer abandoned" if not still else _too_young(backend, item, grace_s)
        if why is None:
            _remove(backend, item)
            deleted.append(item)
        else:
            kept.append(dataclasses.replace(item, reason=why))
    return deleted, kept


def collect(
    backend: Backend, *, dry_run: bool = False, grace_s: float = DEFAULT_GRACE_S
) -> list[Garbage]:
    """Find (and unless ``dry_run`` delete) abandoned and orphaned checkpoint data older
    than ``grace_s``; return what was (or would be) deleted."""
    found = plan(backend, grace_s)
    if dry_run:
        return found.remove
    return delete(backend, found.remove, grace_s)[0]


def remove_orphans(backend: Backend, keep: str, kept: Manifest | None = None) -> list[Garbage]:
    """Delete the orphans of the location where ``keep`` was just saved (``kept``: the
    manifest it was committed with, when known); return them.

    Run by the TF hook after each save (``CheckpointManager`` deletes TF checkpoints
    behind the saver's back). Without a grace period: ``keep`` anchors the TF folder, and
    only checkpoints committed before it can be orphans.
    """
    garbage = find_orphans(backend, keep, kept)
    for item in garbage:
        _remove(backend, item)
    return garbage


def _remove(backend: Backend, item: Garbage) -> None:
    """Delete ``item``. An orphan (a committed checkpoint) loses its commit records first:
    a reader that misses one of its files then finds it no longer committed, and reports
    the checkpoint removed (``commit.removed_while_read``), not damaged."""
    if item.kind == "orphan":
        for path in backend.list(item.folder):
            base = posixpath.basename(path)
            if posixpath.dirname(path) == item.folder and base.startswith(names.COMMIT_PREFIX):
                backend.delete(path)
    backend.delete(item.folder, recursive=True)


def _too_young(
    backend: Backend, item: Garbage, grace_s: float, now: float | None = None
) -> str | None:
    """Why ``item`` must be kept for its age (None: old enough to delete)."""
    newest = staging.newest_modification(backend, item.folder)
    if newest is None:
        return "its age cannot be determined: the store reports no modification time"
    age = (time.time() if now is None else now) - newest
    if age < grace_s:
        return f"modified {age:.0f} s ago, within the grace period of {grace_s:g} s"
    return None
