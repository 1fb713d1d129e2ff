"""What TensorFlow's registered-saver hook does not give a saver, and how we get it.

* The ``tf.train.CheckpointOptions`` of the save or restore in progress: TF calls a
  registered saver's ``save_fn`` / ``restore_fn`` without them, so
  ``experimental_io_device`` would be lost. :func:`options_in_flight` finds them in the
  calling ``save`` / ``restore`` frame (read only; every TF path to a registered saver
  passes through one that holds ``options``).
* An async save that blocks training as little as the saver: TF's helper traces its
  copy function with autograph at the second async save of a process
  (:func:`trace_async_copies_without_autograph`).
* A background failure on ``Checkpoint.sync()``: TF's async helper keeps the error of a
  failed background save and raises it at the next ``save`` only; its ``sync`` just waits.
  :func:`raise_async_errors_on_sync` makes ``sync`` raise it too, with its original cause
  (TF's own ``_check_async_thread_error``, called after the wait).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import tensorflow as tf

_FRAME_NAMES = frozenset({"save", "restore", "_write", "write", "read", "_copy_to_cpu"})
_MAX_DEPTH = 64


def options_in_flight() -> tf.train.CheckpointOptions | None:
    """The ``CheckpointOptions`` of the TF save/restore that called us, if any."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name in _FRAME_NAMES:
            options = frame.f_locals.get("options")
            if isinstance(options, tf.train.CheckpointOptions):
                return options
        frame = frame.f_back
    return None


def io_device() -> str | None:
    """``experimental_io_device`` of the save/restore in progress (None: not given)."""
    options = options_in_flight()
    return getattr(options, "experimental_io_device", None) or None


def raise_async_errors_on_sync() -> None:
    """Make ``AsyncCheckpointHelper.sync`` raise a failed background save's error (once)."""

    def around(original: Callable[..., None]) -> Callable[..., None]:
        def sync(self: Any) -> None:
            original(self)
            self._check_async_thread_error()

        return sync

    _wrap_once(_async_helper_class(), "sync", around)


def trace_async_copies_without_autograph() -> None:
    """Have ``AsyncCheckpointHelper._copy_to_cpu`` traced without autograph.

    TF's async helper traces that ``tf.function`` at the second async save of a process,
    in the training thread, and autograph converts its source first, most of that block
    (docs/benchmarks.md, Costs behind the code). Its body loops over Python lists only,
    which trace the same without autograph.
    """
    cls = _async_helper_class()
    original = cls.__dict__["_copy_to_cpu"]
    if getattr(original, "_de_store_wrapped", False):
        return
    python_function = getattr(original, "python_function", None)
    if python_function is None:  # not a tf.function in this TensorFlow: leave it
        return
    traced: Any = tf.function(python_function, autograph=False)
    traced._de_store_wrapped = True
    cls._copy_to_cpu = traced


def on_async_helper_created(callback: Callable[[Any], None]) -> None:
    """Call ``callback(helper)`` for every ``AsyncCheckpointHelper`` created from now on."""

    def around(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            callback(self)

        return __init__

    _wrap_once(_async_helper_class(), "__init__", around)


def _async_helper_class() -> Any:
    from tensorflow.python.checkpoint import async_checkpoint_helper as helper

    return helper.AsyncCheckpointHelper


def _wrap_once(
    cls: Any, name: str, around: Callable[[Callable[..., None]], Callable[..., None]]
) -> None:
    """Replace method ``name`` of ``cls`` by ``around(original)``, unless already done.

    The original stays reachable as the replacement's ``__wrapped__``.
    """
    original = getattr(cls, name)
    if getattr(original, "_de_store_wrapped", False):
        return
    wrapped: Any = functools.wraps(original)(around(original))
    wrapped._de_store_wrapped = True
    setattr(cls, name, wrapped)
