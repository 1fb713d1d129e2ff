"""The shared ``tf.function`` s of :class:`~de_store.tables.hash_table.HashTable`.

:class:`Kernels` holds the compiled functions of one :class:`Config`, shared by its tables;
each builds the ops of one operation with :class:`~de_store.tables._table_ops.TableOps` over
the variables it is given, holding the table's mutex (:mod:`._locking`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorflow as tf

from de_store._memory import (
    MIN_RELEASE_BYTES,
    buffer_address,
    release_free_chunks,
    release_freed_memory,
)
from de_store.tables import _kernel_cache, _xla
from de_store.tables._change_tracking import STAMP_DTYPE
from de_store.tables._index import handle_variable, race_from
from de_store.tables._locking import (
    EAGER_ON_DEVICE,
    critical_section,
    unoptimized_calls,
    with_graph_op,
)
from de_store.tables._table_ops import TableOps
from de_store.tables._types import Config, State, View
from de_store.tables._variables import eager_length, read_shared

__all__ = ["Config", "Kernels", "State", "View", "kernels_for"]

_log = logging.getLogger(__name__)


#: Kernels whose eager calls run op by op from this many keys on (see
#: :meth:`Kernels._runs_op_by_op`).
OP_BY_OP_MIN_KEYS = 1 << 16
OP_BY_OP_KEYED = frozenset(
    [
        "lookup",
        "insert",
        "load_distinct",
        "load_prepared",
        "accum_insert",
        "accum_existing",
        "remove",
    ]
)
#: Kernels whose eager calls run op by op until the traced kernel is ready: the bulk
#: steps of a save.
OP_BY_OP_BULK = frozenset(["snapshot", "export_all", "export_changes"])
#: Keyed kernels whose bulk calls also run op by op while this process has not compiled
#: the race of the table's index capacity (:data:`~._index.race_from`): the traced kernel
#: would wait for that compile (about 0.3 s), the ops run the race plain meanwhile.
OP_BY_OP_UNTIL_COMPILED = frozenset(["insert", "accum_insert"])
#: Seconds of op-by-op calls of a kernel in a process after which its trace starts in the
#: background (:meth:`Kernels._trace_behind`).
TRACE_AFTER_S = 2.0
#: Kernels traced in the background after their first op-by-op call: an incremental
#: save's export, called once a save, whose probe of the removed keys runs its loop from
#: Python op by op, several times the traced kernel's time. The trace, written to the
#: kernel cache, serves the process's later saves and every later process's.
TRACE_AT_ONCE = frozenset(["export_changes"])
#: Kernels whose eager calls always run op by op, never traced: a restore's sizing, and its
#: start of the load's XLA compile, which must not wait for it (:mod:`._xla`); and the
#: size, one read of a counter under the lock, faster op by op than a function's call
#: (about 0.4 ms against 1 ms, its first call 2 ms against a trace's 11 ms).
OP_BY_OP_ALWAYS = frozenset(["prepare", "compile_load", "size"])
#: Keyed kernels that grow a table. After a bulk eager call of one that grew its table,
#: the memory malloc holds free is handed back to the system (:meth:`Kernels.run`).
GROWING = frozenset(["insert", "accum_insert", "load_distinct"])

#: The thread that traces kernels behind op-by-op calls (:meth:`Kernels._trace_behind`).
_tracer: ThreadPoolExecutor | None = None


class Kernels:
    """The ``tf.function`` s of every table of one :class:`Config`, variables passed in.

    A function is traced once per config, not once per table: tests and models create many
    small tables of a few configs. Each kernel takes the table's mutex first and releases
    it after its last op, so one table's operations run one at a time, whole; kernels do
    not call each other (the mutex is not reentrant).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._eager_calls: dict[str, Any] = {}
        self._made = threading.Lock()  # one thread loads or traces a kernel at a time
        self._tracing = threading.Lock()
        self._traces: dict[str, Future[Any]] = {}
        self._op_by_op_s: dict[str, float] = {}  # time spent in op-by-op calls, by kernel
        self._missed: set[str] = set()  # not in the kernel cache when first asked
        self._inlined: dict[str, Any] = {}  # for tf.compat.v1 graphs (:meth:`_in_graph`)
        names = ["lookup", "insert", "load_distinct", "load_prepared", "accum_insert"]
        names += ["accum_existing", "remove"]
        names += ["clear", "prepare", "export_all", "export_changes", "forget_removed", "size"]
        names.append("compile_load")
        names.append("snapshot")
        if config.fixed_shapes:
            names.append("place_entries")
        for name in names:
            setattr(self, name, self._function(name))

    def run(self, name: str, mutex: tf.Tensor, state: State, *args: tf.Tensor) -> Any:
        """Run kernel ``name`` on the table of ``mutex`` and ``state``, holding the mutex.

        Eagerly the kernel runs as the kernel cache holds it (:mod:`._kernel_cache`:
        traced and written there on its first use on a machine), without Grappler (see
        :func:`~._locking.unoptimized_calls`); inside a caller's ``tf.function`` the
        shared function is called as a function (one call op, not inlined and not
        optimized: see :meth:`_function`), so that the lock is taken and released as in an
        eager call (see :mod:`._locking`). In a ``tf.compat.v1`` graph, the call is
        inlined (:meth:`_in_graph`), and a kernel without outputs returns the operations
        its call added, grouped: what ``Session.run`` fetches to run it.
        """
        # A growth frees the index or row store it replaced, and the buffers of its steps:
        # where TensorFlow allocates with malloc, freed pages in malloc's arenas stay in
        # the process until trimmed; under BFC, in BFC's pool (see :mod:`de_store._memory`).
        watched = tf.executing_eagerly() and not self.config.fixed_shapes
        grows = watched and name in GROWING and _keys(args) >= OP_BY_OP_MIN_KEYS
        sizes = _sizes(state) if grows else None
        in_use = (
            _xla.cpu_bytes_in_use_but_stand_ins() if grows and self.config.reserve_rows else None
        )
        stores = _stores(state) if in_use is not None else None
        result = self._dispatch(name, mutex, state, args)
        if sizes is not None and _sizes(state) != sizes:
            release_freed_memory()
            if stores is not None and in_use is not None:
                _release_replaced(stores, _stores(state), in_use)
        return result

    def _dispatch(self, name: str, mutex: tf.Tensor, state: State, args: tuple[Any, ...]) -> Any:
        """:meth:`run` but for the memory handed back after a growth."""
        if tf.executing_eagerly() and self._runs_op_by_op(name, state, args):
            if name in OP_BY_OP_ALWAYS:
                return self._op_by_op(name, mutex, state, args)
            began = time.perf_counter()
            try:
                return self._op_by_op(name, mutex, state, args)
            finally:
                self._ran_op_by_op(name, time.perf_counter() - began)
        handles = tuple(v.handle for v in state)
        with unoptimized_calls():  # in a graph being built, its call op carries them
            if tf.executing_eagerly():
                return self._eager(name)(mutex, *handles, *args)
            return with_graph_op(lambda: self._in_graph(name)(mutex, handles, *args))

    def _in_graph(self, name: str) -> tf.types.experimental.PolymorphicFunction:
        """Kernel ``name`` as a graph calls it: a function of its own (see
        :meth:`_function`), but in a ``tf.compat.v1`` graph, where it is inlined: the
        session's runtime refuses the compiled probe rounds' calls in the kernel's loops
        when the kernel runs as a function ("inputs from different frames")."""
        if tf.compat.v1.executing_eagerly_outside_functions() or self.config.fixed_shapes:
            return getattr(self, name)
        with self._made:
            if name not in self._inlined:
                self._inlined[name] = self._function(name, inline=True)
        return self._inlined[name]

    def _runs_op_by_op(self, name: str, state: State, args: tuple[Any, ...]) -> bool:
        """Whether an eager call runs its ops one by one: a bulk call (see
        :data:`OP_BY_OP_KEYED`, :data:`OP_BY_OP_BULK`) while the traced kernel is not
        ready (neither made in this process nor held by the kernel cache), or while the
        race it would wait for is not compiled (:data:`OP_BY_OP_UNTIL_COMPILED`). Its ops
        each take long enough that running them from Python costs little (the traced
        kernel is faster still, its ops run side by side), and the first such call of a
        new process would otherwise wait for the trace (an insert: about 0.5 s), which
        starts in the background once this process has spent :data:`TRACE_AFTER_S` in the
        kernel's op-by-op calls (:meth:`_ran_op_by_op`). A fixed-shape table's kernels
        check room first: always traced."""
        if self.config.fixed_shapes:
            return False
        if name in OP_BY_OP_ALWAYS:
            return True
        if name in OP_BY_OP_BULK:
            return not self._cached(name)
        if name not in OP_BY_OP_KEYED or not args:
            return False
        if _keys(args) < OP_BY_OP_MIN_KEYS:
            return False
        if not self._cached(name):
            return True
        if name not in OP_BY_OP_UNTIL_COMPILED:
            return False
        return not _xla.compiled_race(race_from[self.config.serial_scatter], state.index)

    def _ran_op_by_op(self, name: str, seconds: float) -> None:
        """Count ``seconds`` of an op-by-op call of kernel ``name``; past
        :data:`TRACE_AFTER_S` in all (a kernel of :data:`TRACE_AT_ONCE`: after its first
        call), trace it in the background (:meth:`_trace_behind`).

        A trace costs its process tenths of a second of Python (an insert's: some 1,250
        nodes), most of it holding the interpreter lock that the eager calls need between
        their ops, and the traced kernel saves a part of each call's time (its ops run
        side by side). A process that makes a few bulk calls (a table filled in a handful
        of batches, then saved) is faster without it, one that goes on calling gets it
        after a while, as a ski rental buys once renting has cost the price: the time
        lost either way stays within a small multiple of the trace's
        (``benchmarks/tfra_bench.py`` times a fill in new processes)."""
        with self._tracing:
            spent = self._op_by_op_s[name] = self._op_by_op_s.get(name, 0.0) + seconds
        if (spent >= TRACE_AFTER_S or name in TRACE_AT_ONCE) and name not in self._eager_calls:
            self._trace_behind(name)

    def _op_by_op(self, name: str, mutex: tf.Tensor, state: State, args: tuple[Any, ...]) -> Any:
        """Kernel ``name``'s ops run eagerly over the table's variables, holding the lock
        from the first op to the last; its compiled probe rounds compile in the background
        (:mod:`._xla`)."""
        specs = tf.nest.flatten(getattr(self, name).input_signature)[1 + len(State._fields) :]
        args = tuple(tf.convert_to_tensor(x, s.dtype) for x, s in zip(args, specs, strict=True))
        with EAGER_ON_DEVICE:  # no two threads run one at once
            lock = tf.raw_ops.MutexLock(mutex=mutex) if self.config.locked else None
            try:
                return getattr(TableOps(View(self.config, state)), name)(*args)
            finally:
                del lock  # released with the last reference to its tensor

    def _trace_behind(self, name: str) -> None:
        """Have a background thread make kernel ``name`` ready for eager calls
        (:meth:`_eager`), unless one has."""
        global _tracer
        with self._tracing:
            if name in self._traces:
                return
            if _tracer is None:
                _tracer = ThreadPoolExecutor(1, thread_name_prefix="de_store-trace")
            self._traces[name] = _tracer.submit(self._eager, name)

    def _eager(self, name: str) -> Any:
        """Kernel ``name`` for eager calls, taking its inputs flat: from the kernel cache
        (:mod:`._kernel_cache`), or traced now and written there; once, whichever thread
        asks first."""
        known = self._eager_calls.get(name)
        if known is not None:
            return known
        with self._made:
            known = self._eager_calls.get(name)
            if known is None:
                known = self._eager_calls[name] = self._made_eager(name)
        return known

    def _cached(self, name: str) -> bool:
        """Whether kernel ``name`` is ready for eager calls, loaded from the kernel cache
        now when it holds the kernel (a few milliseconds; a miss is asked once)."""
        if name in self._eager_calls:
            return True
        if name in self._missed:
            return False
        with self._made:
            if name not in self._eager_calls:
                kernel = _kernel_cache.load(self.config, name)
                if kernel is None:
                    self._missed.add(name)
                    return False
                self._eager_calls[name] = self._flat_call(name, kernel)
        return True

    def _made_eager(self, name: str) -> Any:
        function = getattr(self, name)
        # A kernel the cache was asked for already (``_cached``) is not read again.
        kernel = None if name in self._missed else _kernel_cache.load(self.config, name)
        if kernel is None:
            # Run as stored: the functions have the names later processes see.
            concrete = function.get_concrete_function()
            kernel = _kernel_cache.store(self.config, name, concrete) or self._traced(function)
        return self._flat_call(name, kernel)

    def _flat_call(self, name: str, kernel: Any) -> Any:
        """``kernel`` taking kernel ``name``'s inputs flat, each converted to its dtype."""
        specs = tf.nest.flatten(getattr(self, name).input_signature)

        def call(*flat: Any) -> Any:
            return kernel(
                *(tf.convert_to_tensor(x, s.dtype) for x, s in zip(flat, specs, strict=True))
            )

        return call

    @staticmethod
    def _traced(function: Any) -> Any:
        """``function`` taking its inputs flat (mutex, variable handles, arguments)."""
        count = len(State._fields)

        def call(mutex: tf.Tensor, *flat: tf.Tensor) -> Any:
            return function(mutex, flat[:count], *flat[count:])

        return call

    def _function(
        self, name: str, inline: bool = False
    ) -> tf.types.experimental.PolymorphicFunction:
        # The variables come in as resource handles (plain tensor inputs, so one trace
        # serves every table); a function given variables would capture the first ones.
        def kernel(mutex: tf.Tensor, handles: tuple[tf.Tensor, ...], *args: tf.Tensor) -> object:
            state = State(*map(handle_variable, handles, self._variable_specs()))
            ops = TableOps(View(self.config, state))
            operation = getattr(ops, name)
            if self.config.fixed_shapes:  # the last argument names the table
                *args, label = args  # type: ignore[assignment]
                operation = _checked(operation, ops, name, args, label)
            if not self.config.locked:
                return operation(*args)
            return critical_section(mutex, [handles, *args], lambda: operation(*args))

        keys = tf.TensorSpec([None], tf.int64)
        rows = tf.TensorSpec([None, self.config.dim], self.config.dtype)
        count = tf.TensorSpec([], tf.int64)
        args = {
            "lookup": [keys],
            "remove": [keys],
            "clear": [],
            "export_all": [],
            "snapshot": [],
            "size": [],
            "prepare": [count],
            "compile_load": [count],
            "export_changes": [count],
            "forget_removed": [count],
            "place_entries": [tf.TensorSpec([None, 2], tf.int64)],
        }
        handles = tuple(tf.TensorSpec([], tf.resource) for _ in State._fields)
        signature = [tf.TensorSpec([], tf.resource), handles, *args.get(name, [keys, rows])]
        if self.config.fixed_shapes:
            signature.append(tf.TensorSpec([], tf.string))
        # TensorFlow counts the traces of a function under its Python code object, which
        # every kernel of every config shares: their first (and only) traces would read as
        # one function retracing and log its warning. A partial has no code of its own, so
        # each kernel is counted under its own object.
        own = functools.partial(kernel)
        own.__name__ = name  # type: ignore[attr-defined]
        # Inside a caller's function a kernel is a function of its own (not inlined), and
        # its call op carries Grappler's "off" (:meth:`_dispatch`): a caller's function,
        # each time it is traced (a new step function, or one a ClusterCoordinator's worker
        # optimizes anew after a parameter server's tables grew), would otherwise have
        # Grappler go over the nodes of every kernel it calls (an insert's: some 1,250).
        attributes = None if inline else {"_noinline": True}
        return tf.function(
            own, autograph=False, input_signature=signature, experimental_attributes=attributes
        )

    def _variable_specs(self) -> list[tf.TensorSpec]:
        rows = tf.TensorSpec([None, self.config.dim], self.config.dtype)
        counter = tf.TensorSpec([], tf.int64)
        ids = tf.TensorSpec([None], tf.int64)
        stamps = tf.TensorSpec([None], STAMP_DTYPE)
        index = tf.TensorSpec([None, 2], tf.int64)
        return [index, rows, ids, *[counter] * 4, stamps, counter, ids, ids, counter, ids]


def _keys(args: tuple[Any, ...]) -> int:
    """The length of a keyed kernel's first argument, its keys (0 when not known)."""
    shape = tf.TensorShape(getattr(args[0], "shape", None) if args else None)
    return int(shape[0] or 0) if shape.rank else 0


#: The arrays a growth replaces (``Capacity.rehash``, ``Capacity._ensure_rows``, the free
#: list's push).
GROWN = ("index", "values", "row_keys", "stamps", "free_rows")


def _stores(state: State) -> dict[str, tuple[int, int]]:
    """The ``(address, bytes)`` of each of a table's :data:`GROWN` arrays on a CPU (the
    address only of those the release would take, 0 for the others)."""
    stores = {}
    for name in GROWN:
        var = getattr(state, name)
        size = eager_length(var) * var.shape[1:].num_elements() * var.dtype.size
        big = size >= MIN_RELEASE_BYTES
        stores[name] = (buffer_address(read_shared(var)) if big else 0, size)
    return stores


def _release_replaced(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], in_use: int
) -> None:
    """After a growth of a table on a CPU, hand back the pages of the arrays it replaced,
    and of the other chunks the CPU allocator holds free
    (:func:`~de_store._memory.release_free_chunks`), given the allocator's count in use
    before the growth (``in_use``).

    Only when they went back to the pool: an array still held elsewhere (a save's
    snapshot of the table) is not freed by its replacement, and a request for a chunk
    as big would make the allocator reserve new memory. The count tells: after a growth
    it is the count before, plus the new arrays, less the replaced ones if they were
    freed. Within an eighth of them (another thread's allocations move the count too;
    the stand-ins of XLA's compiles, made and freed meanwhile, are left out of it) they
    all were; otherwise nothing is requested. A request the allocator refuses ends
    the release and leaves the growth as it is.
    """
    replaced = [store for name, store in before.items() if after[name][1] != store[1]]
    added = sum(size for name, (_, size) in after.items() if before[name][1] != size)
    now = _xla.cpu_bytes_in_use_but_stand_ins()
    freed = sum(size for _, size in replaced)
    if replaced and now is not None and in_use + added - now >= freed - freed // 8:
        live = [store for store in after.values() if store[1]] + _xla.stand_in_buffers()
        try:
            release_free_chunks(replaced, live)
        except (tf.errors.OpError, OSError) as error:  # the growth itself is done
            _log.debug("handing back free pages after a growth failed: %s", error)


def _sizes(state: State) -> tuple[int, int]:
    """The lengths of a table's index and row store, read as numpy (:func:`eager_length`)."""
    return eager_length(state.index), eager_length(state.values)


def _checked(operation: Any, ops: TableOps, name: str, args: Any, label: tf.Tensor) -> Any:
    """``operation`` run after the room check of a fixed-shape table: every op it builds
    waits for the check, so a batch that does not fit writes nothing."""

    def run(*args: tf.Tensor) -> Any:
        check = ops.room_check(name, tuple(args), label)
        with tf.control_dependencies([check] if check is not None else []):
            return operation(*args)

    return run


@functools.cache
def kernels_for(config: Config) -> Kernels:
    """The shared kernels of ``config``."""
    return Kernels(config)
