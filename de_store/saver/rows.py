"""Between Variables and numpy rows: what the saver writes and what a restore applies.

:func:`export_rows` reads a Variable's shards (and its companions': optimizer slots,
restrict status) into a :class:`~de_store.checkpoint.variable_rows.VariableRows`;
:func:`export_delta` only the rows changed since a mark, and the keys removed since.
:func:`apply_rows` and :func:`apply_delta` put restored rows back. This is the saver's
TensorFlow side; the rows themselves are numpy (:mod:`de_store.checkpoint.variable_rows`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from de_store.checkpoint.buckets import bucket_order, key_hash_mod
from de_store.checkpoint.manifest import ColumnSpec, VariableEntry
from de_store.checkpoint.variable_rows import (
    TF_ALIGNMENT,
    VALUE_COLUMN,
    ChangeBase,
    DeviceShardRows,
    LoadBatch,
    PendingShardRows,
    RowsOf,
    ShardRows,
    SnapshotRows,
    VariableRows,
    coalesce,
    even_batches,
    even_sizes,
)
from de_store.errors import CheckpointError
from de_store.saver._lazy_tf import on_device, tf

if TYPE_CHECKING:
    from de_store.tables.base import TableCore

__all__ = [
    "VALUE_COLUMN",
    "RestoredVariable",
    "SavedVariable",
    "ShardRows",
    "VariableRows",
    "apply_delta",
    "apply_rows",
    "check_compatible",
    "column_specs",
    "column_targets",
    "export_delta",
    "export_rows",
    "io_device",
    "io_device_scope",
    "to_host",
    "to_tensor",
]


class SavedVariable(Protocol):
    """What the saver needs of a :class:`de_store.Variable` (and of its companions): its
    schema, shards and companions, and the change tracking of incremental saves. The
    saver, a lower layer than the Variable, names only this."""

    @property
    def name(self) -> str: ...
    @property
    def key_dtype(self) -> tf.DType: ...
    @property
    def value_dtype(self) -> tf.DType: ...
    @property
    def dim(self) -> int: ...
    @property
    def shards(self) -> Sequence[TableCore]: ...
    @property
    def devices(self) -> Sequence[str]: ...
    @property
    def change_base(self) -> ChangeBase | None: ...
    def companions(self) -> Mapping[str, SavedVariable]: ...
    def companion(self, column: str, dim: int, value_dtype: tf.DType) -> SavedVariable: ...
    def all_tables(self) -> list[TableCore]: ...
    def next_change_epoch(self) -> int: ...
    def clear(self) -> None: ...
    def size(self) -> tf.Tensor: ...
    def remove(self, keys: tf.Tensor) -> None: ...
    def upsert(self, keys: tf.Tensor, values: tf.Tensor) -> None: ...
    def load_distinct(
        self, keys: tf.Tensor, values: tf.Tensor, shard: int | None = None
    ) -> None: ...


class RestoredVariable(SavedVariable, Protocol):
    """What a restore needs of a variable besides what a save reads (a ``Variable``)."""

    def exclusive(self) -> contextlib.AbstractContextManager[Any]: ...


#: Rows per upsert on restore: large enough to amortise the per-call cost, small enough
#: for the table's insert to stay fast (it slows down on much larger batches).
UPSERT_ROWS = 1 << 18
#: Rows per bulk load (``load_distinct``) on restore at most: it gains from larger batches.
LOAD_ROWS = 1 << 20
#: Bytes of a bulk-load batch's values at most (see :func:`load_rows`).
LOAD_BYTES = 16 << 20
#: Headroom over an even split of the restored rows when shards are grown up front.
RESERVE_SLACK = 1.1


#: The device a save exports through and a restore stages its rows on: TF's
#: ``CheckpointOptions.experimental_io_device`` (None: the table's own device).
_IO_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("io_device", default=None)


@contextlib.contextmanager
def io_device_scope(device: str | None) -> Iterator[None]:
    """Export and stage rows through ``device`` within this block (this thread).

    A device that cannot be used fails here, before anything is read or changed.
    """
    if device is not None:
        with _on_io_device(device):
            tf.identity(tf.zeros([0]))
    token = _IO_DEVICE.set(device)
    try:
        yield
    finally:
        _IO_DEVICE.reset(token)


def io_device() -> str | None:
    """The IO device set by :func:`io_device_scope` in this thread (None: none is)."""
    return _IO_DEVICE.get()


def to_host(tensor: tf.Tensor) -> np.ndarray:
    """A tensor's rows in host memory, copied through the IO device when one is set.

    ``np.asarray`` shares a CPU tensor's buffer (``Tensor.numpy()`` would copy every row).
    """
    device = _IO_DEVICE.get()
    if device is None:
        return np.asarray(tensor)
    with _on_io_device(device):
        return np.asarray(tf.identity(tensor))


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """Restored rows as a tensor, placed on the IO device when one is set."""
    device = _IO_DEVICE.get()
    tensor = _host_tensor(array)
    if device is None:
        return tensor
    with _on_io_device(device):
        return tf.identity(tensor)


def _host_tensor(array: np.ndarray) -> tf.Tensor:
    """``array`` as a host tensor that shares its memory where DLPack can (writable ints
    and floats, aligned for TF; a copy otherwise): a 10M-row restore hands TF 720 MB."""
    aligned = array.ctypes.data % TF_ALIGNMENT == 0  # TF's kernels check it, and abort
    if array.dtype.kind in "iuf" and array.flags.writeable and aligned:
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (BufferError, TypeError, ValueError):
            pass  # e.g. a dtype DLPack lacks
    return tf.constant(array)


@contextlib.contextmanager
def _on_io_device(device: str) -> Iterator[None]:
    try:
        with tf.device(device):
            yield
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        raise CheckpointError(f"experimental_io_device {device!r} cannot be used: {err}") from err


def column_specs(variable: SavedVariable) -> dict[str, ColumnSpec]:
    """``value`` and each companion column of ``variable``, with dtype and dim."""
    specs = {VALUE_COLUMN: ColumnSpec(variable.value_dtype.name, variable.dim)}
    for column, companion in sorted(variable.companions().items()):
        specs[column] = ColumnSpec(companion.value_dtype.name, companion.dim)
    return specs


def export_shard(
    variable: SavedVariable, index: int
) -> ShardRows | PendingShardRows | DeviceShardRows:
    """Shard ``index`` of a save: keys, values and companion rows, in the table's order.

    - A table of this process gives snapshots of itself and its companions, read when
      the shard is written, in the background for async saves (``PendingShardRows``).
    - A table on another task (a parameter server) exports its rows into tensors that
      stay there, to be written there (``DeviceShardRows``,
      :mod:`~de_store.saver.device_shards`).
    - With an IO device set, or a companion whose core cannot look keys up in a
      snapshot, every row is read now (``ShardRows``).

    The rows stay in the table's order here: the writer groups them by key bucket later,
    gathering each value once, in bucket order, from the table's row store (``RowsOf``).
    """
    from de_store.tables._placement import in_remote_scope  # imports TensorFlow

    shard = variable.shards[index]
    device = variable.devices[index]
    io_device = _IO_DEVICE.get()
    with on_device(device):
        remote = in_remote_scope()
        if io_device is None and not remote:
            pending = _pending(variable, index)
            if pending is not None:
                return pending
        keys_t, values_t = shard.export_all()
        if io_device is None and remote:
            columns_t = {VALUE_COLUMN: values_t}
            for column, companion in sorted(variable.companions().items()):
                columns_t[column] = companion.shards[index].lookup(keys_t)[0]
            return DeviceShardRows(device, keys_t, columns_t)
        keys, columns = to_host(keys_t), {VALUE_COLUMN: to_host(values_t)}
        _add_companions(variable, index, keys, columns)
    return ShardRows(keys, columns)


def _pending(variable: SavedVariable, index: int) -> PendingShardRows | None:
    """Shard ``index`` of ``variable`` and of its companions as table snapshots, whose
    rows are read when the shard is written (None where a companion's core cannot look
    keys up in a snapshot: then every row is read now)."""
    lookups = {}
    for column, companion in sorted(variable.companions().items()):
        lookup = companion.shards[index].snapshot().lookup
        if lookup is None:
            return None
        lookups[column] = lookup
    table = variable.shards[index].snapshot()
    through_io_device = _IO_DEVICE.get() is not None

    def read() -> SnapshotRows:
        columns: dict[str, np.ndarray | RowsOf] = {}
        if table.read_rows is not None and not through_io_device:  # gathered by the writer
            keys, rows, store = table.read_rows()
            columns[VALUE_COLUMN] = RowsOf(to_host(store), to_host(rows))
        else:
            keys, values = table.read()
            columns[VALUE_COLUMN] = to_host(values)
        for column, lookup in lookups.items():
            columns[column] = to_host(lookup(keys))
        return SnapshotRows(to_host(keys), columns)

    in_store_order = None if lookups or through_io_device else table.read_in_store_order
    if in_store_order is None:
        return PendingShardRows(table.rows, read)

    def read_in_store_order() -> ShardRows | None:
        held = in_store_order()
        return None if held is None else ShardRows(held[0], {VALUE_COLUMN: held[1]})

    return PendingShardRows(table.rows, read, read_in_store_order)


def _add_companions(
    variable: SavedVariable, index: int, keys: np.ndarray, columns: dict[str, np.ndarray]
) -> None:
    for column, companion in sorted(variable.companions().items()):
        found, _ = companion.shards[index].lookup(tf.constant(keys))
        columns[column] = to_host(found)


def export_shard_changes(
    variable: SavedVariable, index: int, since: int
) -> tuple[ShardRows, np.ndarray]:
    """The rows of shard ``index`` changed after epoch ``since`` and the keys removed since.

    Changed: written to the value table or to any companion (an optimizer step may change
    only a slot); only keys still in the value table are kept, with all their columns.
    """
    shard = variable.shards[index]
    with on_device(variable.devices[index]):
        keys_t, values_t, removed_t = shard.export_changes(since)
        keys, values = to_host(keys_t), to_host(values_t)
        others = [
            to_host(companion.shards[index].export_changes(since)[0])
            for companion in variable.companions().values()
        ]
        extra = np.setdiff1d(np.concatenate([keys[:0], *others]), keys) if others else keys[:0]
        if len(extra):  # keys whose value row did not change: read it
            found, exists = (to_host(t) for t in shard.lookup(tf.constant(extra)))
            keys = np.concatenate([keys, extra[exists]])
            values = np.concatenate([values, found[exists]])
        columns = {VALUE_COLUMN: values}
        _add_companions(variable, index, keys, columns)
    return ShardRows(keys, columns), to_host(removed_t)


def export_delta(variable: SavedVariable, since: int) -> VariableRows:
    """A variable's changes after epoch ``since`` (eagerly; see :func:`export_shard_changes`)."""
    changes = [export_shard_changes(variable, i, since) for i in range(len(variable.shards))]
    return dataclasses.replace(
        _rows_of(variable, [rows for rows, _ in changes]),
        removed=[removed for _, removed in changes],
    )


def _rows_of(
    variable: SavedVariable, shards: Sequence[ShardRows | PendingShardRows | DeviceShardRows]
) -> VariableRows:
    return VariableRows(
        name=variable.name,
        key_dtype=variable.key_dtype.name,
        value_dtype=variable.value_dtype.name,
        dim=variable.dim,
        columns=column_specs(variable),
        shards=shards,
    )


def export_rows(variable: SavedVariable) -> VariableRows:
    """Read a variable's shards eagerly (a save's snapshot); see :func:`export_shard`."""
    return _rows_of(variable, [export_shard(variable, i) for i in range(len(variable.shards))])


def check_compatible(variable: SavedVariable, entry: VariableEntry, where: str) -> None:
    """Raise ``CheckpointError`` if the saved variable cannot be restored into ``variable``."""
    mine = (variable.key_dtype.name, variable.value_dtype.name, variable.dim)
    saved = (entry.key_dtype, entry.value_dtype, entry.dim)
    if mine != saved:
        raise CheckpointError(
            f"variable {variable.name!r}: checkpoint {where} holds (key_dtype, value_dtype, "
            f"dim) = {saved}, the variable expects {mine}"
        )
    for column, spec in entry.columns.items():
        companion = variable.companions().get(column)
        if companion is not None and (companion.value_dtype.name, companion.dim) != (
            spec.dtype,
            spec.dim,
        ):
            raise CheckpointError(
                f"variable {variable.name!r}: column {column!r} in {where} is "
                f"({spec.dtype}, dim {spec.dim}), the variable's companion is "
                f"({companion.value_dtype.name}, dim {companion.dim})"
            )


@dataclasses.dataclass(frozen=True)
class ByShard:
    """Rows split by table shard and regrouped into each shard's load batches already, as
    ``(shard, rows)`` (what :func:`shard_batches` yields): :func:`apply_rows` loads them
    as they come. A streaming restore splits them in its reading thread."""

    batches: Iterable[tuple[int, ShardRows]]


def apply_rows(
    variable: SavedVariable,
    specs: dict[str, ColumnSpec],
    batches: Iterable[ShardRows] | ByShard,
    reserve: int | Sequence[int] = 0,
    rows: int | None = None,
) -> None:
    """Replace the variable's content (and companions') with the restored rows; grow the
    tables first: each shard for its entry of ``reserve`` (rows per table shard, see
    :func:`restore_shares`), or for an even share of ``reserve`` rows (at least the rows
    given).

    ``rows``, the number of rows ``batches`` holds, lets them be a stream, loaded as they
    come (the load batches are sized from it); without it they are counted first.
    ``batches`` given :class:`ByShard` (with ``rows``, for a variable that
    :func:`routes_by_hash`) are loaded into the shards they name.

    The rows are bulk-loaded (``load_distinct``): a key given twice raises
    :class:`~de_store.errors.RepeatedKeysError` (on cores that detect it).
    """
    targets = column_targets(variable, specs)
    if rows is None:
        if isinstance(batches, ByShard):
            raise TypeError("apply_rows: ByShard batches need their row count (rows=)")
        batches = list(batches)
        rows = sum(batch.rows for batch in batches)
    if isinstance(reserve, int):
        reserve = even_shares(len(variable.shards), max(reserve, rows))
    # companions too; a clear's first call on a device costs what instantiating its
    # kernel there does, a size's was paid when the restore checked the variable
    if holds_keys(variable):
        variable.clear()
    for target in targets.values():
        reserve_shards(target, reserve)
    # a checkpoint holds each key once
    if isinstance(batches, ByShard):
        _load_by_shard(targets, batches.batches)
        return
    if routes_by_hash(variable):
        _load_by_shard(targets, shard_batches(batches, variable, reserve))
        return
    for batch in even_batches(batches, rows, load_rows(variable)):
        keys = to_tensor(batch.keys)
        for column, target in targets.items():
            target.load_distinct(keys, to_tensor(batch.columns[column]))


def holds_keys(variable: SavedVariable) -> bool:
    """Whether ``variable`` or one of its companions holds a key."""
    return any(int(table.size()) for table in [variable, *variable.companions().values()])


def routes_by_hash(variable: SavedVariable) -> bool:
    """Whether a restore sends rows to ``variable``'s table shards itself: several shards
    and ``default_partition_fn``, whose shard of a key (``floormod(hash(key), shards)``)
    numpy computes without TensorFlow's partition and gather."""
    from de_store.partition import default_partition_fn

    partitioner = getattr(variable, "partitioner", None)
    return len(variable.shards) > 1 and partitioner is default_partition_fn


def _load_by_shard(
    targets: dict[str, SavedVariable], batches: Iterable[tuple[int, ShardRows]]
) -> None:
    """Bulk-load each ``(shard, rows)`` of ``batches`` (see :func:`shard_batches`) into
    that table shard of every column's target."""
    for shard, batch in batches:
        keys = to_tensor(batch.keys)
        for column, target in targets.items():
            target.load_distinct(keys, to_tensor(batch.columns[column]), shard=shard)


def shard_batches(
    batches: Iterable[ShardRows], variable: SavedVariable, shares: Sequence[int]
) -> Iterator[tuple[int, ShardRows]]:
    """``(shard, rows)``: the rows of ``batches`` for each table shard of ``variable``
    (partitioned by ``default_partition_fn``: a key's shard from its hash), regrouped
    into the even batches of that shard's share (what ``restore_room.grow_for_restore`` compiled).

    Each batch's rows are ordered by shard (a counting sort of their shards) and gathered
    straight into the load batch their shard is filling (:class:`LoadBatch`): every row
    is copied once, by the reading thread, while the loads run in another thread that
    shares the memory's bandwidth.
    """
    count = len(variable.shards)
    most = load_rows(variable)
    sizes = [iter(even_sizes(max(share, 1), most)) for share in shares]
    filling: list[LoadBatch | None] = [None] * count
    for batch in batches:
        if not batch.rows:
            continue
        owner = key_hash_mod(batch.keys, count, variable.key_dtype.name)
        order, counts = bucket_order(owner, count)
        start = 0
        for shard, rows in enumerate(counts.tolist()):
            index, start = order[start : start + rows], start + rows
            while len(index):
                load = filling[shard] or LoadBatch(next(sizes[shard], most), batch)
                index = index[load.take(batch, index) :]
                filling[shard] = load
                if load.filled == load.size:
                    yield shard, load.rows()
                    filling[shard] = None
    for shard, rest in enumerate(filling):
        if rest is not None:
            yield shard, rest.rows()


def apply_delta(
    variable: SavedVariable,
    specs: dict[str, ColumnSpec],
    batches: Sequence[ShardRows],
    removed: Sequence[ShardRows],
) -> None:
    """Apply one link of a chain on top of the restored rows: drop ``removed``'s keys
    (with their companion rows), then upsert ``batches``."""
    for batch in coalesce(removed, UPSERT_ROWS):
        variable.remove(to_tensor(batch.keys))
    upsert_rows(column_targets(variable, specs), batches)


def column_targets(
    variable: SavedVariable, specs: dict[str, ColumnSpec]
) -> dict[str, SavedVariable]:
    """The table of each column: the variable for ``value``, else its companion."""
    targets = {VALUE_COLUMN: variable}
    for column, spec in specs.items():
        if column != VALUE_COLUMN:
            targets[column] = variable.companion(column, spec.dim, tf.as_dtype(spec.dtype))
    return targets


def upsert_rows(targets: dict[str, SavedVariable], batches: Iterable[ShardRows]) -> None:
    """Upsert every column of ``batches`` into its table, in large batches."""
    for batch in coalesce(batches, UPSERT_ROWS):
        keys = to_tensor(batch.keys)
        for column, target in targets.items():
            target.upsert(keys, to_tensor(batch.columns[column]))


def load_rows(variable: SavedVariable) -> int:
    """Rows per bulk-load batch of a restore into ``variable``: :data:`LOAD_ROWS`, fewer
    where a batch of its values would exceed :data:`LOAD_BYTES`.

    A batch is assembled in new arrays. glibc's allocator keeps freed buffers of up to
    32 MiB in the process and hands them out again; larger ones are fresh pages from the
    kernel, which every batch would pay to first touch again (the slowest step of
    copying a batch on a virtual machine whose host hands memory out lazily).
    """
    row_bytes = max(variable.dim, 1) * variable.value_dtype.size
    return max(1, min(LOAD_ROWS, LOAD_BYTES // row_bytes))


def restore_shares(variable: SavedVariable, parts: Iterable[tuple[int, int, int]]) -> list[int]:
    """Rows each table shard of ``variable`` receives from the shard parts a restore
    reads, given as ``(num_buckets, bucket, rows)``.

    Exact where the shard of a key follows from its bucket: the variable partitions with
    ``default_partition_fn`` (``floormod(hash(key), shards)``, the bucket's own hash) and
    the shard count divides ``num_buckets``, so every row of bucket ``b`` goes to shard
    ``b mod shards``. Otherwise an even split with ``RESERVE_SLACK`` headroom.
    """
    count = len(variable.shards)
    parts = list(parts)
    if not routes_by_hash(variable) or any(buckets % count for buckets, _, _ in parts):
        return even_shares(count, sum(rows for *_, rows in parts))
    shares = [0] * count
    for _, bucket, rows in parts:
        shares[bucket % count] += rows
    return shares


def even_shares(shards: int, rows: int) -> list[int]:
    """``rows`` split evenly over ``shards`` table shards, with ``RESERVE_SLACK`` headroom
    where there is more than one (keys do not spread exactly evenly)."""
    return [rows if shards == 1 else int(rows / shards * RESERVE_SLACK)] * shards


def reserve_shards(variable: SavedVariable, rows: int | Sequence[int]) -> None:
    """Grow each shard once for ``rows[i]`` rows, or for its share of ``rows`` split
    evenly (cores that can; growing step by step while inserting costs about half of a
    bulk load's time)."""
    shares = even_shares(len(variable.shards), rows) if isinstance(rows, int) else rows
    for index, share in enumerate(shares):
        reserve_shard(variable, index, share)


def reserve_shard(variable: SavedVariable, index: int, share: int) -> None:
    """Grow table shard ``index`` once for ``share`` rows, where its core can."""
    core = variable.shards[index]
    if hasattr(core, "reserve"):
        with on_device(variable.devices[index]):
            core.reserve(share)
