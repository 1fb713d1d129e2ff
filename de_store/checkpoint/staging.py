"""Recognising what de_store's saves leave behind, by de_store's own file names.

Used by :mod:`de_store.checkpoint.gc`: a folder counts as de_store's staging only when every
file in it has a name a save writes (commit records, manifests, ``LOCK``, ``ABORT``,
``_ranks/`` and ``_barrier/`` files, shard files ``[removed-]r{rank}-s{shard}-{8 hex}``
ending as a registered shard format ends its files, and the local backend's
``.NAME.{12 hex}.tmp`` files). The ends come from each format's own
:meth:`~de_store.formats.ShardFormat.file_name_ends` (``.parquet``, ``.arrow``, and
``binary``'s ``-keys``, ``-values`` and ``-{column}`` of every slot column), so a format
or a column added later is recognised as its writer names it; a shard a parameter server
writes itself is a binary one whose files are TensorFlow bundles until the saving process
renames them (:func:`de_store.checkpoint.names.device_shard_file_name_ends`: ``.tf.index``,
``.tf.data-00000-of-00001``, either with TensorFlow's ``.tempstate{digits}`` while written).

A restore into parameter-server tasks writes bundle indexes, each with a symlink to the
shard file it reads as its data file, in a folder ``.restore-{8 characters}`` of the
checkpoint folder (:mod:`de_store.saver.device_restore`), and removes it when it ends. A
process killed while restoring leaves it: gc removes it, as the restore's own, when it
holds only such files (a symlink is removed, never the shard file it points to).
"""

from __future__ import annotations

import re

from de_store.backends.base import Backend
from de_store.checkpoint import _tf_bundle, names
from de_store.checkpoint.commit import (
    COMMIT_PREFIX,
    PENDING_SUFFIX,
    RANKS_DIR,
    REPLACED_INFIX,
    commit_name,
    committed_folder,
    manifest_name,
    parse_commit_record,
)
from de_store.checkpoint.manifest import Manifest, manifest_from_json
from de_store.errors import CheckpointError
from de_store.formats import FORMATS, format_class

_TEMP = r"(\.[0-9a-f]{12}\.tmp)?"
_META = r"LOCK|ABORT|COMMIT-\d+|manifest-\d+\.json"


def _shard_file_ends() -> str:
    """What any registered format's files add to a shard's path, and what the files of a
    shard written on its device add until they are renamed (one alternative each)."""
    ends = {format_class(name).file_name_ends() for name in FORMATS}
    return "|".join(sorted(ends | {names.device_shard_file_name_ends()}))


_SHARD = rf"(removed-)?r\d{{5}}-s\d{{5}}-[0-9a-f]{{8}}({_shard_file_ends()})"
_OWN = re.compile(rf"\.?({_META}){_TEMP}|(_ranks|_barrier)/.+|[^/]+/\.?{_SHARD}{_TEMP}")
_SHARD_FILE = re.compile(rf"[^/]+/\.?{_SHARD}{_TEMP}")
_CHECKPOINT_FILE = re.compile(r"COMMIT-\d+|manifest-\d+\.json")
#: The folder a restore into parameter-server tasks writes its bundle indexes in, inside
#: the checkpoint folder (``tempfile.mkdtemp`` adds 8 characters).
RESTORE_SCRATCH_PREFIX = ".restore-"
_RESTORE_SCRATCH = re.compile(rf"{re.escape(RESTORE_SCRATCH_PREFIX)}[a-z0-9_]{{8}}")
_RESTORE_FILE = re.compile(rf"\d{{6}}-\d+({_tf_bundle.file_name_ends()})")
_TOKEN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a commit record or a manifest (what makes a folder a checkpoint)."""
    return _CHECKPOINT_FILE.fullmatch(name) is not None


def is_own(path: str) -> bool:
    """Whether ``path`` (relative to a checkpoint folder) has a name a save writes."""
    return _OWN.fullmatch(path) is not None


def _is_own_staging(path: str) -> bool:
    """Like :func:`is_own`, also inside a job token's folder of ``NAME.pending``."""
    token, _, rest = path.partition("/")
    return is_own(path) or (_TOKEN.fullmatch(token) is not None and is_own(rest))


def _has_commit(files: list[str]) -> bool:
    return any("/" not in f and f.startswith(COMMIT_PREFIX) for f in files)


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
        if _RESTORE_SCRATCH.fullmatch(folder) and name:
            own = _RESTORE_FILE.fullmatch(name) is not None
            folders[folder] = folders.get(folder, True) and own
        else:
            rest.append(path)
    return (sorted(folders) if all(folders.values()) else None), rest


def _abandoned_saves(
    backend: Backend, top: str, files: list[str], rename: bool
) -> list[tuple[str, str, str]]:
    """:func:`abandoned_in` for the files saves write."""
    if top.endswith(PENDING_SUFFIX):
        if all(map(_is_own_staging, files)):
            return [(top, "staging folder of a save that never committed", "staging")]
        return []
    if not all(map(is_own, files)):
        return []  # a file de_store does not write: not ours to judge
    if REPLACED_INFIX in top:
        base = top.split(REPLACED_INFIX, 1)[0]
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
        if _SHARD_FILE.fullmatch(path) and path not in referenced:
            reason = "shard file of a save that never committed"
            found.append((f"{top}/{path}", reason, "shard"))
    return found


def _committed_generations(
    backend: Backend, top: str, files: list[str]
) -> tuple[set[str] | None, set[str]] | None:
    """The save ids of ``top``'s commit records (None if one predates save ids) and every
    file their manifests reference; None when one cannot be read."""
    generations = [int(f[len(COMMIT_PREFIX) :]) for f in files if is_checkpoint_file(f)
                   and f.startswith(COMMIT_PREFIX)]  # fmt: skip
    save_ids: set[str] | None = set()
    referenced: set[str] = set()
    for generation in generations:
        try:
            record = parse_commit_record(backend.read_bytes(f"{top}/{commit_name(generation)}"))
            data = backend.read_bytes(f"{top}/{manifest_name(generation)}")
            manifest = manifest_from_json(data, f"{backend.url.rstrip('/')}/{top}")
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
        if parts[0] == RANKS_DIR and len(parts) > 2:
            inside.setdefault(parts[1], []).append(parts[2:])
    found = []
    for name, paths in sorted(inside.items()):
        ids = {p[1] for p in paths if p[0] == RANKS_DIR and len(p) > 2}
        if any(len(p) == 1 and p[0].startswith("rank-") for p in paths):
            ids.add(name)  # rank manifests right in it: the folder of a save id
        if not ids & committed:
            found.append(f"{RANKS_DIR}/{name}")
    return found


def newest_modification(backend: Backend, path: str) -> float | None:
    """The latest modification time of the files at or under ``path``; None when the
    store reports none for one of them, or there is none."""
    times = [backend.modified(p) for p in backend.list(path)]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)
