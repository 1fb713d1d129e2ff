"""Which TF checkpoint a KV checkpoint belongs to, and whether that TF checkpoint is there.

The TF hook records a :class:`~de_store.checkpoint.manifest.TFCheckpointRef` in each KV
checkpoint's manifest and saves the same random ``checkpoint_id`` in the TF checkpoint. A
restore refuses a pair whose ids differ (:func:`check_binding`): two runs that share one
``save_path`` overwrite each other's KV folders, and the TF checkpoint of the first run
must not restore the second run's values.

Cleanup (:mod:`de_store.checkpoint.gc`) asks :func:`tf_checkpoint_state` whether a KV
checkpoint's TF checkpoint still exists. The TF checkpoint's location is kept relative to
the KV checkpoint folder, so a run folder that moved as a whole resolves to its new place,
whatever the working directory; an absolute location (the TF checkpoint on another
filesystem) is only compared, never trusted on its own.
"""

from __future__ import annotations

import os
import posixpath

import fsspec
from fsspec.spec import AbstractFileSystem

from de_store.backends.base import Backend
from de_store.backends.fsspec_generic import FsspecBackend
from de_store.checkpoint._tf_bundle import INDEX_SUFFIX  # every TF checkpoint's PREFIX.index
from de_store.checkpoint.manifest import Manifest, TFCheckpointRef
from de_store.errors import CheckpointMismatchError

_LOCAL = (None, "file", "local")


def reference(backend: Backend, folder: str, tf_prefix: str, checkpoint_id: str) -> TFCheckpointRef:
    """The record of the TF checkpoint ``tf_prefix`` for the KV checkpoint ``folder``.

    Relative to the KV checkpoint folder when both are on one filesystem (resolved with
    the working directory of this process, the one TF saves in); else the absolute URL.
    """
    kv_path = _fs_path(backend, folder)
    tf_path = _same_fs_path(backend, tf_prefix)
    if kv_path is not None and tf_path is not None:
        return TFCheckpointRef(posixpath.relpath(tf_path, kv_path), True, checkpoint_id)
    protocol, path = fsspec.core.split_protocol(tf_prefix)
    absolute = os.path.abspath(path) if protocol in _LOCAL else tf_prefix
    return TFCheckpointRef(absolute, False, checkpoint_id)


def resolve(
    backend: Backend, folder: str, ref: TFCheckpointRef
) -> tuple[AbstractFileSystem, str] | None:
    """The filesystem and path of the TF checkpoint prefix ``ref`` names, seen from the KV
    checkpoint ``folder`` where it is now; None when it cannot be told."""
    if ref.relative:
        kv_path = _fs_path(backend, folder)
        if kv_path is None or not isinstance(backend, FsspecBackend):
            return None
        return backend.fs, posixpath.normpath(posixpath.join(kv_path, ref.path))
    tf_path = _same_fs_path(backend, ref.path)
    if tf_path is not None and isinstance(backend, FsspecBackend):
        return backend.fs, tf_path
    try:
        fs, path = fsspec.core.url_to_fs(ref.path)
    except Exception:  # an unknown protocol or missing credentials: cannot tell
        return None
    return fs, str(path)


def tf_checkpoint_state(fs: AbstractFileSystem, prefix: str) -> bool | None:
    """Whether the TF checkpoint ``prefix`` exists (its ``.index`` file); None: unknown."""
    try:
        fs.invalidate_cache(prefix + INDEX_SUFFIX)
        return bool(fs.exists(prefix + INDEX_SUFFIX))
    except Exception:
        return None


def check_binding(manifest: Manifest, where: str, tf_prefix: str, checkpoint_id: str) -> None:
    """Refuse a KV checkpoint that was not saved with the TF checkpoint restoring it.

    Raises
    ------
    CheckpointMismatchError
        ``manifest`` (of the KV checkpoint ``where``) records another checkpoint id than
        ``checkpoint_id``, the id saved in the TF checkpoint ``tf_prefix``, or none.
    """
    found = manifest.tf_checkpoint.checkpoint_id if manifest.tf_checkpoint else None
    if found == checkpoint_id:
        return
    holds = (
        f"the KV data of TF checkpoint id {found}"
        if found
        else "KV data not saved through a TF checkpoint"
    )
    raise CheckpointMismatchError(
        f"TF checkpoint {tf_prefix} (checkpoint id {checkpoint_id}) does not match its KV "
        f"checkpoint {where}, which holds {holds}: another save wrote that folder since "
        "(two runs sharing one save_path?); give each run its own save_path"
    )


def _fs_path(backend: Backend, folder: str) -> str | None:
    if not isinstance(backend, FsspecBackend):
        return None
    return posixpath.join(backend.root, folder) if backend.root else folder


def _same_fs_path(backend: Backend, url: str) -> str | None:
    """``url`` as a path in the backend's filesystem, or None when it is on another one."""
    if not isinstance(backend, FsspecBackend):
        return None
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in _LOCAL and backend.protocol in _LOCAL:
        return os.path.abspath(path)
    if protocol is not None and protocol == backend.protocol:
        return str(backend.fs._strip_protocol(url))
    return None
