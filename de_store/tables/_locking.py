"""One mutex per table, taken by every operation on it, eagerly and inside graphs.

A table's operations read and write several variables (or a ``MutableHashTable`` and its
logs): run at the same time, two of them interleave. Two inserts then both see room for
their keys and overfill the index, whose probe loops never end; a clear that shrinks the
index under a running compiled probe hands XLA a smaller buffer than it was compiled for,
and XLA aborts the process. So every operation holds the table's mutex while it runs.

The mutex is a TensorFlow ``MutexV2`` resource (the op ``tf.CriticalSection`` is built
on), because a Python lock only covers Python: two ``tf.function`` s running on two
threads execute their graphs without it. ``MutexV2``, ``MutexLock`` and
``ConsumeMutexLock`` have ``DEFAULT`` kernels (the mutex and the lock in host memory), so
a table on a GPU keeps every op on the GPU. Waiting for the lock takes no thread: the lock
op is asynchronous.

Deadlock freedom: an operation takes one table's mutex, and only after every input of the
operation is computed (:func:`critical_section`), so it never holds the mutex while
waiting for anything but its own ops. Inside a caller's graph an operation is a function
call (a ``StatefulPartitionedCall`` whose inputs include the mutex): TensorFlow's
automatic control dependencies order it after earlier uses of the same table only. Had
its ops been inlined instead, the release (``ConsumeMutexLock``, stateful and without a
resource input) would be chained after every earlier such op of the graph, the releases
of other tables among them: one graph would release ``A`` only after ``B``, another ``B``
only after ``A``, and the two could deadlock.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import tensorflow as tf
from tensorflow.python.eager import context

T = TypeVar("T")

#: Held while de_store runs eager ops on a table's device outside a traced kernel whose
#: inputs may include a shape or bounds (``Fill``, ``Empty``, strided slices): an op-by-op
#: call, from its first op to its last; off the host's first CPU (:func:`eager_on_device`),
#: the stand-in of a background XLA compile and a save's reads of a snapshot.
#: TensorFlow 2.21 gives such an op, run eagerly on a device other than the host's first
#: CPU by two threads at once, the other thread's inputs at times (a ``tf.zeros([0])`` came
#: out with the 32,768 rows another thread asked for; a strided slice, its bounds), and
#: the tables of a variable sharded over devices run there; a variable's eager calls on its
#: shards' devices hold it too (:func:`on_device`), so a save reading in the background
#: never runs beside them. Function calls (the traced kernels) are not affected; code
#: that only needs a tensor of a given shape makes it on the default device instead.
#: Reentrant: an op-by-op call takes it inside a variable's call.
EAGER_ON_DEVICE = threading.RLock()


def eager_on_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """:data:`EAGER_ON_DEVICE` for eager ops on ``device``, unless it is the host's first
    CPU, where the inputs of two threads' ops stay their own."""
    return EAGER_ON_DEVICE if needs_eager_lock(device) else contextlib.nullcontext()


def needs_eager_lock(device: str) -> bool:
    """Whether eager ops on ``device`` take :data:`EAGER_ON_DEVICE` (see
    :func:`eager_on_device`): every device but the host's first CPU."""
    spec = tf.DeviceSpec.from_string(device)
    return not (spec.device_type in (None, "CPU") and spec.device_index in (None, 0))


@contextlib.contextmanager
def on_device(device: str) -> Iterator[None]:
    """``tf.device(device)``, holding :data:`EAGER_ON_DEVICE` while executing eagerly off
    the host's first CPU (:func:`eager_on_device`): the ops a variable runs on one shard's
    device around the shard's kernels, in the thread that trains, beside a save's reads
    of a snapshot in the background."""
    with tf.device(device):
        if not tf.executing_eagerly():
            yield
            return
        with eager_on_device(device):
            yield


class TableMutex(tf.saved_model.experimental.TrackableResource):
    """A table's ``MutexV2`` resource, created on ``device`` at construction.

    Tracked by its table, so that a SavedModel whose functions lock the table creates the
    mutex again when it is loaded; destroyed with this object.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device=device)
        if tf.compat.v1.get_default_graph().building_function:
            with tf.init_scope():  # created now, not inside a caller's trace
                self.resource_handle  # noqa: B018
        else:  # eagerly, or into the tf.compat.v1 graph that holds the table
            self.resource_handle  # noqa: B018

    def _create_resource(self) -> tf.Tensor:
        # An anonymous name: a mutex of its own (an empty shared name would give every
        # table of the process one mutex, in eager mode).
        return tf.raw_ops.MutexV2(container="", shared_name=context.anonymous_name())

    def _destroy_resource(self) -> None:
        tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)


def critical_section(mutex: tf.Tensor, inputs: Sequence[Any], build: Callable[[], T]) -> T:
    """Build ``build()`` into the current graph (a function body) to run holding ``mutex``.

    The lock is taken after every tensor of ``inputs`` is computed (all the body's inputs:
    after inlining, an input's producer may itself wait for a lock); every op ``build``
    creates runs after the lock is taken, and the lock is released after all of them.
    """
    graph = tf.compat.v1.get_default_graph()
    ready = [x for x in tf.nest.flatten(inputs) if isinstance(x, tf.Tensor)]
    with tf.control_dependencies(ready):
        lock = tf.raw_ops.MutexLock(mutex=mutex)
    first = len(graph.get_operations())
    with tf.control_dependencies([lock]):
        outputs = build()
    with tf.control_dependencies(graph.get_operations()[first:]):
        tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)
    return outputs


def run_locked(mutex: TableMutex, build: Callable[..., T], *args: Any) -> T:
    """Run ``build(*args)`` holding ``mutex``: eagerly, the lock is held while the ops
    run; inside a trace, ``build`` becomes a function of its own that locks (see the
    module docstring). ``build`` must not lock the same table again."""
    if tf.executing_eagerly():
        lock = tf.raw_ops.MutexLock(mutex=mutex.resource_handle)
        try:
            return build(*args)
        finally:
            del lock  # the lock is released with the last reference to its tensor

    def locked(handle: tf.Tensor, *inputs: Any) -> T:
        return critical_section(handle, [handle, *inputs], lambda: build(*inputs))

    return tf.function(locked, autograph=False)(mutex.resource_handle, *args)


def locked(method: Callable[..., T]) -> Callable[..., T]:
    """Make a table method run holding ``self._mutex`` (see :func:`run_locked`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> T:
        call = functools.partial(method, self, **kwargs)
        return with_graph_op(lambda: run_locked(self._mutex, call, *args))

    return run


def with_graph_op(call: Callable[[], Any]) -> Any:
    """``call()``; in a ``tf.compat.v1`` graph (not a function), a call returning nothing
    returns the operations it added, grouped: what ``Session.run`` fetches to run it."""
    if tf.executing_eagerly():
        return call()
    graph = tf.compat.v1.get_default_graph()
    if graph.building_function:
        return call()
    before = len(graph.get_operations())
    result = call()
    return tf.group(*graph.get_operations()[before:]) if result is None else result


@contextlib.contextmanager
def unoptimized_calls() -> Iterator[None]:
    """Function calls made on this thread skip Grappler while in this block: eager calls,
    and the call ops added to a graph being built (their ``config_proto``).

    A kernel's graph is built from few, fused ops with nothing for Grappler to fold or
    prune, yet optimizing its ~1,250 nodes is a large part of what its first call costs
    in a process, when TensorFlow instantiates it (docs/benchmarks.md, Costs behind the
    code), and again for each caller's function that calls it.
    The options are thread-local (TensorFlow's own ``function_executor_type`` sets them
    the same way): calls of the user's functions are left as they are.
    """
    ctx = context.context()
    before = ctx.function_call_options
    options = copy.copy(before)
    options.config_proto_serialized = _unoptimized(before.config_proto_serialized)
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = before


@functools.lru_cache(maxsize=8)
def _unoptimized(serialized: bytes) -> tf.compat.v1.ConfigProto:
    """The config ``serialized`` with Grappler off."""
    config = tf.compat.v1.ConfigProto.FromString(serialized)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config
