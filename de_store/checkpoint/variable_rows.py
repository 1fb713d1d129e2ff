"""A variable's rows as numpy arrays: what a save writes and a restore reads.

A :class:`VariableRows` holds, per table shard, the keys and every per-key column: the
``value`` rows and the companions' rows (optimizer slots, restrict status) for the same keys.
A delta holds only the rows changed since a mark, and the keys removed since, on a
:class:`ChangeBase`.

This module needs numpy only, so the shard writers and readers, ``compact`` and ``convert``
use it without TensorFlow; :mod:`de_store.saver.rows` moves these rows into and out of
Variables.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from de_store.checkpoint.manifest import ColumnSpec

VALUE_COLUMN = "value"
#: Byte alignment TensorFlow's CPU kernels require of a tensor's buffer.
TF_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class ChangeBase:
    """A variable's last committed checkpoint: what its next delta applies on.

    Attributes
    ----------
    url: the checkpoint's URL (``backend.url/name``).
    mark: this process's snapshot mark of that save: its delta holds what changed after.
    created: the checkpoint manifest's ``created`` (a rewrite of ``url`` changes it).
    chain_length: links of the checkpoint's chain for this variable (1: a full save).
    full_bytes: bytes of the chain's full entry of this variable.
    delta_bytes: bytes of the chain's delta entries of this variable so far.
    columns: the saved columns; a variable with other columns now saves full.
    previous: the last base before it in another location (say the checkpoint before a
        SavedModel export): a later save beside ``previous`` is a delta on it.
    """

    url: str
    mark: int
    created: float
    chain_length: int
    full_bytes: int
    delta_bytes: int
    columns: dict[str, ColumnSpec]
    previous: ChangeBase | None = None

    def candidates(self) -> list[ChangeBase]:
        """This base and the previous one, if any: what the next delta may apply on."""
        return [self] if self.previous is None else [self, self.previous]


@dataclasses.dataclass
class ShardRows:
    """The rows of one table shard: ``keys [n]`` and ``columns[name] [n, dim]``."""

    keys: np.ndarray
    columns: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return len(self.keys)

    def take(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` of column ``name``, gathered into a new array."""
        # np.take copies each row as one block: faster than fancy indexing's general
        # machinery (docs/benchmarks.md, Costs behind the code)
        return np.take(self.columns[name], index, axis=0)


@dataclasses.dataclass(frozen=True)
class RowsOf:
    """A column given as rows of a larger array: row ``i`` is ``store[rows[i]]``.

    A table's snapshot gives its values so (its row store, and the row of each key): a
    writer that groups the rows by bucket gathers each value once, from the store, instead
    of into key order first and into bucket order again.
    """

    store: np.ndarray
    rows: np.ndarray


@dataclasses.dataclass
class SnapshotRows:
    """The rows of one table shard as a snapshot reads them, for a writer: ``keys [n]``
    and per column its rows in key order or :class:`RowsOf` the table's row store."""

    keys: np.ndarray
    columns: dict[str, np.ndarray | RowsOf]

    @property
    def rows(self) -> int:
        return len(self.keys)

    def take(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` of column ``name``, gathered into a new array."""
        column = self.columns[name]
        if isinstance(column, RowsOf):
            return np.take(column.store, np.take(column.rows, index), axis=0)
        return np.take(column, index, axis=0)


@dataclasses.dataclass(frozen=True)
class PendingShardRows:
    """The rows of one table shard, held as a snapshot and read by ``read()`` when the
    shard is written: an async save takes the snapshot while training waits and reads
    the rows in the background."""

    rows: int
    read: Callable[[], ShardRows | SnapshotRows]
    #: The rows in the order the table holds them, its values a view of its row store,
    #: when its live rows are its first ones (None then otherwise); None where the table
    #: does not offer it. For a writer that keeps the table's order.
    read_in_store_order: Callable[[], ShardRows | None] | None = None


@dataclasses.dataclass
class DeviceShardRows:
    """The rows of one table shard, held on the device ``device`` of another task.

    ``keys [n]`` and ``columns[name] [n, dim]`` are eager tensors living there (this
    process holds handles, not rows); :mod:`de_store.saver.device_shards` writes them
    there.
    """

    device: str
    keys: Any
    columns: dict[str, Any]

    @property
    def rows(self) -> int:
        return int(self.keys.shape[0])

    def to_host(self) -> ShardRows:
        """The rows copied into this process."""
        return ShardRows(np.asarray(self.keys), {n: np.asarray(c) for n, c in self.columns.items()})


@dataclasses.dataclass
class VariableRows:
    """A variable's rows over its local shards, with the dtypes and columns to save."""

    name: str
    key_dtype: str
    value_dtype: str
    dim: int
    columns: dict[str, ColumnSpec]
    #: Per shard its rows; a shard on another task may stay there (``DeviceShardRows``).
    shards: Sequence[ShardRows | PendingShardRows | DeviceShardRows]
    #: A delta: per shard, the keys removed since ``base``; None for a full save.
    removed: list[np.ndarray] | None = None
    #: The snapshot mark (``Variable.next_change_epoch``) when the variable tracks changes
    #: for incremental saves: what the next delta is taken since, once this one commits.
    mark: int | None = None
    #: A delta's base: the committed checkpoint it applies on.
    base: ChangeBase | None = None

    @property
    def incremental(self) -> bool:
        return self.removed is not None

    @property
    def rows(self) -> int:
        """Rows to write, tombstones included."""
        removed = sum(len(keys) for keys in self.removed or [])
        return sum(shard.rows for shard in self.shards) + removed


def coalesce(batches: Iterable[ShardRows], rows: int) -> Iterator[ShardRows]:
    """The rows of ``batches``, in order, regrouped into batches of about ``rows`` rows.

    A restore reads one small part per key bucket; each upsert has a fixed cost, so the
    parts are concatenated into few large upserts. Empty batches are dropped.
    """
    pending: list[ShardRows] = []
    held = 0
    for batch in batches:
        if not batch.rows:
            continue
        pending.append(batch)
        held += batch.rows
        if held >= rows:
            yield _concat(pending)
            pending, held = [], 0
    if pending:
        yield _concat(pending)


def even_batches(batches: Iterable[ShardRows], total: int, most: int) -> Iterator[ShardRows]:
    """The ``total`` rows of ``batches``, in order, regrouped into ``ceil(total / most)``
    batches whose sizes differ by one at most.

    A bulk load compiles its first probe rounds for each batch size class (a restore's
    last, shorter batch would compile once more): equal batches share one.
    """
    regrouped = EvenBatches(total, most)
    for batch in batches:
        yield from regrouped.add(batch)
    yield from regrouped.finish()


class EvenBatches:
    """:func:`even_batches` fed one batch at a time: :meth:`add` returns the batches
    completed, :meth:`finish` the rest (rows beyond ``total`` go in batches of ``most``)."""

    def __init__(self, total: int, most: int) -> None:
        self._sizes = iter(even_sizes(total, most))
        self._most = most
        self._pending: list[ShardRows] = []
        self._held = 0
        self._wanted = next(self._sizes)
        self._buffers = ReusedBuffers()

    def add(self, batch: ShardRows) -> list[ShardRows]:
        done = []
        start = 0
        while start < batch.rows:
            take = min(self._wanted - self._held, batch.rows - start)
            self._pending.append(_slice(batch, start, start + take))
            self._held, start = self._held + take, start + take
            if self._held == self._wanted:
                done.append(_concat(self._pending, self._buffers.empty))
                self._pending, self._held = [], 0
                self._wanted = next(self._sizes, self._most)
        return done

    def finish(self) -> list[ShardRows]:
        done = [_concat(self._pending, self._buffers.empty)] if self._pending else []
        self._pending, self._held = [], 0
        return done


def even_sizes(total: int, most: int) -> list[int]:
    """The sizes of the batches :func:`even_batches` makes of ``total`` rows, largest
    first: ``ceil(total / most)`` of them, differing by one at most."""
    count = max(-(-total // most), 1)
    return [total // count + (i < total % count) for i in range(count)]


def rows_where(rows: ShardRows, keep: np.ndarray) -> ShardRows:
    """The rows of ``rows`` that the boolean mask ``keep`` selects, every column alike."""
    return ShardRows(rows.keys[keep], {n: c[keep] for n, c in rows.columns.items()})


def _slice(batch: ShardRows, start: int, end: int) -> ShardRows:
    if (start, end) == (0, batch.rows):
        return batch
    columns = {name: column[start:end] for name, column in batch.columns.items()}
    return ShardRows(batch.keys[start:end], columns)


def _concat(batches: list[ShardRows], empty: Callable[..., np.ndarray] | None = None) -> ShardRows:
    if len(batches) == 1:
        return batches[0]
    empty = empty or aligned_empty
    keys = _aligned_concat([b.keys for b in batches], empty)
    columns = {
        n: _aligned_concat([b.columns[n] for b in batches], empty) for n in batches[0].columns
    }
    return ShardRows(keys, columns)


def _aligned_concat(arrays: list[np.ndarray], empty: Callable[..., np.ndarray]) -> np.ndarray:
    """``numpy.concatenate`` into a buffer aligned to :data:`TF_ALIGNMENT` bytes (from
    ``empty``, :func:`aligned_empty` or :meth:`ReusedBuffers.empty`), so that TensorFlow
    can take it over without a copy (see ``rows.to_tensor``)."""
    out = empty((sum(len(a) for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
    return np.concatenate(arrays, out=out)


class ReusedBuffers:
    """:func:`aligned_empty` that hands out again a buffer it made once nothing else holds
    it, rather than new memory each time.

    A restore joins its parts into load batches of up to 16 MiB of values
    (:class:`EvenBatches`), each loaded, then dropped. New memory costs its first touch
    (docs/benchmarks.md, *Memory state*), and glibc gives buffers this big back to the
    system when they are freed: every batch would pay it again. A buffer is free when no
    array made from it is alive anywhere (a batch still queued, a tensor TensorFlow took
    over through DLPack: each holds it), which its reference count tells; the smallest
    free one that fits is taken, unless it is more than twice the size asked for. At most
    :attr:`MOST` buffers are kept; beyond them new ones are made and not kept.
    """

    MOST = 64

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtype.kind == "O":
            return np.empty(shape, dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        wanted = nbytes + TF_ALIGNMENT
        free = [b for b in self._buffers if _free(b, wanted)]
        raw = min(free, key=len, default=None)
        if raw is None or len(raw) > 2 * wanted:
            raw = np.empty(nbytes + TF_ALIGNMENT, np.uint8)
            if len(self._buffers) < self.MOST:
                self._buffers.append(raw)
        return _aligned_view(raw, shape, dtype, nbytes)


def _free(buffer: np.ndarray, nbytes: int) -> bool:
    """Whether ``buffer`` holds ``nbytes`` and nothing but its :class:`ReusedBuffers`
    holds it (references: that list, the comprehension's name, this call's argument, and
    ``getrefcount``'s own)."""
    return buffer.nbytes >= nbytes and sys.getrefcount(buffer) <= 4


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array aligned to :data:`TF_ALIGNMENT` bytes (object arrays as
    numpy makes them)."""
    if dtype.kind == "O":
        return np.empty(shape, dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return _aligned_view(np.empty(nbytes + TF_ALIGNMENT, np.uint8), shape, dtype, nbytes)


def _aligned_view(
    raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, nbytes: int
) -> np.ndarray:
    start = -raw.ctypes.data % TF_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class LoadBatch:
    """A load batch of ``size`` rows of one table shard, filled in place: each
    :meth:`take` gathers rows of a batch read straight into it."""

    def __init__(self, size: int, like: ShardRows) -> None:
        self.size = size
        self.filled = 0
        self.keys = aligned_empty((size,), like.keys.dtype)
        self.columns = {
            name: aligned_empty((size, *column.shape[1:]), column.dtype)
            for name, column in like.columns.items()
        }

    def take(self, batch: ShardRows, index: np.ndarray) -> int:
        """Gather as many rows ``index`` of ``batch`` as there is room for; return how many."""
        count = min(len(index), self.size - self.filled)
        part, end = index[:count], self.filled + count
        # mode="clip": numpy gathers straight into ``out`` (the default mode buffers)
        np.take(batch.keys, part, out=self.keys[self.filled : end], mode="clip")
        for name, column in batch.columns.items():
            np.take(column, part, axis=0, out=self.columns[name][self.filled : end], mode="clip")
        self.filled = end
        return count

    def rows(self) -> ShardRows:
        """The rows filled so far."""
        columns = {name: column[: self.filled] for name, column in self.columns.items()}
        return ShardRows(self.keys[: self.filled], columns)
