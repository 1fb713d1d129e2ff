"""XLA compiles of the compiled probe rounds for eager bulk calls, made off the caller's path.

The races of big inserts and loads (in chunks of 32K keys, one shape per index capacity)
and the first probe rounds of big lookups (per capacity and batch size class) are XLA
computations (:mod:`._index`): about 0.4 s each to compile on the development machine,
paid by the first call of each shape in a process. A table filled or restored in a new
process meets one or two capacities, and would pay their compiles before its first rows
are in.

An eager bulk call (a big insert, lookup or a restore's load, run op by op by
:class:`~._kernels.Kernels`) asks :func:`call` (or, for a race run chunk after chunk,
:func:`runner` once) instead of calling the compiled function: when this process has
compiled the shape, the compiled function runs; otherwise the same rounds run as
TensorFlow ops (:data:`~._index.plain`: the same results, a few times slower a key), and
one background thread compiles the shape (the function read from the kernel cache, or
traced first, in the caller's thread) by calling the compiled function on a stand-in
index of the same shape and dtype on the same device (a variable holding uninitialised
memory and no row of any table, with no key taking part: the probes read it, nothing is
written). Later calls of the shape run compiled once that is done. A race of many keys
waits for the compile instead (see :func:`runner`): its plain rounds would take about as
long, competing with the compile for the cores. The stand-in's memory
is only reserved: the rounds read the slots of a few padding keys. It is counted in use by
the CPU allocator all the same, hundreds of MiB for a table of millions of keys, made and
freed while the caller goes on: a growth that compares the allocator's counts before and
after it leaves the stand-ins out (:func:`cpu_bytes_in_use_but_stand_ins`). The compiled
functions are called by the names the cached kernels call them
(:func:`~._kernel_cache.as_cached`), from a traced function as the kernels call them:
XLA keys its compiles by function name and call options (which calls from a graph do
not have), so that one compile serves the eager calls and the traced kernels.

Inside a ``tf.function`` (a traced kernel), the compiled functions are called directly,
as XLA requires of a graph: nothing here is asked.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Hashable
from typing import Any

import tensorflow as tf

from de_store._memory import buffer_address, cpu_bytes_in_use
from de_store.tables import _kernel_cache
from de_store.tables._index import plain
from de_store.tables._locking import eager_on_device, needs_eager_lock, unoptimized_calls
from de_store.tables._variables import eager_length

log = logging.getLogger("de_store")

__all__ = [
    "call",
    "compiled_race",
    "cpu_bytes_in_use_but_stand_ins",
    "stand_in_buffers",
    "prepare",
    "prepare_at",
    "runner",
    "wait_for_compiles",
    "waits",
]

_lock = threading.Lock()
#: Shapes compiled in this process, and those being compiled.
_compiled: set[Hashable] = set()
_pending: dict[Hashable, concurrent.futures.Future[None]] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_callables: dict[Hashable, Any] = {}
_tracing = threading.Lock()
#: The ``(address, bytes)`` of the stand-ins of compiles under way that the CPU allocator
#: counts in use, and the lock under which a stand-in is made or freed with its entry.
_stand_in_buffers: dict[int, tuple[int, int]] = {}
_stand_ins = threading.Lock()


def cpu_bytes_in_use_but_stand_ins() -> int | None:
    """What the CPU allocator counts in use (:func:`~de_store._memory.cpu_bytes_in_use`;
    None where it keeps no count) less the stand-ins that compiles under way hold.

    A growing call compares two such counts, one before it and one after, to tell
    whether the stores it replaced went back to the allocator's pool
    (:func:`~._kernels._release_replaced`); a stand-in of hundreds of MiB, made or freed
    by the compiling thread between them, would make the stores look still held, and
    their pages would stay resident."""
    with _stand_ins:
        in_use = cpu_bytes_in_use()
        held = sum(size for _, size in _stand_in_buffers.values())
    return None if in_use is None else in_use - held


def stand_in_buffers() -> list[tuple[int, int]]:
    """The ``(address, bytes)`` of the stand-ins that compiles under way hold on this
    host's CPUs: memory that a release of the allocator's free chunks must treat as
    held, as it treats a table's arrays."""
    with _stand_ins:
        return list(_stand_in_buffers.values())


def call(function: Any, index: tf.Variable, *args: tf.Tensor) -> Any:
    """``function(index.handle, *args)``, one of the compiled rounds of :mod:`._index`:
    compiled when this process has compiled its shape, else as TensorFlow ops while a
    background thread compiles it. Inside a trace: the compiled function."""
    if not tf.executing_eagerly():
        return function(index.handle, *args)
    signature = _signature(function, index, args)
    if signature in _compiled:
        with unoptimized_calls():
            return _as_cached(function)(index.handle, *args)
    _start(signature, function, index.device, index.dtype, args)
    return plain[function](index.handle, *args)


def runner(function: Any, index: tf.Variable, *args: tf.Tensor, wait: bool = False) -> Any:
    """The compiled ``function`` for ``index`` and arguments shaped as ``args``, taking
    ``(index.handle, *args)``, when this process has compiled that shape; else ``None``,
    the compile started. For a caller that calls it many times eagerly on one shape (an
    eager race, chunk after chunk), which runs its own plain rounds otherwise.

    ``wait``: the compile of that shape is waited for (started now, or already under way,
    as from an insert's growth, see :meth:`~._capacity.CapacityOps.reserve`) when this
    process has not compiled it (``None`` if the compile failed), unless the compiling
    thread needs the lock the caller holds (see :func:`_waited`): ``None`` then too. For a
    batch whose plain rounds would take about as long as the compile: on a machine of few
    cores the plain rounds and the compile compete for them, and the compiled race then
    goes several times faster."""
    signature = _signature(function, index, args)
    if signature not in _compiled:
        _start(signature, function, index.device, index.dtype, args)
        if not wait or not _waited(signature):
            return None
    compiled = _as_cached(function)

    def run(*inputs: tf.Tensor) -> Any:
        with unoptimized_calls():
            return compiled(*inputs)

    return run


def _waited(signature: Hashable) -> bool:
    """Wait for the compile of ``signature`` (started); whether it compiled. Not while any
    pending compile, this one or another (the one thread compiles them in turn), is for a
    device off the host's first CPU: the compiling thread makes that stand-in holding
    ``EAGER_ON_DEVICE`` (:func:`~._locking.eager_on_device`), which the caller, an
    op-by-op call, holds."""
    with _lock:
        pending = _pending.get(signature)
        if pending is not None and _compiling_off_first_cpu():
            return False
    if pending is not None and pending.exception() is None:
        with _lock:  # compiled: known now, before ``_finish`` runs in the compiling thread
            _compiled.add(signature)
    return signature in _compiled


def waits(function: Any, index: tf.Variable, *args: tf.Tensor) -> bool:
    """Whether :func:`runner` with ``wait`` would wait now for the compile of ``function``
    for ``index`` and arguments shaped as ``args``: this process has not compiled that
    shape, and no pending compile needs the caller's lock (see :func:`_waited`)."""
    signature = _signature(function, index, args)
    with _lock:
        return signature not in _compiled and not _compiling_off_first_cpu()


def _compiling_off_first_cpu() -> bool:
    """Whether a pending compile is for a device off the host's first CPU (``_lock``
    held): its stand-in is made holding ``EAGER_ON_DEVICE``."""
    return any(needs_eager_lock(s[1]) for s in _pending)  # type: ignore[index]


def compiled_race(race: Any, index: tf.Variable) -> bool:
    """Whether this process has compiled ``race`` (one of :data:`~._index.race_from`) for
    ``index`` as it is now: its device and capacity (a race has one shape a capacity)."""
    device, capacity = index.device, eager_length(index)
    with _lock:
        return any(
            s[0] is race and s[1] == device and s[2][0] == capacity  # type: ignore[index]
            for s in _compiled
        )


def prepare(function: Any, index: tf.Variable, *args: tf.Tensor) -> None:
    """Start compiling ``function`` for the shapes of ``index`` and ``args`` in the
    background, unless this process has (a restore, before its rows are read)."""
    signature = _signature(function, index, args)
    if signature not in _compiled:
        _start(signature, function, index.device, index.dtype, args)


def prepare_at(function: Any, index: tf.Variable, capacity: int, *args: tf.Tensor) -> None:
    """:func:`prepare` for ``index`` once it holds ``capacity`` slots (a restore, before
    it grows the index: the compile and the growth overlap).

    A restore calls this before it readies the load's kernel, whose trace calls
    ``function`` and finds it traced (see :func:`_start`)."""
    signature = _signature(function, index, args, capacity)
    if signature not in _compiled:
        _start(signature, function, index.device, index.dtype, args)


def _signature(
    function: Any, index: tf.Variable, args: tuple[Any, ...], capacity: int | None = None
) -> Hashable:
    """What a compile is known by: the function, the index's device and shape (its length
    ``capacity`` when given, else asked of the variable, whose static shape leaves it
    open) and the arguments' shapes."""
    if capacity is None:
        capacity = eager_length(index)
    shape = (capacity, *(int(x) for x in index.shape[1:]))
    return (function, index.device, shape, tuple(tuple(a.shape.as_list()) for a in args))


def wait_for_compiles() -> None:
    """Wait for the compiles started so far (tests; a benchmark that wants them out of
    its timings)."""
    with _lock:
        pending = list(_pending.values())
    concurrent.futures.wait(pending)


def _start(
    signature: Hashable, function: Any, device: str, dtype: tf.DType, args: tuple[Any, ...]
) -> None:
    """Have the background thread compile ``signature``, ``function`` read from the kernel
    cache or traced first in the calling thread (a tenth of a second, once a process and
    machine): traced in the background, it would hold the interpreter lock that the
    caller's next steps need (the plain rounds' ops, one by one; a restore's trace of the
    load's kernel), and the compile would start only after that contended trace."""
    global _pool
    _as_cached(function)
    with _lock:
        if signature in _pending or signature in _compiled:
            return
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="de_store-xla")
        specs = [tf.TensorSpec(a.shape, a.dtype) for a in args]
        shape = tf.TensorShape(signature[2])  # type: ignore[index]
        future = _pool.submit(_compile, function, device, shape, dtype, specs)
        _pending[signature] = future
    future.add_done_callback(lambda done: _finish(signature, done))


def _finish(signature: Hashable, future: concurrent.futures.Future[None]) -> None:
    with _lock:
        del _pending[signature]
        if future.exception() is None:
            _compiled.add(signature)
        else:  # the shape runs as TensorFlow ops; the error is the compiler's, not the table's
            log.debug("XLA compile of %s failed: %s", signature, future.exception())


def _compile(
    function: Any, device: str, shape: tf.TensorShape, dtype: tf.DType, specs: list[tf.TensorSpec]
) -> None:
    """Call ``function`` on a stand-in index of ``shape`` with zero keys taking part (the
    last-but-start argument ``count`` is 0; padding keys 0), so XLA compiles the shape."""
    args = [_zeros(spec) for spec in specs]  # on the default device: see EAGER_ON_DEVICE
    spec = tf.DeviceSpec.from_string(device)
    local_cpu = spec.device_type == "CPU" and spec.job in (None, "localhost")
    with tf.device(device):
        with eager_on_device(device), _stand_ins:
            # Made inside the initializer, the memory is the variable's own, never copied.
            stand_in = tf.Variable(
                lambda: tf.raw_ops.Empty(shape=shape.as_list(), dtype=dtype, init=False),
                trainable=False,
            )
            if local_cpu and cpu_bytes_in_use() is not None:  # the allocator counts it
                size = shape.num_elements() * dtype.size
                _stand_in_buffers[id(stand_in)] = (buffer_address(stand_in.value()), size)
        try:
            with unoptimized_calls():
                _as_cached(function)(stand_in.handle, *args)
        finally:
            with _stand_ins:
                _stand_in_buffers.pop(id(stand_in), None)
                del stand_in


def _as_cached(function: Any) -> Any:
    """``function`` called by the name the traced kernels call it
    (:func:`~._kernel_cache.as_cached`): one XLA compile serves both."""
    key = (function, _kernel_cache.cache_dir())
    with _lock:
        known = _callables.get(key)
    if known is not None:
        return known
    with _tracing:  # traced once: threads preparing a restore's shards ask together
        known = _callables.get(key)
        if known is not None:
            return known

        # Called from a traced function, as the kernels call it: XLA's key of an eager
        # call holds the call options too, that of a call in a graph does not.
        def in_graph(*args: tf.Tensor) -> Any:
            return function(*args)

        wrapper = tf.function(in_graph, input_signature=function.input_signature, autograph=False)
        known = _kernel_cache.as_cached(wrapper, _name_of(function))
        with _lock:
            _callables[key] = known
    return known


def _name_of(function: Any) -> str:
    """The name every process gives compiled ``function`` in the kernel cache: that of its
    Python function and of the arguments bound to it (``race_from``'s ``serial``)."""
    python = function.python_function
    base = getattr(python, "func", python)
    bound = sorted(getattr(python, "keywords", {}).items())
    return f"compiled {base.__module__}.{base.__qualname__} {bound}"


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    return tf.zeros(spec.shape, spec.dtype)
