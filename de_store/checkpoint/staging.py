"""Recognising what de_store's saves leave behind, by the names
:mod:`de_store.checkpoint.names` gives the files a save writes.

Used by :mod:`de_store.checkpoint.gc`: a folder counts as de_store's staging only when every
file in it has a name a save writes (:func:`~de_store.checkpoint.names.is_own`: commit
records, manifests, ``LOCK``, ``ABORT``, ``_ranks/`` and ``_barrier/`` files, shard files
ending as a registered shard format ends its files, and the local backend's temporary
files). A format or a column added later is recognised as its writer names it.

A restore into parameter-server tasks writes bundle indexes, each with a symlink to the
shard file it reads as its data file, in a folder ``.restore-{8 characters}`` of the
checkpoint folder (:mod:`de_store.saver.device_restore`), and removes it when it ends. A
process killed while restoring leaves it: gc removes it, as the restore's own, when it
holds only such files (a symlink is removed, never the shard file it points to).
"""

from __future__ import annotations

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.commit import committed_folder, parse_commit_record
from de_store.checkpoint.manifest import Manifest, manifest_from_json
from de_store.errors import CheckpointError


def _is_own_staging(path: str) -> bool:
    """Like :func:`is_own`, also inside a job token's folder of ``NAME.pending``."""
    token, _, rest = path.partition("/")
    return names.is_own(path) or (names.is_job_token(token) and names.is_own(rest))


def _has_commit(files: list[str]) -> bool:
    return any("/" not in f and f.startswith(names.COMMIT_PREFIX) for f in files)


def abandoned_in(
    backend: Backend, top: str, files: list[str], rename: bool
) -> list[tuple[str, str, str]]:
    """``(path, reason, kind)`` of what saves abandoned in the folder ``top``, whose files
    (relative to it) are ``files``. ``rename``: the backend commits by renaming, so
    staging lives in ``NAME.pending`` only; else saves write in the checkpoint folder."""
    scratch, files = _restore_scratch(files)
    if scratch is None:
        return []  # a folder named as a restore's holding a file of another name
    found = [(f"{top}/{name}", "bundle indexes of a restore that did not finish", "restore")
             for name in scratch]  # fmt: skip
    return found + _abandoned_saves(backend, top, files, rename)


def _restore_scratch(files: list[str]) -> tuple[list[str] | None, list[str]]:
    """The restore scratch folders among ``files`` (None: one holds a file a restore
    does not write), and the other files."""
    folders: dict[str, bool] = {}
    rest = []
    for path in files:
        folder, _, name = path.partition("/")
        if names.is_restore_scratch(folder) and name:
            own = names.is_restore_file(name)
            folders[folder] = folders.get(folder, True) and own
        else:
            rest.append(path)
    return (sorted(folders) if all(folders.values()) else None), rest


def _abandoned_saves(
    backend: Backend, top: str, files: list[str], rename: bool
) -> list[tuple[str, str, str]]:
    """:func:`abandoned_in` for the files saves write."""
    if names.is_pending(top):
        if all(map(_is_own_staging, files)):
            return [(top, "staging folder of a save that never committed", "staging")]
        return []
    if not all(map(names.is_own, files)):
        return []  # a file de_store does not write: not ours to judge
    base = names.replaced_checkpoint(top)
    if base is not None:
        if _has_commit(files) and committed_folder(backend, base) == base:
            return [(top, f"older copy of {base}, replaced by a rewrite", "replaced")]
        return []
    if rename:
        return []
    if not _has_commit(files):
        reason = "no commit record and only files of a save: a save that never committed"
        return [(top, reason, "uncommitted")]
    return _uncommitted_in_committed(backend, top, files)


def _uncommitted_in_committed(
    backend: Backend, top: str, files: list[str]
) -> list[tuple[str, str, str]]:
    """In a committed object-store folder: the ``_ranks/`` folders of save attempts that no
    commit record names, and shard files that no committed manifest references."""
    committed = _committed_generations(backend, top, files)
    if committed is None:
        return []  # a record or manifest that cannot be read: keep everything
    save_ids, referenced = committed
    found = []
    if save_ids is not None:
        for folder in _attempt_folders(files, save_ids):
            reason = "rank manifests of a save attempt that never committed"
            found.append((f"{top}/{folder}", reason, "attempt"))
    for path in files:
        if names.is_shard_file(path) and path not in referenced:
            reason = "shard file of a save that never committed"
            found.append((f"{top}/{path}", reason, "shard"))
    return found


def _committed_generations(
    backend: Backend, top: str, files: list[str]
) -> tuple[set[str] | None, set[str]] | None:
    """The save ids of ``top``'s commit records (None if one predates save ids) and every
    file their manifests reference; None when one cannot be read."""
    generations = [g for g in map(names.commit_generation, files) if g is not None]
    save_ids: set[str] | None = set()
    referenced: set[str] = set()
    for generation in generations:
        try:
            record = parse_commit_record(
                backend.read_bytes(f"{top}/{names.commit_name(generation)}")
            )
            data = backend.read_bytes(f"{top}/{names.manifest_name(generation)}")
            manifest = manifest_from_json(data, Location(backend, top).url)
        except (CheckpointError, ValueError, FileNotFoundError):
            return None
        if save_ids is not None and "save_id" in record:
            save_ids.add(str(record["save_id"]))
        else:
            save_ids = None
        referenced |= _files_of(manifest)
    return save_ids, referenced


def _files_of(manifest: Manifest) -> set[str]:
    found = set()
    for entry in manifest.variables.values():
        for shard in entry.shards + entry.removed:
            found.add(shard.path)
            found.update(str(f["path"]) for f in shard.info.get("files", []))
    return found


def _attempt_folders(files: list[str], committed: set[str]) -> list[str]:
    """``_ranks/<x>`` folders holding no rank manifests of a committed save: ``x`` is a
    save id (rank manifests right in it) or a job token (``_ranks/<save id>/`` in it)."""
    inside: dict[str, list[list[str]]] = {}
    for path in files:
        parts = path.split("/")
        if parts[0] == names.RANKS_DIR and len(parts) > 2:
            inside.setdefault(parts[1], []).append(parts[2:])
    found = []
    for name, paths in sorted(inside.items()):
        ids = {p[1] for p in paths if p[0] == names.RANKS_DIR and len(p) > 2}
        if any(len(p) == 1 and names.is_rank_file(p[0]) for p in paths):
            ids.add(name)  # rank manifests right in it: the folder of a save id
        if not ids & committed:
            found.append(f"{names.RANKS_DIR}/{name}")
    return found


def newest_modification(backend: Backend, path: str) -> float | None:
    """The latest modification time of the files at or under ``path``; None when the
    store reports none for one of them, or there is none."""
    times = [backend.modified(p) for p in backend.list(path)]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)
