"""An open-addressing hash table made of ``tf.Variable`` s and GPU-capable ops.

Layout
------
*Index*: ``index [capacity, 2]`` int64 entries ``(key, row)``, a power-of-two
open-addressing array probed by double hashing (a key steps by an odd stride of its own,
``probe_step``); one gather reads a slot's key and row together.
The row is the key's row id, or ``EMPTY`` / ``DELETED`` (a tombstone, so probe chains
stay valid). An insert that makes the index grow leaves room for three more batches of its
size as well (at most 2**22 keys more): a table being filled batch after batch then meets
few capacities, and each capacity costs a rehash and the XLA compiles of the first probe
rounds.
*Row store*: ``values [rows, dim]`` grown geometrically by ``row_growth`` at least (times
what a batch needs, when it needs more than that), and ``row_keys [rows]``, the key of each
row, written with it. On a CPU a growth copies only the rows in use into a store left
unwritten past them and sized for every key the index holds, so a table being filled
copies its rows about once per capacity of its index, and the rows not yet written cost
no resident memory; on a GPU a gather builds each bigger store (docs/architecture.md,
*The memory of a growing table*). Rows freed by ``remove`` go on a free list
(``free_rows``) and are reused first. While no row is free, the store's first rows are
exactly the live ones: a save writes them as the store holds them (``snapshot``), and
``export_changes`` reads the keys of the rows stamped after a mark, neither scanning the
index.

Keeping the values out of the probe array means the index (16 bytes a slot) is the only
part sized by the power-of-two capacity, so the table stays within ~1.5x the raw key+value
bytes, and growing the index (a rehash) never moves a value row. A bigger index or row
store is assigned after ``DisableCopyOnRead``: a variable that gathers and scatters have
touched otherwise copies each value assigned to it, into memory touched for the first
time (``_variables.replace``): those copies would be a large share of a growth in a new
process.

Batches are processed in parallel: every key probes at once, in rounds of a
``tf.while_loop`` that carry only the keys still unresolved. Keys that reach the same empty
slot in the same round race for it with a ``scatter_update`` of ``(key, token)``; the one
read back wins and the losers look at the slot again next round (a duplicate of the winner
then finds it). Inserts and bulk loads of 16,384 keys or more race in chunks of 32K keys,
one chunk after the other: each chunk's keys run three compiled probe rounds from their
home slots, and those that stopped at an empty slot race for it in the same XLA
computation (the other keys' writes go out of bounds, which XLA's scatter skips). The keys
those rounds left, and the race's losers, go on in a loop whose every round runs the same
compiled rounds and race over them, chunk after chunk (``_claim_loop``): one XLA shape per
index capacity, whatever the batch's size, for inserts and loads alike. A compiled round
fuses the gathers, the claim scatter and the read-back that TF ops run as separate
kernels, which makes it several times cheaper a key (``benchmarks/table_bench.py`` times
inserts batch by batch). The token of the batch's key ``i`` is the row it gets
(``next_row + i``) when at most 1/16 of the keys are present or repeated and no freed row
waits: the claims then wrote the final entries, but for the few new keys whose token lies
past the batch's new rows, which move into the rows of the keys found; otherwise the new
keys' entries are written again with the rows allocated. For ``insert``, when no key
repeats a new key of the batch (the common case) every claimer is its own last occurrence;
otherwise the last occurrence of a duplicated new key is a segment max over the keys that
found its claim. Present keys (and ``remove``) race with tokens once more, re-run for later
writers until the last one holds the slot. ``accum`` sums duplicates with ``scatter_add``.
Those confirmations are for a GPU, whose scatter keeps an arbitrary writer and may mix the
columns of two. TensorFlow's CPU ``scatter_update`` writes its updates one by one in batch
order, so on a CPU the last claimer wins whole, and ``insert`` writes every row in batch
order, the last of repeated keys last: CPU tables skip the confirming rewrites and the
search for last occurrences (``Config.serial_scatter``). A rehash places the (distinct)
keys with their row ids directly, and so does ``load_distinct``, the bulk load a restore
uses (a checkpoint holds each key once); a key found in its own way there (present, or
repeated) makes it clear the table and raise ``RepeatedKeysError``.

Lookups (and the finds of ``accum(insert_missing=False)`` and ``export_changes``) of
16,384 keys or more first run two probe rounds over every key as one XLA computation
(``jit_compile``: its fused gathers are several times faster than the loop's, which
compacts the unresolved keys every round); the loop then goes on from there for the keys
left (two in a thousand of the keys inserted first, a third of those inserted last). XLA
compiles once per index capacity and batch size class (4 to 8 classes per power of two).

The kernels are ``tf.function`` s shared by every table of one configuration (dtype, dim,
sizing), traced once and given the variables' resource handles and the table's mutex;
inside a caller's ``tf.function`` they are called as functions too.

Fixed shapes
------------
A table on another task's device (a parameter server) keeps every variable at the shape it
was created with: TensorFlow cannot hand a worker a remote variable of unknown shape (a
step that touches one aborts the worker), and a traced step cannot create variables. Such
a table (``fixed_shapes``; by default, when its device belongs to another job or task than
this process) grows into new, bigger variables, created eagerly on its device, and kernels
in a ``tf.function`` read the table's current variables at each call
(``capture_call_time_value``), so steps traced before a growth use the variables after
it. Inside a ``tf.function`` a batch that needs more room than the table has fails, naming
the table, before it writes anything; between steps, ``reserve`` (and every eager insert)
grows the table. A growth replaces the variables, so it must not overlap a running step.
Under a ``ClusterCoordinator`` the chief keeps such tables ahead of their load itself:
creating the first one wraps ``ClusterCoordinator.schedule`` (:mod:`._ps_growth`), which
waits for the steps in flight and grows the tables, before a step that could find one
short of room.

Threads
-------
Every kernel takes the table's mutex (a ``MutexV2`` resource, :mod:`._locking`) after its
inputs are ready, and releases it after its last op, growth included: calls from any
number of Python threads and from concurrently running ``tf.function`` s run one at a
time on one table, each whole. A lookup or export sees a row before or after a
concurrent write, never half of it, and sizes move by whole calls. The lock ops have
``DEFAULT`` kernels, so a table on a GPU stays on it; on one thread the lock costs at
most a few percent of a batch (``benchmarks/table_bench.py``, ``lock``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from de_store._memory import collapse_huge_pages
from de_store.errors import RepeatedKeysError
from de_store.tables import (
    _change_tracking,
    _checks,
    _fixed_growth,
    _index,
    _kernels,
    _locking,
    _placement,
    _ps_growth,
    _types,
    _variables,
    _xla,
)
from de_store.tables._capacity import NO_ROOM
from de_store.tables.base import TableCore, TableSnapshot

_KEY_DTYPES = (tf.int64, tf.int32)
EMPTY = _index.EMPTY
DELETED = _index.DELETED
#: Keys from which ``reserve`` puts a table's index on huge pages (a CPU table, eagerly):
#: an index of 64 MiB and more, well past what the TLB covers in 4 KiB pages.
HUGE_INDEX_MIN_KEYS = 1 << 21


class HashTable(TableCore):
    """GPU-capable key -> value-row table over ``tf.Variable`` s.

    Parameters
    ----------
    key_dtype
        ``tf.int64`` or ``tf.int32``.
    value_dtype
        One of float32, float16, bfloat16, float64, int32, int64.
    dim
        Width of each value row, ``>= 1``.
    name
        Names the table in error messages.
    init_size
        Number of keys to make room for up front.
    max_load_factor
        The index grows (doubling, as often as needed) before ``(keys + tombstones) /
        capacity`` would pass this.
    row_growth
        Least factor by which the row store grows when it is full, ``> 1`` (see *Row
        store*: a growth may also reserve unwritten rows up to the index's load limit).
    track_changes
        Stamp every written row with the current change epoch (4 bytes a row) and log
        removed keys, so that :meth:`export_changes` can list what changed since a mark
        (incremental checkpoints). ``False`` saves that memory and the per-write scatter.
    fixed_shapes
        Keep every variable's shape fixed and grow into new variables, eagerly (see *Fixed
        shapes* in the module docstring). ``None``: when the table's device belongs to
        another job or task than this process (a parameter server).

    The variables live on the device in scope when the table is created, and every
    operation runs there.

    Every method is safe to call from any number of threads and from ``tf.function`` s
    running at the same time: each operation holds the table's mutex while its ops run
    (see *Threads* in the module docstring), so it is atomic. The mutex is not
    reentrant and no operation calls another while holding it.
    """

    def __init__(
        self,
        key_dtype: tf.DType,
        value_dtype: tf.DType,
        dim: int,
        *,
        name: str = "table",
        init_size: int = 0,
        max_load_factor: float = 0.75,
        row_growth: float = 1.25,
        track_changes: bool = True,
        fixed_shapes: bool | None = None,
    ) -> None:
        key_dtype, value_dtype = tf.as_dtype(key_dtype), tf.as_dtype(value_dtype)
        _checks.check_config(name, key_dtype, value_dtype, dim, _KEY_DTYPES)
        _checks.check_sizing(name, max_load_factor, row_growth)
        super().__init__(name=_checks.table_name(name))
        self.table_name = name
        self.key_dtype, self.value_dtype, self.dim = key_dtype, value_dtype, dim
        self.max_load_factor, self.row_growth = float(max_load_factor), float(row_growth)
        # int32 has no GPU kernels for resource gathers/scatters: hold it as int64.
        self._stored_dtype = tf.int64 if value_dtype == tf.int32 else value_dtype
        self.init_capacity = _index.capacity_for(max(init_size, 1), self.max_load_factor)
        rows = max(init_size, 16)
        if fixed_shapes is None:
            fixed_shapes = _placement.in_remote_scope()
        self.fixed_shapes = bool(fixed_shapes)
        self.track_changes = bool(track_changes)
        with tf.name_scope(self.name):
            self._create_variables(rows)
        self._device = self.index.device
        self._on_host = tf.DeviceSpec.from_string(self._device).device_type == "CPU"
        self._mutex = _locking.TableMutex(self._device)
        self._kernels = _kernels.kernels_for(self._kernel_config(rows))
        self._growth = _fixed_growth.Growth(self) if self.fixed_shapes else None
        if self.fixed_shapes:
            _ps_growth.install()

    def _create_variables(self, rows: int) -> None:
        """The index at its initial capacity, a row store of ``rows`` rows, the free list,
        the change-tracking stamps and log, and the counters."""
        fixed, dim = self.fixed_shapes, self.dim
        # a fixed-shape table's free list holds every row, so that a removal never outgrows it
        free_rows = rows if fixed else 16
        self.index = _variable(
            "index", _index.empty_index(tf.constant(self.init_capacity, tf.int64)), fixed
        )
        self.values = _variable("values", tf.zeros([rows, dim], self._stored_dtype), fixed)
        self.free_rows = _variable("free_rows", tf.zeros([free_rows], tf.int64), fixed)
        self.num_keys = _counter("num_keys", 0, fixed)
        self.num_deleted = _counter("num_deleted", 0, fixed)
        self.num_free = _counter("num_free", 0, fixed)
        self.next_row = _counter("next_row", 0, fixed)
        stamp_rows = rows if self.track_changes else 16
        stamps = tf.zeros([stamp_rows], _change_tracking.STAMP_DTYPE)
        self.stamps = _variable("stamps", stamps, fixed)
        self.epoch = _counter("epoch", 1, fixed)
        self.removed = _variable("removed", tf.zeros([16], tf.int64), fixed)
        self.removed_at = _variable("removed_at", tf.zeros([16], tf.int64), fixed)
        self.num_removed = _counter("num_removed", 0, fixed)
        self.row_keys = _variable("row_keys", tf.zeros([rows], tf.int64), fixed)

    def adopt(self, state: Sequence[tf.Variable], mutex: Any) -> None:
        """Work on another table's variables (``_types.State`` order) and mutex from now
        on: those of a table loaded from a SavedModel, whose saved functions use them, so
        that this table's writes and those functions' lookups share the table and its lock.
        Its settings follow the loaded variables (dim, dtype, change tracking)."""
        names = _types.State._fields
        if len(state) != len(names):
            raise ValueError(f"table {self.table_name!r}: adopt takes {len(names)} variables")
        for name, variable in zip(names, state, strict=True):
            setattr(self, name, variable)
        rows = int(tf.shape(self.values)[0])
        self.dim = int(self.values.shape[-1])
        self._stored_dtype = self.values.dtype
        self.track_changes = int(tf.shape(self.stamps)[0]) == rows
        self._device = self.values.device
        self._on_host = tf.DeviceSpec.from_string(self._device).device_type == "CPU"
        self._mutex = mutex
        self._kernels = _kernels.kernels_for(self._kernel_config(rows))

    def _kernel_config(self, rows: int) -> _types.Config:
        """What the table's shared kernels depend on (``rows``: the initial row store)."""
        return _types.Config(
            self.dim,
            self._stored_dtype,
            self.max_load_factor,
            self.row_growth,
            self.init_capacity,
            self.track_changes,
            rows,
            serial_scatter=self._on_host,  # TensorFlow's CPU scatter is serial
            fixed_shapes=self.fixed_shapes,
            # on a CPU, grow into unwritten stores: their unwritten rows cost no memory
            reserve_rows=self._on_host,
        )

    # -- contract ----------------------------------------------------------------------
    def lookup(
        self, keys: tf.Tensor, default_value: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(values [n, dim], exists [n])``; see :meth:`TableCore.lookup`."""
        values, exists = self._run("lookup", self._keys(keys))
        values = tf.cast(values, self.value_dtype) if values.dtype != self.value_dtype else values
        if default_value is None:
            return values, exists
        default = _checks.default_rows(
            self.table_name, self.value_dtype, self.dim, tf.size(keys), default_value
        )
        # expand_dims, not a strided slice: see _index.find_in
        return tf.where(tf.expand_dims(exists, 1), values, default), exists

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> Any:
        """Upsert rows; a key repeated in the batch keeps its last value."""
        return self._run("insert", *self._keys_and_rows(keys, values, "values"))

    def load_distinct(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        """Bulk-insert keys absent from the table and distinct among themselves.

        The keys are placed directly, like a rehash, without the races ``insert`` needs
        to find repeats and present keys. Used by restores: a checkpoint holds
        each key once. If a key was present or repeated, the table is cleared and
        :class:`~de_store.errors.RepeatedKeysError` raised (inside a ``tf.function``, an
        assertion fails instead and the table is left as it is).
        """
        keys, values = self._keys_and_rows(keys, values, "values")
        repeated = None
        if tf.executing_eagerly() and self._growth is None:
            # Room first (a few ops where there is room), then the kernel that does not
            # grow: it traces in about two thirds of the time (see TableOps.load_prepared).
            # Should another thread's insert take the room in between, that kernel fails
            # before it writes, and the one that grows runs.
            self._run("prepare", tf.size(keys, out_type=tf.int64))
            try:
                repeated = self._run("load_prepared", keys, values)
            except tf.errors.InvalidArgumentError as err:
                if NO_ROOM not in str(err):
                    raise
        if repeated is None:
            repeated = self._run("load_distinct", keys, values)
        if not tf.executing_eagerly():
            tf.debugging.assert_equal(repeated, tf.constant(0, tf.int64), _repeated(self, None))
        elif int(repeated):
            self.clear()
            raise RepeatedKeysError(_repeated(self, int(repeated)))

    def accum(self, keys: tf.Tensor, deltas: tf.Tensor, insert_missing: bool = True) -> Any:
        """Add deltas (duplicates sum); missing keys are inserted when ``insert_missing``."""
        kernel = "accum_insert" if insert_missing else "accum_existing"
        return self._run(kernel, *self._keys_and_rows(keys, deltas, "deltas"))

    def remove(self, keys: tf.Tensor) -> Any:
        """Remove keys; missing keys are ignored."""
        return self._run("remove", self._keys(keys))

    def size(self) -> tf.Tensor:
        """Number of keys held (int64 scalar)."""
        return self._run("size")

    def reserve(self, count: int) -> None:
        """Grow once so that ``count`` more keys fit without growing again (bulk loads;
        between the steps of a fixed-shape table)."""
        if count > 0:
            if self._growth is not None and tf.executing_eagerly():
                self._growth.make_room(count, removals=count)
            else:
                self._run("prepare", tf.constant(count, tf.int64))
            self._index_on_huge_pages(count)

    def _index_on_huge_pages(self, count: int) -> None:
        """After ``reserve`` made room for ``count`` keys, from :data:`HUGE_INDEX_MIN_KEYS`:
        the index of a table in this process's memory, every slot of which its growth
        wrote, on huge pages (:func:`~de_store._memory.collapse_huge_pages`). Each key a
        bulk load places or a lookup finds reads a slot at random; on 4 KiB pages nearly
        every such read of a big index also misses the TLB (docs/architecture.md, *Huge
        pages for the index*)."""
        if (
            count >= HUGE_INDEX_MIN_KEYS
            and self._on_host
            and self._growth is None
            and tf.executing_eagerly()
            and _placement.on_this_task(self._device)
        ):
            collapse_huge_pages(_variables.read_shared(self.index))

    def compile_load(self, count: int, room_for: int = 0) -> None:
        """Start XLA compiling, in the background, what a bulk load of ``count`` keys runs
        compiled at the table's capacity now, writing nothing: a restore does it for its
        load batches before it reads the shards (see :mod:`._xla`).

        With ``room_for``, at the capacity the index has once ``reserve(room_for)`` made
        room for that many more keys: a restore starts the compile before it grows the
        table, so that the two overlap (an eager call of a growable table; others compile
        at the capacity now).
        """
        if count < _index.COMPILED_MIN_KEYS:
            return
        if room_for and self._growth is None and tf.executing_eagerly():
            # reserve grows to the smallest power of two holding the keys (or not at all)
            now = _variables.eager_length(self.index)
            wanted = int(self.num_keys.read_value()) + room_for
            capacity = max(now, _index.capacity_for(wanted, self.max_load_factor))
            race = _index.race_from[self._kernels.config.serial_scatter]
            # The arguments give the compile their shapes only: made on the default device
            # (see _locking.EAGER_ON_DEVICE), the compile runs on the table's.
            _xla.prepare_at(race, self.index, capacity, *_index.load_race_args())
            return
        self._run("compile_load", tf.constant(count, tf.int64))

    def clear(self) -> Any:
        """Remove every key; an index or row store that held some returns to its initial
        size (the room of a table grown for rows to come stays)."""
        return self._run("clear")

    def export_all(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(keys [n], values [n, dim])`` of the whole table in one consistent read."""
        keys, values = self._run("export_all")
        return self._exported(keys), self._exported_values(values)

    def snapshot(self) -> TableSnapshot:
        """The index and the row store as they are, held without a copy; their live rows
        are gathered when the snapshot is read. A write to the table after this call
        copies the buffer it changes first (copy-on-write), so the snapshot never sees it.
        """
        snapshot = self._run("snapshot")
        index, values, count, row_keys, handed_out, free_rows, num_free = snapshot

        def read_rows() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            with tf.device(self._device):
                keys, rows = _index.entry_columns(_index.live_entries(index))
                return self._exported(keys), rows, values

        def read_rows_in_store_order() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            # The live rows are those handed out and not on the free list: in the store's
            # order, a writer gathers them front to back (the index holds them scattered).
            held, handed, freed = int(count), int(handed_out), int(num_free)
            if freed:
                live = np.ones(handed, dtype=bool)
                live[np.asarray(free_rows)[:freed]] = False
                rows = np.flatnonzero(live)
            else:
                rows = np.arange(handed)
            if len(rows) != held:  # not a table this layout describes: read the index
                return tuple(np.asarray(x) for x in read_rows())  # type: ignore[return-value]
            keys = np.asarray(row_keys)
            keys = keys[rows] if freed else keys[:held]
            return keys.astype(self.key_dtype.as_numpy_dtype, copy=False), rows, np.asarray(values)

        # Read in a save's background thread, on the table's device, beside the training
        # thread's op-by-op calls there: see _locking.EAGER_ON_DEVICE.
        def read() -> tuple[tf.Tensor, tf.Tensor]:
            keys, rows, store = read_rows()
            with tf.device(self._device), _locking.eager_on_device(self._device):
                return keys, self._exported_values(tf.gather(store, rows))

        def lookup(keys: tf.Tensor) -> tf.Tensor:
            with tf.device(self._device), _locking.eager_on_device(self._device):
                rows = _index.find_in(index, self._keys(keys))
                found = tf.gather(values, tf.maximum(rows, 0))
                found = tf.where((rows >= 0)[:, None], found, tf.zeros_like(found))
                return self._exported_values(found)

        def read_in_store_order() -> tuple[np.ndarray, np.ndarray] | None:
            held = int(count)
            if int(handed_out) != held:  # a freed row: the live rows are not the first
                return None
            # np.asarray shares a CPU tensor's buffer (Tensor.numpy() copies it)
            keys = np.asarray(row_keys)[:held].astype(self.key_dtype.as_numpy_dtype, copy=False)
            return keys, np.asarray(values)[:held]

        # The store is offered where a reader shares it (host memory: elsewhere reading it
        # copies it whole, more than the live rows) and holds the values as exported.
        offered = self._on_host and values.dtype == self.value_dtype
        return TableSnapshot(
            int(count),
            read,
            lookup,
            read_rows_in_store_order if offered else None,
            read_in_store_order if offered else None,
        )

    def _exported(self, keys: tf.Tensor) -> tf.Tensor:
        return tf.cast(keys, self.key_dtype) if self.key_dtype != tf.int64 else keys

    def _exported_values(self, values: tf.Tensor) -> tf.Tensor:
        return tf.cast(values, self.value_dtype) if values.dtype != self.value_dtype else values

    def export(self, batch_size: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Yield snapshot batches of at most ``batch_size`` rows (eager only)."""
        return _checks.snapshot_batches(self.table_name, self.export_all(), batch_size)

    # -- change tracking ---------------------------------------------------------------
    def export_changes(self, since: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Return ``(keys, values, removed)``: the rows written at an epoch after ``since``
        and the keys removed after ``since`` that are absent now; see
        :meth:`TableCore.export_changes`."""
        self._check_tracking()
        keys, values, removed = self._run("export_changes", tf.constant(since, tf.int64))
        return self._exported(keys), self._exported_values(values), self._exported(removed)

    def forget_removed(self, upto: int) -> None:
        """Drop the removal records of epochs up to ``upto``."""
        self._check_tracking()
        self._run("forget_removed", tf.constant(upto, tf.int64))

    # -- introspection -----------------------------------------------------------------
    def capacity(self) -> int:
        """Number of index slots (a power of two)."""
        return int(_variables.variable_length(self.index))

    def memory_bytes(self) -> int:
        """Bytes held by the table's variables."""
        arrays = [self.index, self.values, self.row_keys, self.free_rows, self.stamps]
        arrays += [self.removed, self.removed_at]
        total = sum(
            int(tf.reduce_prod(tf.raw_ops.VariableShape(input=v.handle, out_type=tf.int64)))
            * v.dtype.size
            for v in arrays
        )
        return total + 6 * 8  # the six int64 counters

    # -- helpers -----------------------------------------------------------------------
    def _run(self, kernel: str, *args: tf.Tensor) -> Any:
        """Run a shared kernel on this table's variables, holding its mutex."""
        if self._growth is not None:
            return self._growth.run(kernel, args)
        with tf.device(self._device):
            return self._kernels.run(kernel, self._mutex.resource_handle, self._state, *args)

    @property
    def _state(self) -> _types.State:
        """The variables, as the shared kernels take them (a property: not tracked twice)."""
        return _types.State(
            self.index,
            self.values,
            self.free_rows,
            self.num_keys,
            self.num_deleted,
            self.num_free,
            self.next_row,
            self.stamps,
            self.epoch,
            self.removed,
            self.removed_at,
            self.num_removed,
            self.row_keys,
        )

    def _keys(self, keys: Any) -> tf.Tensor:
        keys = _checks.check_keys(self.table_name, self.key_dtype, keys)
        return tf.cast(keys, tf.int64) if keys.dtype != tf.int64 else keys

    def _keys_and_rows(self, keys: Any, rows: Any, what: str) -> tuple[tf.Tensor, tf.Tensor]:
        keys = self._keys(keys)
        rows, checks = _checks.check_rows(
            self.table_name, self.value_dtype, self.dim, keys, rows, what
        )
        with tf.control_dependencies(checks):  # nothing changes before the checks pass
            keys = tf.identity(keys)
            rows = (
                tf.cast(rows, self._stored_dtype)
                if rows.dtype != self._stored_dtype
                else (tf.identity(rows))
            )
        return keys, rows


def _repeated(table: HashTable, count: int | None) -> str:
    """The message of a failed ``load_distinct``: ``count`` None inside a ``tf.function``,
    where the count is not known yet and the table is not cleared."""
    found = "some keys were" if count is None else f"{count} keys were"
    cleared = "" if count is None else " (the table was cleared)"
    return (
        f"table {table.table_name!r}: load_distinct expects keys absent from the table and "
        f"distinct; {found} present already or repeated{cleared}"
    )


def _variable(name: str, initial: tf.Tensor, fixed: bool) -> tf.Variable:
    """A non-trainable variable whose leading dimension may change (growth, restore), or,
    ``fixed``, keeps the shape of ``initial`` (:func:`._placement.fixed_variable`)."""
    if fixed:
        return _placement.fixed_variable(name, initial)
    shape = tf.TensorShape([None]).concatenate(initial.shape[1:])
    return tf.Variable(initial, name=name, trainable=False, shape=shape)


def _counter(name: str, value: int, fixed: bool) -> tf.Variable:
    """An int64 scalar variable (placed as :func:`_variable` places it)."""
    if fixed:
        return _placement.fixed_variable(name, tf.constant(value, tf.int64))
    return tf.Variable(tf.constant(value, tf.int64), name=name, trainable=False)
