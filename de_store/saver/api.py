"""Saving and restoring variables without ``tf.train.Checkpoint``.

>>> handle = de_store.save([user_emb, item_emb], "s3://bucket/run1/step-100")
>>> ...                     # training goes on while the shards are written
>>> handle.result()         # the committed URL, or the save's error
>>> de_store.restore([user_emb, item_emb], "s3://bucket/run1/step-100")
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from de_store.backends import Location, open_location
from de_store.checkpoint import commit
from de_store.checkpoint.manifest import Manifest
from de_store.checkpoint.request import check_save_request
from de_store.saver import at_exit, core, incremental
from de_store.saver.filesystem_saver import FileSystemSaver
from de_store.saver.restore_flow import restore_checkpoint

logger = logging.getLogger(__name__)
_EXECUTOR_LOCK = threading.Lock()
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
#: The last save submitted: an incremental save's snapshot waits for it to finish.
_LAST: concurrent.futures.Future[str] | None = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """One background writer: saves run one after another, in the order they were made."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(1, "de_store-save")
        return _EXECUTOR


class SaveHandle:
    """A save in progress: the snapshot is taken, writing and commit go on in the background."""

    def __init__(self, url: str, future: concurrent.futures.Future[str]) -> None:
        self.url = url
        self._future = future

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait for the commit and return the URL; re-raise the save's error if it failed."""
        return self._future.result(timeout)

    def add_done_callback(self, callback: Callable[[str], Any]) -> None:
        """Call ``callback(url)`` once the checkpoint is committed (not on failure)."""

        def call(future: concurrent.futures.Future[str]) -> None:
            if future.exception() is None:
                callback(future.result())

        self._future.add_done_callback(call)


def _saver_for(saver: FileSystemSaver | None, kwargs: dict[str, Any]) -> FileSystemSaver:
    if saver is not None and kwargs:
        raise ValueError(f"give either saver= or saver options, not both: got {sorted(kwargs)}")
    return saver or FileSystemSaver(**kwargs)


def save(
    variables: Sequence[Any],
    url: str,
    *,
    saver: FileSystemSaver | None = None,
    blocking: bool = False,
    metadata: dict[str, Any] | None = None,
    **saver_options: Any,
) -> SaveHandle:
    """Save ``variables`` as the KV checkpoint ``url``.

    The tables are read before this returns (a consistent snapshot); shards are written,
    ranks meet at the barrier and rank 0 commits in a background thread.

    Parameters
    ----------
    variables:
        The ``de_store.Variable`` objects to save (with their optimizer slots and status).
    url:
        Folder of the checkpoint; any fsspec URL. Must not hold a checkpoint yet, unless
        it is to be replaced atomically.
    saver:
        A ``FileSystemSaver`` for topology and IO options, or give its keyword arguments
        (``proc_size``, ``proc_rank``, ``format``, ``compression``, ``value_precision``,
        ``buffer_size``, ``storage_options``, ``barrier``, ``barrier_timeout_s``,
        ``incremental``, ...) directly. With
        ``incremental`` a save may be a delta on the variables' last committed checkpoint
        (a sibling folder of ``url``); it first waits for the previous save to finish, so
        that every rank decides on the same committed checkpoint.
    blocking:
        Wait for the commit before returning. A ``KeyboardInterrupt`` (Ctrl-C) while it
        waits stops the save before its commit (nothing is committed, the previous
        checkpoint at ``url`` stays) and is raised once the save has stopped; a save that
        was already committing finishes, and a warning says it is committed.
    metadata:
        JSON-serialisable values stored in the manifest.

    Raises
    ------
    ValueError
        Two of ``variables`` have the same name (one's rows would replace the other's).
    DestinationError
        ``url`` cannot take a checkpoint: a file is in the way, or a local folder cannot
        be written (see :mod:`de_store.checkpoint.destination`).
    """
    global _LAST
    saver = _saver_for(saver, saver_options)
    backend, name = open_location(url, saver.storage_options)
    where = Location(backend, name)
    # before the snapshot, raised here rather than in the background save
    check_save_request(where, [variable.name for variable in variables])
    target = where.url
    if saver.incremental is not None and _LAST is not None:
        concurrent.futures.wait([_LAST])  # its commit sets the base (its error is its own)
    rows = incremental.snapshots(variables, saver.incremental, target)
    cancel = threading.Event()

    def write() -> str:
        core.save_variables(variables, rows, backend, name, saver, metadata=metadata,
                            cancel=cancel)  # fmt: skip
        return url

    future = _executor().submit(write)
    at_exit.track(future)
    _LAST = future
    handle = SaveHandle(url, future)
    if blocking:
        _wait_or_stop(future, cancel, target)
    return handle


def _wait_or_stop(
    future: concurrent.futures.Future[str], cancel: threading.Event, where: str
) -> None:
    """Wait for a blocking save; on ``KeyboardInterrupt`` stop it before its commit, wait
    until it has stopped (or committed, when it already was committing), then re-raise."""
    try:
        future.result()
    except KeyboardInterrupt:
        cancel.set()
        logger.warning("save of %s interrupted (KeyboardInterrupt): stopping it", where)
        concurrent.futures.wait([future])
        if future.exception() is None:
            logger.warning("save of %s was committing when interrupted: it is committed", where)
        raise


def restore(
    variables: Sequence[Any],
    url: str,
    *,
    saver: FileSystemSaver | None = None,
    **saver_options: Any,
) -> Manifest:
    """Restore ``variables`` from the committed KV checkpoint ``url``; return its manifest.

    Each rank gets the keys that belong to it (``default_partition_fn`` over ``proc_size``),
    whatever the number of processes and shards that saved them. Nothing changes unless
    every needed file was read and verified. A checkpoint removed while it is restored
    raises ``CheckpointNotFoundError`` saying so (``commit.removed_while_read``).
    """
    saver = _saver_for(saver, saver_options)
    backend, name = open_location(url, saver.storage_options)
    with commit.removed_while_read(backend, name):
        return restore_checkpoint(variables, backend, name, saver.topology, saver.options)
