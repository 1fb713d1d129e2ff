"""Every file and folder name a save writes, with its parser: writers, readers, gc and
verify all ask this module, so that a new format or column cannot fall out of step with
cleanup.

A checkpoint ``NAME`` is a folder holding::

    COMMIT-{generation:06d}                 commit record: NAME is committed iff one exists
    manifest-{generation:06d}.json          the merged manifest that record names
    ABORT                                   why a save attempt failed (rank 0 writes it)
    .de_store-probe-{32 hex}                a destination check's empty object, deleted again
    _ranks/[{token}/]{save_id}/rank-{rank:05d}.json   rank manifests of a save attempt
    _barrier/{tag}/rank-{rank:05d}          barrier arrival files
    {variable}/[removed-]r{rank:05d}-s{shard:05d}-{8 hex}{format's ends}   shard files
    .restore-{8 characters}/                bundle indexes of a restore into PS tasks

and, when the backend commits by renaming, beside it ``NAME.pending/[{token}/]`` (the
staging folder, with its ``LOCK``) and ``NAME.replaced-{12 hex}`` (the committed folder a
rewrite moved aside). The local backend writes each file as ``.{name}.{12 hex}.tmp``
first.
"""

from __future__ import annotations

import re
import uuid

from de_store.checkpoint import _tf_bundle
from de_store.formats import FORMATS, format_class
from de_store.formats.binary import BinaryFormat

# --- commit records and manifests -------------------------------------------------------
#: Start of a commit record's name, ``COMMIT-{generation:06d}``.
COMMIT_PREFIX = "COMMIT-"
#: Start of a merged manifest's name, ``manifest-{generation:06d}.json``.
MANIFEST_PREFIX = "manifest-"
_COMMIT = re.compile(rf"{COMMIT_PREFIX}(\d+)")
_MANIFEST = re.compile(rf"{MANIFEST_PREFIX}(\d+)\.json")


def commit_name(generation: int) -> str:
    """The commit record of ``generation``."""
    return f"{COMMIT_PREFIX}{generation:06d}"


def commit_generation(name: str) -> int | None:
    """The generation the commit record ``name`` commits; None when ``name`` is not one."""
    match = _COMMIT.fullmatch(name)
    return int(match[1]) if match else None


def manifest_name(generation: int) -> str:
    """The merged manifest of ``generation``."""
    return f"{MANIFEST_PREFIX}{generation:06d}.json"


def manifest_generation(name: str) -> int | None:
    """The generation of the merged manifest ``name``; None when ``name`` is not one."""
    match = _MANIFEST.fullmatch(name)
    return int(match[1]) if match else None


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a commit record or a manifest (what makes a folder a checkpoint)."""
    return commit_generation(name) is not None or manifest_generation(name) is not None


# --- a save's coordination files --------------------------------------------------------
#: The lock rank 0 takes in a staging folder (rename commit).
LOCK_NAME = "LOCK"
#: Why a save attempt failed, in its work folder.
ABORT_NAME = "ABORT"
#: Folder of rank manifests (and, with a job token, of a job's work folder).
RANKS_DIR = "_ranks"
#: Folder of barrier arrival files, in a save's work folder.
BARRIER_DIR = "_barrier"
#: Start of a rank's file name in ``_ranks/`` and ``_barrier/``.
RANK_PREFIX = "rank-"
#: A job token, as a folder name (:func:`job_token_of` makes it so).
_JOB_TOKEN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def rank_manifest_path(rank: int, save_id: str | None) -> str:
    """The manifest of ``rank``: ``_ranks/{save_id}/rank-{rank:05d}.json``; right in
    ``_ranks/`` for a rewrite (``save_id`` None), which has one attempt only."""
    name = f"{RANK_PREFIX}{rank:05d}.json"
    return "/".join(p for p in (RANKS_DIR, save_id, name) if p)


def is_rank_file(name: str) -> bool:
    """Whether ``name`` is a rank's manifest or arrival file."""
    return name.startswith(RANK_PREFIX)


def job_folder(name: str, token: str) -> str:
    """The work folder of the job ``token`` in the checkpoint folder ``name`` (marker
    commit): ``NAME/_ranks/{token}``, ``NAME`` itself without a token."""
    return f"{name}/{RANKS_DIR}/{token}" if token else name


def job_token_of(job_id: str) -> str:
    """The job token (a folder name) of the job ``job_id``: its characters other than
    letters, digits, ``_``, ``.`` and ``-`` replaced by ``_``, at most 64 of them."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:64]


def is_job_token(name: str) -> bool:
    """Whether ``name`` can be a job token (a folder of ``NAME.pending`` or ``_ranks``)."""
    return _JOB_TOKEN.fullmatch(name) is not None


def barrier_file(tag: str, rank: int) -> str:
    """The file ``rank`` writes on arriving at the barrier ``tag``."""
    return f"{BARRIER_DIR}/{tag}/{RANK_PREFIX}{rank:05d}"


#: Start of the name of the empty file a destination check writes and deletes.
PROBE_PREFIX = ".de_store-probe-"


def probe_name() -> str:
    """A new name for the object a destination probe writes in the checkpoint folder."""
    return f"{PROBE_PREFIX}{uuid.uuid4().hex}"


# --- folders beside a checkpoint (rename commit) ----------------------------------------
#: What the staging folder of the checkpoint ``NAME`` adds to it: ``NAME.pending``.
PENDING_SUFFIX = ".pending"
#: What names a committed folder a rewrite moved aside: ``NAME.replaced-{12 hex}``.
REPLACED_INFIX = ".replaced-"


def pending_folder(name: str, token: str = "") -> str:
    """The staging folder of the checkpoint ``name`` for the job ``token``."""
    pending = name + PENDING_SUFFIX
    return f"{pending}/{token}" if token else pending


def is_pending(folder: str) -> bool:
    """Whether ``folder`` is a staging folder."""
    return folder.endswith(PENDING_SUFFIX)


def checkpoint_of_pending(folder: str) -> str:
    """The checkpoint a staging folder stages (``folder`` itself when it is not one)."""
    return folder.removesuffix(PENDING_SUFFIX)


def replaced_name(name: str) -> str:
    """A new name for the committed ``name`` a rewrite moves aside."""
    return f"{name}{REPLACED_INFIX}{uuid.uuid4().hex[:12]}"


def replaced_checkpoint(folder: str) -> str | None:
    """The checkpoint whose moved-aside copy ``folder`` is; None when it is not one."""
    base, infix, _ = folder.partition(REPLACED_INFIX)
    return base if infix else None


# --- shard files ------------------------------------------------------------------------
#: Start of a tombstone shard's name (the keys a delta removed).
TOMBSTONE_PREFIX = "removed-"


def variable_folder(variable: str) -> str:
    """The folder of a variable's shard files in the checkpoint folder."""
    return variable.replace("/", "__")


def shard_stem(variable: str, rank: int, shard: int, *, tombstone: bool = False) -> str:
    """A new path, without the format's ends, for a shard file of ``variable``: a per-save
    unique suffix, so that a rewrite never overwrites a committed generation's files."""
    kind = TOMBSTONE_PREFIX if tombstone else ""
    return f"{variable_folder(variable)}/{kind}r{rank:05d}-s{shard:05d}-{uuid.uuid4().hex[:8]}"


#: What a binary shard file's path gets to name the bundle its task writes it as.
BUNDLE_SUFFIX = ".tf"


def bundle_prefix(path: str) -> str:
    """The bundle a task writes as the binary shard file ``path`` (renamed to it after)."""
    return path + BUNDLE_SUFFIX


def device_shard_file_name_ends() -> str:
    """A regular expression for what the files of a shard written on its device add to
    the shard's path until the saving process renames them: a binary file's end, then its
    bundle's data file or index, complete or as TensorFlow names it while writing it."""
    binary = BinaryFormat.file_name_ends()
    return f"({binary}){re.escape(BUNDLE_SUFFIX)}{_tf_bundle.file_name_ends()}"


def shard_file_name_ends() -> str:
    """What any registered format's files add to a shard's path (from each format's
    ``file_name_ends()``), and what the files of a shard written on its device add until
    they are renamed (one alternative each)."""
    ends = {format_class(name).file_name_ends() for name in FORMATS}
    return "|".join(sorted(ends | {device_shard_file_name_ends()}))


# --- recognising a save's files ---------------------------------------------------------
#: The local backend's name of a file while it is written (``.{name}.{12 hex}.tmp``).
_TEMP = r"(\.[0-9a-f]{12}\.tmp)?"
_RECORDS = rf"{LOCK_NAME}|{ABORT_NAME}|{_COMMIT.pattern}|{_MANIFEST.pattern}"
_SHARD = rf"({TOMBSTONE_PREFIX})?r\d{{5}}-s\d{{5}}-[0-9a-f]{{8}}({shard_file_name_ends()})"
_FOLDERS = f"({RANKS_DIR}|{BARRIER_DIR})/.+"
_OWN = re.compile(rf"\.?({_RECORDS}){_TEMP}|{_FOLDERS}|[^/]+/\.?{_SHARD}{_TEMP}")
_SHARD_FILE = re.compile(rf"[^/]+/\.?{_SHARD}{_TEMP}")


def is_own(path: str) -> bool:
    """Whether ``path`` (relative to a checkpoint folder) has a name a save writes."""
    return _OWN.fullmatch(path) is not None


def is_shard_file(path: str) -> bool:
    """Whether ``path`` (relative to a checkpoint folder) is a shard file's name."""
    return _SHARD_FILE.fullmatch(path) is not None


# --- a restore's scratch ----------------------------------------------------------------
#: The folder a restore into parameter-server tasks writes its bundle indexes in, inside
#: the checkpoint folder (``tempfile.mkdtemp`` adds 8 characters).
RESTORE_SCRATCH_PREFIX = ".restore-"
_RESTORE_SCRATCH = re.compile(rf"{re.escape(RESTORE_SCRATCH_PREFIX)}[a-z0-9_]{{8}}")
_RESTORE_FILE = re.compile(rf"\d{{6}}-\d+({_tf_bundle.file_name_ends()})")


def restore_bundle_name(shard: int, column: int) -> str:
    """The bundle, in a restore's scratch folder, of file ``column`` of the shard record
    ``shard`` (its index, and a symlink to that file as its data file)."""
    return f"{shard:06d}-{column}"


def is_restore_scratch(folder: str) -> bool:
    """Whether ``folder`` (a name in the checkpoint folder) is a restore's scratch."""
    return _RESTORE_SCRATCH.fullmatch(folder) is not None


def is_restore_file(name: str) -> bool:
    """Whether ``name`` (in a restore's scratch folder) is one a restore writes."""
    return _RESTORE_FILE.fullmatch(name) is not None
