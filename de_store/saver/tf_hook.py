"""The bridge to TensorFlow's checkpointing: a registered checkpoint saver.

``tf.train.Checkpoint``, ``CheckpointManager`` and ``tf.saved_model`` call :func:`_save_fn`
for every Variable that has a ``FileSystemSaver``; it writes the tables as a KV checkpoint
(:mod:`de_store.saver.core`) and puts only the KV checkpoint's URL into TF's bundle, where
:func:`_restore_fn` finds it again.

Async checkpoints (``CheckpointOptions(enable_async=True)``): TF first calls each object's
``_copy_trackable_to_cpu`` in the main thread (traced once into a ``tf.function``), then
saves the copies in a background thread. The copy is a :class:`VariableSnapshot`; its
capture runs in a ``tf.py_function``, so every save replays it and reads the tables as they
are at ``save()`` time, while training goes on. With an incremental saver the capture takes
the snapshot mark and reads only the delta (TF waits for the previous save to finish before
capturing, so the base is that save once committed). The target folder is not known at
capture: a delta is taken only when the last two async saves went to two folders of one
location (numbered prefixes, as ``Checkpoint.save`` and ``CheckpointManager`` make).
"""

from __future__ import annotations

import abc
import functools
import posixpath
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import io_ops
from tensorflow.python.saved_model import registration
from tensorflow.python.trackable import base as trackable_base

from de_store.backends import Location, open_location
from de_store.checkpoint import binding, commit, gc
from de_store.checkpoint.request import check_save_request
from de_store.saver import at_exit, core, incremental, tf_compat
from de_store.saver.filesystem_saver import FileSystemSaver
from de_store.saver.restore_flow import restore_checkpoint
from de_store.saver.rows import VariableRows, io_device_scope

PACKAGE, NAME = "de_store", "DynamicEmbedding"
_SUFFIX = f"-{PACKAGE}.{NAME}"
_URL_TENSOR = "de_store_kv_url"
#: The id of the TF save, also in the KV checkpoint's manifest (``tf_checkpoint``).
_ID_TENSOR = "de_store_checkpoint_id"
_RELATIVE = "relative:"


class CheckpointedVariable(abc.ABC):
    """What this saver handles: ``de_store.variable`` registers its ``Variable`` here
    (``CheckpointedVariable.register``), so that this lower module never imports it."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The variable's name in its KV checkpoint."""

    @property
    @abc.abstractmethod
    def saver(self) -> FileSystemSaver | None:
        """The saver of its tables; None: TF's own bundle holds them."""


class VariableSnapshot(trackable_base.Trackable):
    """A variable's rows as of the last ``capture()`` (the async checkpoint's copy)."""

    def __init__(self, variable: Any) -> None:
        self.variable = variable
        self.rows: VariableRows | None = None
        self.io_device: str | None = None
        #: The KV checkpoint URLs of the last two saves of this snapshot.
        self.targets: list[str] = []

    def note_target(self, url: str) -> None:
        self.targets = [*self.targets, url][-2:]

    def next_location(self) -> str | None:
        """Where the next save is expected: the location of the last two when they were
        two folders of one location; None (unknown: the next save is full) otherwise."""
        if len(self.targets) < 2 or self.targets[0] == self.targets[1]:
            return None
        locations = {incremental.location_of(url) for url in self.targets}
        return locations.pop() if len(locations) == 1 else None

    @tf.autograph.experimental.do_not_convert
    def capture(self) -> None:
        """Read the tables now; inside a ``tf.function`` this runs at every call."""
        self.io_device = tf_compat.io_device()  # known while TF traces the copy
        if tf.executing_eagerly():
            self._capture_eagerly()
            return
        tf.py_function(self._capture_eagerly, [], Tout=[])

    def _capture_eagerly(self) -> list[Any]:
        # the target folder is not known yet: the write checks the delta may go there
        policy = saver_of(self.variable).incremental
        with io_device_scope(self.io_device):
            self.rows = incremental.snapshot(self.variable, policy, None, self.next_location())
        return []


@tf.autograph.experimental.do_not_convert
def saver_of(obj: Any) -> Any:
    """The FileSystemSaver of a Variable (or of a snapshot's Variable), or None."""
    variable = obj.variable if isinstance(obj, VariableSnapshot) else obj
    creator = getattr(variable, "kv_creator", None)
    return getattr(creator, "saver", None)


@tf.autograph.experimental.do_not_convert
def copy_to_cpu(variable: Any, object_map: Any) -> None:
    """``Variable._copy_trackable_to_cpu``: snapshot the tables for an async save."""
    if saver_of(variable) is None:
        return
    if variable not in object_map:
        object_map[variable] = VariableSnapshot(variable)
    object_map[variable].capture()


def _is_ours(obj: Any) -> bool:
    """Every Variable goes through the hook; those without a saver are skipped in it (their
    tables are TF-bundle children). Objects revived from a SavedModel fail this predicate and
    are skipped on restore: their tables come back from the SavedModel's own variables."""
    return isinstance(obj, (CheckpointedVariable, VariableSnapshot))


# --- save -------------------------------------------------------------------------------
def _save_fn(trackables: Mapping[str, Any], file_prefix: tf.Tensor) -> Any:
    names = sorted(n for n, obj in trackables.items() if saver_of(obj) is not None)
    if not names:
        return []

    io_device = tf_compat.io_device()  # TF passes registered savers no options

    def save(prefix: tf.Tensor) -> tf.Tensor:
        checkpoint_id = uuid.uuid4().hex  # drawn at every save, traced or not
        with io_device_scope(io_device):
            urls = _save_eagerly(trackables, names, _tf_prefix(prefix), checkpoint_id)
        return tf.constant([*urls, checkpoint_id])

    saved = (
        save(file_prefix)
        if tf.executing_eagerly()
        else tf.py_function(save, [file_prefix], Tout=tf.string)
    )
    count = len(names)
    tensor_names = [f"{name}/{_URL_TENSOR}" for name in names]
    tensor_names += [f"{name}/{_ID_TENSOR}" for name in names]
    tensors = [saved[i] for i in range(count)] + [saved[count]] * count
    with tf.device("CPU:0"):
        written = io_ops.save_v2(file_prefix, tensor_names, [""] * len(tensor_names), tensors)
    if tf.executing_eagerly():
        return file_prefix
    # in a graph (TF saves through a tf.function when the variables span devices, as under
    # ParameterServerStrategy), MergeV2Checkpoints must wait for this bundle
    with tf.control_dependencies([written]):
        return tf.identity(file_prefix)


def _tf_prefix(file_prefix: tf.Tensor) -> str:
    prefix = file_prefix.numpy().decode()
    return prefix[: -len(_SUFFIX)] if prefix.endswith(_SUFFIX) else prefix


def _save_eagerly(
    trackables: Mapping[str, Any], names: list[str], prefix: str, checkpoint_id: str
) -> list[str]:
    """Save every variable into its saver's KV checkpoint, each bound to the TF checkpoint
    ``prefix`` by ``checkpoint_id``; return the URL stored per name."""
    groups: dict[str, list[Any]] = {}
    paths: dict[str, list[str]] = {}
    for name in names:
        obj = trackables[name]
        groups.setdefault(saver_of(obj).kv_url(prefix), []).append(obj)
        paths.setdefault(saver_of(obj).kv_url(prefix), []).append(name)
    wheres = {
        url: Location(*open_location(url, saver_of(objs[0]).storage_options))
        for url, objs in groups.items()
    }
    for url, objs in groups.items():  # a request that cannot be saved: refuse before any write
        check_save_request(wheres[url], [_variable_of(o).name for o in objs], paths[url])
    for url, objs in groups.items():
        saver, where = saver_of(objs[0]), wheres[url]
        variables = [_variable_of(obj) for obj in objs]
        rows = _rows_of(objs, saver, where.url)
        ref = binding.reference(where.backend, where.path, prefix, checkpoint_id)
        committed = core.save_variables(
            variables, rows, where.backend, where.path, saver, tf_checkpoint=ref
        )
        if saver.topology.is_chief:
            gc.remove_orphans(where.backend, keep=where.path, kept=committed)
    head = posixpath.dirname(prefix)
    return [_stored_url(saver_of(trackables[n]).kv_url(prefix), head) for n in names]


def _variable_of(obj: Any) -> Any:
    return obj.variable if isinstance(obj, VariableSnapshot) else obj


def _rows_of(objs: list[Any], saver: FileSystemSaver, target: str) -> list[VariableRows]:
    """The rows to save: the async snapshots taken at ``save()``, else read now."""
    if not any(isinstance(obj, VariableSnapshot) for obj in objs):
        return incremental.snapshots(objs, saver.incremental, target)
    out = []
    for obj in objs:
        if not isinstance(obj, VariableSnapshot):
            out.append(incremental.snapshot(obj, saver.incremental, target))
        elif obj.rows is None:
            raise RuntimeError(f"variable {obj.variable.name!r}: async snapshot was not taken")
        else:
            obj.note_target(target)
            out.append(obj.rows)
            obj.rows = None  # the save owns the copy now: freed once it is written
    return out


def _stored_url(url: str, head: str) -> str:
    """KV URLs beside the TF checkpoint are stored relative, so the folder can move."""
    if head and url.startswith(head + "/"):
        return _RELATIVE + url[len(head) + 1 :]
    return url


# --- restore ----------------------------------------------------------------------------
def _restore_fn(trackables: Mapping[str, Any], merged_prefix: tf.Tensor) -> None:
    io_device = tf_compat.io_device()

    def restore(prefix: tf.Tensor) -> list[Any]:
        with io_device_scope(io_device):
            _restore_eagerly(trackables, prefix.numpy().decode())
        return []

    if tf.executing_eagerly():
        restore(merged_prefix)
    else:
        tf.py_function(restore, [merged_prefix], Tout=[])


def _restore_eagerly(trackables: Mapping[str, Any], prefix: str) -> None:
    reader = tf.train.load_checkpoint(prefix)
    head = posixpath.dirname(prefix)
    groups: dict[str, list[Any]] = {}
    ids: dict[str, str | None] = {}
    for name, variable in sorted(trackables.items()):
        if not reader.has_tensor(f"{name}/{_URL_TENSOR}"):
            continue  # saved without a saver: TF's bundle restored its tables
        stored = reader.get_tensor(f"{name}/{_URL_TENSOR}").decode()
        url = (
            posixpath.join(head, stored[len(_RELATIVE) :])
            if stored.startswith(_RELATIVE)
            else stored
        )
        groups.setdefault(url, []).append(variable)
        ids[url] = _checkpoint_id(reader, name)
    for url, variables in groups.items():
        saver = saver_of(variables[0]) or FileSystemSaver()
        backend, folder = open_location(url, saver.storage_options)
        checkpoint_id = ids[url]
        check = (  # TF checkpoints saved before ids were written have none
            None
            if checkpoint_id is None
            else functools.partial(binding.check_binding, where=url, tf_prefix=prefix,
                                   checkpoint_id=checkpoint_id)
        )  # fmt: skip
        with commit.removed_while_read(backend, folder, gone=_gone(prefix), hint=_REMOVED_HINT):
            restore_checkpoint(
                variables, backend, folder, saver.topology, saver.options, check_manifest=check
            )


#: How a reader beside a writer goes on after a removed checkpoint (docs/checkpoints.md).
_REMOVED_HINT = (
    "; CheckpointManager(max_to_keep=...) deletes old TF checkpoints and the next save "
    "their KV data: restore a newer one (tf.train.latest_checkpoint again)"
)


def _gone(prefix: str) -> Callable[[], bool]:
    """Whether the TF checkpoint ``prefix`` is gone (its index file): its KV data goes next."""
    return lambda: not tf.io.gfile.exists(prefix + binding.INDEX_SUFFIX)


def _checkpoint_id(reader: Any, name: str) -> str | None:
    tensor = f"{name}/{_ID_TENSOR}"
    return reader.get_tensor(tensor).decode() if reader.has_tensor(tensor) else None


registration.register_checkpoint_saver(
    package=PACKAGE,
    name=NAME,
    predicate=_is_ours,
    save_fn=_save_fn,
    restore_fn=_restore_fn,
    strict_predicate_restore=False,
)
# TF's Checkpoint.sync() only waits; make it raise a failed background save's error.
tf_compat.raise_async_errors_on_sync()
tf_compat.trace_async_copies_without_autograph()
# TF joins its async save thread too late at exit for our writers: join it earlier.
at_exit.track_async_checkpoints()
