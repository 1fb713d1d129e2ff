"""Where a checkpoint's files go and how it becomes visible (committed).

The strategy follows from the backend's declared capabilities:

- :class:`RenameCommit` (``supports_atomic_rename``, POSIX disks): ranks write into
  ``NAME.pending/<job token>/``, where rank 0 took a write-once ``LOCK``; rank 0 adds the
  merged manifest and the commit record there and renames the folder to ``NAME`` in one
  atomic step, unless another save committed ``NAME`` after this one began.
- :class:`MarkerCommit` (object stores): ranks write under the final ``NAME/`` folder;
  rank 0 claims the next generation by creating ``manifest-<generation>.json`` write-once,
  then creates ``NAME/COMMIT-<generation>`` write-once.

Either way a checkpoint is committed if and only if a ``COMMIT-<generation>`` record exists
in its folder, and readers never look at anything else first. The record holds the size and
crc32c of ``manifest-<generation>.json`` and a crc32c of its own fields. See the commit
protocol in docs/format.md.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.manifest import Manifest, manifest_from_json, to_json
from de_store.checkpoint.retry import NO_RETRY, RetryPolicy, write_once_checked
from de_store.errors import AlreadyExistsError, CheckpointError, CheckpointNotFoundError
from de_store.formats._crc32c import crc32c

T = TypeVar("T")


class CommitStrategy(abc.ABC):
    """Names the folders a save writes into and publishes the checkpoint once complete.

    Parameters
    ----------
    backend, name:
        Where the checkpoint ``name`` goes.
    token:
        The save's job token: every rank of one save gets the same one, two different
        saves (jobs) different ones; "" for a job without one (the shared legacy folders).
    retry:
        How storage steps of the commit are retried.
    save_id:
        The identity of this save attempt (random when not given): the content of the lock
        it takes, of its ``ABORT`` record and the ``save_id`` of its commit record.
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        token: str = "",
        retry: RetryPolicy = NO_RETRY,
        save_id: str | None = None,
    ) -> None:
        self.backend = backend
        self.name = name.strip("/")
        self.token = token
        self.retry = retry
        #: This save attempt's identity: every rank of one attempt holds the same one.
        self.save_id = save_id or uuid.uuid4().hex

    @property
    @abc.abstractmethod
    def staging(self) -> str:
        """Folder (relative to the backend root) that ranks write their shards into."""

    @property
    @abc.abstractmethod
    def work(self) -> str:
        """Folder of this save's own coordination files: rank manifests, barrier, ABORT."""

    @abc.abstractmethod
    def begin(self) -> None:
        """Rank 0, before anything is written: claim the save, note what is committed.

        Raises
        ------
        AlreadyExistsError
            Another save of the same checkpoint holds the staging folder.
        """

    @abc.abstractmethod
    def commit(self, manifest: Manifest) -> None:
        """Write the merged manifest and publish the checkpoint atomically (rank 0 only).

        Raises
        ------
        AlreadyExistsError
            Another save committed ``name`` after this one began; nothing was changed.
        """

    def committed_state(self) -> bytes | None:
        """The commit record of ``name`` now (None when uncommitted): changes on every commit."""
        return commit_record(self.backend, self.name)

    def abort(self, reason: str) -> None:
        """Record why this save attempt failed, so its waiting ranks stop with that reason."""
        path = self.backend.join(self.work, names.ABORT_NAME)
        data = json.dumps({"save_id": self.save_id, "reason": reason}).encode()
        self.retry.call(lambda: self.backend.write_bytes(path, data))

    def aborted(self) -> str | None:
        """Why this save attempt failed, once rank 0 recorded it; None before (an ``ABORT``
        of another attempt of the same job is not this attempt's)."""
        path = self.backend.join(self.work, names.ABORT_NAME)
        try:
            record = json.loads(self.backend.read_bytes(path))
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("save_id") != self.save_id:
            return None
        return str(record.get("reason"))

    @property
    def where(self) -> str:
        return Location(self.backend, self.name).url

    def _record(self, generation: int, data: bytes) -> bytes:
        fields = {
            "generation": generation,
            "manifest_crc32c": crc32c(data),
            "manifest_bytes": len(data),
            "committed": time.time(),
            "save_id": self.save_id,
        }
        return json.dumps({**fields, "record_crc32c": _record_crc(fields)}).encode()

    def _lost(self, detail: str) -> AlreadyExistsError:
        return AlreadyExistsError(
            f"cannot commit {self.where}: {detail}; this save changed nothing there "
            "(another save of the same checkpoint ran at the same time)"
        )


class RenameCommit(CommitStrategy):
    """Stage in ``NAME.pending/<token>/``, then one atomic directory rename to ``NAME``.

    Rank 0 takes ``LOCK`` in the staging folder first. Without a job token (the shared
    legacy folder) it is write-once, so a second save of the same name fails early. With a
    token the folder is the job's own, and a new attempt of the job (a retry after a crash)
    takes the lock over: the earlier attempt, if it still runs, can no longer commit. A
    save replaces a committed ``NAME`` only if it is
    the one committed when the save began (a rewrite); rewriting moves the old folder aside
    first, and a crash between the two renames leaves the old checkpoint under
    ``NAME.replaced-*``, which readers use.
    """

    _base: bytes | None = None
    _began = False

    @property
    def staging(self) -> str:
        return names.pending_folder(self.name, self.token)

    @property
    def work(self) -> str:
        return self.staging

    def begin(self) -> None:
        self._take_lock()
        self._base = self.retry.call(self.committed_state)
        self._began = True

    def _take_lock(self) -> None:
        lock = self.backend.join(self.staging, names.LOCK_NAME)
        if self.token:  # the job's own folder: this attempt takes it over
            self.retry.call(lambda: self.backend.write_bytes(lock, self.save_id.encode()))
            return
        try:
            write_once_checked(self.backend, lock, self.save_id.encode(), self.retry)
        except AlreadyExistsError as err:
            raise AlreadyExistsError(
                f"cannot save {self.where}: {Location(self.backend, lock).url} exists, "
                "another save in progress (or an interrupted one: `de-store gc` removes it)"
            ) from err

    def commit(self, manifest: Manifest) -> None:
        if not self._began:  # a caller that stages on its own (conversion): no lock taken
            self._base = self.retry.call(self.committed_state)
        data = to_json(manifest)
        staging = self.backend.sub(self.staging)
        self.retry.call(lambda: staging.write_bytes(names.manifest_name(1), data))
        record = self._record(1, data)
        self.retry.call(lambda: staging.write_bytes(names.commit_name(1), record))
        self._check_lock()
        aside = self._move_aside()
        try:
            self.retry.call(lambda: self._publish(record))
        except Exception:
            if aside is not None:
                with contextlib.suppress(Exception):
                    self.backend.publish(aside, self.name)
            raise
        if aside is not None:
            with contextlib.suppress(Exception):
                self.retry.call(lambda: self.backend.delete(aside, recursive=True))
        self._remove_empty_pending()

    def _check_lock(self) -> None:
        if not self._began:
            return
        lock = self.backend.join(self.staging, names.LOCK_NAME)
        if self.retry.call(lambda: self.backend.read_bytes(lock)) != self.save_id.encode():
            raise self._lost(f"{lock} was taken over by another save")

    def _move_aside(self) -> str | None:
        """Move the committed ``NAME`` aside if it is the one this save began with."""
        if self.retry.call(self.committed_state) != self._base:
            raise self._lost("another save committed it after this one began")
        if self._base is None:
            return None
        aside = names.replaced_name(self.name)
        self.retry.call(lambda: self.backend.publish(self.name, aside))
        if commit_record(self.backend, aside) != self._base:  # replaced in between
            with contextlib.suppress(Exception):
                self.backend.publish(aside, self.name)
            raise self._lost("another save committed it after this one began")
        return aside

    def _publish(self, record: bytes) -> None:
        if not self.backend.exists(self.staging) and self.committed_state() == record:
            return  # an earlier attempt renamed it; its reply was lost
        try:
            self.backend.publish(self.staging, self.name)
        except Exception as err:
            if commit_record(self.backend, self.name) not in (None, record):
                raise self._lost("another save committed it first") from err
            raise

    def _remove_empty_pending(self) -> None:
        """Drop the emptied ``NAME.pending`` parent; rmdir keeps other saves' folders."""
        if not self.token:
            return
        path = self.backend.local_path(names.pending_folder(self.name))
        if path is not None:
            with contextlib.suppress(OSError):
                os.rmdir(path)


class MarkerCommit(CommitStrategy):
    """Write under ``NAME/`` and create ``NAME/COMMIT-<generation>`` write-once.

    Data files carry a per-save unique suffix, so a rewrite never touches the files of the
    committed generation; the highest committed generation is the checkpoint. Rank 0 claims
    generation ``g + 1`` (``g``: the highest generation present when the save began) by
    creating ``manifest-<g + 1>.json`` write-once: of two concurrent saves only one can,
    and a save never commits over a generation committed after it began.
    """

    _generation = 0
    _began = False

    @property
    def staging(self) -> str:
        return self.name

    @property
    def work(self) -> str:
        return names.job_folder(self.name, self.token)

    def begin(self) -> None:
        self._generation = self.retry.call(lambda: claimed_generation(self.backend, self.name))
        self._began = True

    def commit(self, manifest: Manifest) -> None:
        if not self._began:  # a caller that stages on its own (conversion)
            self.begin()
        generation = self._generation + 1
        data = to_json(manifest)
        path = self.backend.join(self.name, names.manifest_name(generation))
        try:
            write_once_checked(self.backend, path, data, self.retry)
        except AlreadyExistsError as err:
            raise self._lost(f"another save claimed generation {generation} first") from err
        record = self._record(generation, data)
        marker = self.backend.join(self.name, names.commit_name(generation))
        write_once_checked(self.backend, marker, record, self.retry)


def commit_strategy(
    backend: Backend,
    name: str,
    token: str = "",
    retry: RetryPolicy = NO_RETRY,
    save_id: str | None = None,
) -> CommitStrategy:
    """The commit strategy the backend's capabilities call for."""
    if backend.capabilities.supports_atomic_rename:
        return RenameCommit(backend, name, token, retry, save_id)
    return MarkerCommit(backend, name, token, retry, save_id)


# --- reading committed checkpoints ------------------------------------------------------
#: The fields of a commit record written before records carried their own checksum.
_LEGACY_RECORD_FIELDS = {"generation", "manifest_crc32c", "manifest_bytes", "committed"}


def _record_crc(fields: dict[str, object]) -> int:
    return crc32c(json.dumps(fields, sort_keys=True).encode())


def parse_commit_record(data: bytes) -> dict[str, object]:
    """A commit record's fields, checked against its own ``record_crc32c``.

    Raises ``ValueError`` when it is not valid JSON or was altered since written.
    """
    record = json.loads(data)
    if set(record) == _LEGACY_RECORD_FIELDS:
        return dict(record)
    fields = {k: v for k, v in record.items() if k != "record_crc32c"}
    if record.get("record_crc32c") != _record_crc(fields):
        raise ValueError("record_crc32c does not match the record's content")
    return fields


def record_save_id(record: bytes | None) -> str | None:
    """The ``save_id`` of the save that wrote a commit record (None: no record, a record
    without one, or a damaged one)."""
    try:
        return str(parse_commit_record(record)["save_id"]) if record else None
    except (ValueError, KeyError):
        return None


def commit_record(backend: Backend, folder: str) -> bytes | None:
    """The content of ``folder``'s latest ``COMMIT-*`` record, or None if uncommitted."""
    generation = latest_generation(backend, folder)
    if not generation:
        return None
    try:
        return backend.read_bytes(backend.join(folder, names.commit_name(generation)))
    except FileNotFoundError:
        return None


def claimed_generation(backend: Backend, folder: str) -> int:
    """The highest generation with a commit record or a manifest (claimed) in ``folder``,
    from one listing of it."""
    found = [0]
    for path in _top_files(backend, folder):
        name = path.rsplit("/", 1)[-1]
        generation = names.manifest_generation(name) or names.commit_generation(name)
        if generation is not None:
            found.append(generation)
    return max(found)


def _top_files(backend: Backend, folder: str) -> list[str]:
    """The paths of the files right in ``folder``."""
    return [p for p in backend.list(folder) if p.count("/") == folder.count("/") + 1]


def _generations(backend: Backend, folder: str) -> list[int]:
    found = []
    for path in _top_files(backend, folder):
        generation = names.commit_generation(path.rsplit("/", 1)[-1])
        if generation is not None:
            found.append(generation)
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
    found = _committed(backend, name)
    return found[0] if found else None


def _committed(backend: Backend, name: str) -> tuple[str, int] | None:
    """:func:`committed_folder` and its latest generation, each folder listed once."""
    name = name.strip("/")
    generation = latest_generation(backend, name)
    if generation:
        return name, generation
    parent, _, base = name.rpartition("/")
    for path in backend.list(parent):
        rel = path[len(parent) + 1 :] if parent else path
        first = rel.split("/", 1)[0]
        if first.startswith(base + names.REPLACED_INFIX):
            folder = backend.join(parent, first)
            generation = latest_generation(backend, folder)
            if generation:
                return folder, generation
    return None


def read_manifest(backend: Backend, name: str) -> tuple[str, Manifest]:
    """``(folder, manifest)`` of the committed checkpoint ``name``, checked against its commit.

    Raises
    ------
    CheckpointNotFoundError
        ``name`` holds no committed checkpoint.
    CheckpointError
        The manifest is missing, truncated or altered since commit.
    """
    found = _committed(backend, name)
    where = Location(backend, name).url
    if found is None:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {where}: expected a {names.COMMIT_PREFIX}* marker there"
        )
    folder, generation = found
    expected = recorded_manifest(backend, folder, generation, where)
    return folder, checked_manifest(backend, folder, generation, expected, where)


def recorded_manifest(
    backend: Backend, folder: str, generation: int, where: str | None = None
) -> tuple[int, int]:
    """``(bytes, crc32c)`` of the manifest that ``folder``'s commit record of
    ``generation`` commits (``where``: the checkpoint's URL in messages).

    Raises
    ------
    CheckpointError
        The commit record is gone or not valid.
    """
    return read_commit_record(backend, folder, generation, _manifest_fields, where)


def _manifest_fields(record: dict[str, Any]) -> tuple[int, int]:
    return int(record["manifest_bytes"]), int(record["manifest_crc32c"])


def read_commit_record(
    backend: Backend,
    folder: str,
    generation: int,
    fields: Callable[[dict[str, Any]], T],
    where: str | None = None,
) -> T:
    """``fields(record)`` of ``folder``'s commit record of ``generation``, the record
    checked against its own crc32c (``where``: the checkpoint's URL in messages).

    Raises
    ------
    CheckpointError
        The commit record is gone, not valid, or lacks what ``fields`` takes from it.
    """
    marker = backend.join(folder, names.commit_name(generation))
    try:
        return fields(parse_commit_record(backend.read_bytes(marker)))
    except FileNotFoundError as err:
        where = where or Location(backend, folder).url
        raise CheckpointError(f"{where}: commit record {marker} vanished while read") from err
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{Location(backend, marker).url}: commit record is not valid ({err})"
        ) from err


def commit_time(backend: Backend, folder: str, generation: int) -> float:
    """The commit time (seconds since the epoch, the saver's clock) that ``folder``'s
    commit record of ``generation`` records.

    Raises
    ------
    CheckpointError
        The commit record is gone or not valid.
    """
    return read_commit_record(backend, folder, generation, lambda r: float(r["committed"]))


def committed_generations_in(paths: Iterable[str]) -> dict[str, int]:
    """Each folder that holds a commit record among ``paths`` (a listing) -> its highest
    generation."""
    found: dict[str, int] = {}
    for path in paths:
        head, base = posixpath.split(path)
        generation = names.commit_generation(base)
        if generation is not None and head:
            found[head] = max(found.get(head, 0), generation)
    return found


def checked_manifest(
    backend: Backend, folder: str, generation: int, expected: tuple[int, int], where: str
) -> Manifest:
    """The manifest of ``generation`` in ``folder``, checked against ``expected``
    (:func:`recorded_manifest`).

    Raises
    ------
    CheckpointError
        The manifest is missing, or its size or crc32c is not the one recorded.
    """
    marker = backend.join(folder, names.commit_name(generation))
    path = backend.join(folder, names.manifest_name(generation))
    try:
        data = backend.read_bytes(path)
    except FileNotFoundError as err:
        raise CheckpointError(f"{where}: committed but {path} is missing") from err
    crc = crc32c(data)
    if (len(data), crc) != expected:
        raise CheckpointError(
            f"{Location(backend, path).url}: expected {expected[0]} bytes "
            f"with crc32c {expected[1]} (as recorded in {marker}), found "
            f"{len(data)} bytes with crc32c {crc}"
        )
    return manifest_from_json(data, where)


@contextlib.contextmanager
def removed_while_read(
    backend: Backend, name: str, *, gone: Callable[[], bool] | None = None, hint: str = ""
) -> Iterator[None]:
    """Report a read of the checkpoint ``name`` that failed because the checkpoint was
    removed meanwhile (by gc, or ``CheckpointManager(max_to_keep=...)`` and the next save)
    as that removal, not as the file it missed.

    A read that finds a file, the commit record or the manifest missing
    (``FileNotFoundError``, ``CheckpointError``) is a removal when ``name`` is no longer
    committed, or when ``gone()`` says so (the TF hook: the TF checkpoint restored is gone,
    and its KV data goes after it). Otherwise the error passes unchanged: a file missing
    from a checkpoint still committed is damage.

    Raises
    ------
    CheckpointNotFoundError
        The checkpoint was removed; the message names it and ends with ``hint``, the
        original error is its cause.
    """
    try:
        yield
    except (FileNotFoundError, CheckpointError) as err:
        removed = gone() if gone is not None else False
        if not removed and (
            isinstance(err, CheckpointNotFoundError)  # not there before the read began
            or committed_folder(backend, name) is not None
        ):
            raise
        where = Location(backend, name).url
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointNotFoundError(
            f"checkpoint {where} was removed while it was being restored (found: {cause}); the "
            f"de_store variables keep what they held{hint}"
        ) from err
