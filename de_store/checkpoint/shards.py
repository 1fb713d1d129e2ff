"""Shard files: rows in table order or grouped by key bucket on write; only the needed
buckets on read.

A bucketed shard writes each bucket (see :mod:`de_store.checkpoint.buckets`) as its own
part(s); a shard in table order is one bucket, its rows as the table holds them. The
manifest records the bucket of every part. A delta's removed keys are written the same way
as tombstone shards (:func:`tombstone_rows`), so a restoring rank reads only its buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from de_store.backends.base import Backend
from de_store.checkpoint import names
from de_store.checkpoint.buckets import BucketOrder, choose_num_buckets
from de_store.checkpoint.checks import read_checked
from de_store.checkpoint.manifest import ColumnSpec, ShardRecord, VariableEntry
from de_store.checkpoint.variable_rows import (
    VALUE_COLUMN,
    DeviceShardRows,
    PendingShardRows,
    ShardRows,
    SnapshotRows,
    VariableRows,
    rows_where,
)
from de_store.errors import CheckpointCorruptError
from de_store.formats import precision as value_precisions
from de_store.formats._shard import map_ahead
from de_store.formats.base import ExtraColumn, SchemaInfo, part_rows
from de_store.formats.batches import batch_from_numpy
from de_store.formats.registry import compressed_format

#: The value column of a tombstone shard: formats need one; it holds zeros.
TOMBSTONE_COLUMN = ColumnSpec("int64", 1)


def schema_info(rows: VariableRows, shard_id: int, precision: str | None = None) -> SchemaInfo:
    """The schema of a shard of ``rows``, its values stored at ``precision`` (None: at
    their own dtype), with int8's scale column right after ``value``."""
    extras = value_precisions.scale_columns(precision) + tuple(
        ExtraColumn(name, spec.dtype, spec.dim)
        for name, spec in rows.columns.items()
        if name != VALUE_COLUMN
    )
    return SchemaInfo(
        name=rows.name,
        dim=rows.dim,
        key_dtype=rows.key_dtype,
        value_dtype=rows.value_dtype
        if precision is None
        else value_precisions.stored_dtype(precision),
        shard_id=shard_id,
        extras=extras,
    )


#: Builds a shard's batch from its keys, values and extra columns.
BatchMaker = Callable[[np.ndarray, np.ndarray, Mapping[str, np.ndarray]], pa.RecordBatch]


def batch_maker(schema: pa.Schema, precision: str | None, variable: str) -> BatchMaker:
    """What builds a shard's batches of ``schema``: the values stored at ``precision``
    (see :mod:`de_store.formats.precision`; None: as they are)."""
    if precision is None:
        return functools.partial(_plain_batch, schema)
    return functools.partial(_encoded_batch, schema, precision, variable)


def _plain_batch(
    schema: pa.Schema, keys: np.ndarray, values: np.ndarray, extras: Mapping[str, np.ndarray]
) -> pa.RecordBatch:
    return batch_from_numpy(keys, values, extras, schema=schema)


def _encoded_batch(
    schema: pa.Schema,
    precision: str,
    variable: str,
    keys: np.ndarray,
    values: np.ndarray,
    extras: Mapping[str, np.ndarray],
) -> pa.RecordBatch:
    stored, beside = value_precisions.encode(values, precision, keys, variable)
    return batch_from_numpy(keys, stored, {**beside, **extras}, schema=schema)


#: Rows gathered into bucket order at a time: whole buckets, about this many rows.
GATHER_ROWS = 1 << 15
#: Chunks gathered ahead of the one being written, each in its own thread.
GATHER_AHEAD = 2


def _bucketed_batches(
    shard: ShardRows | SnapshotRows,
    key_dtype: str,
    make: BatchMaker,
    buffer_size: int,
    out: list[int],
) -> Iterator[pa.RecordBatch]:
    """Batches of one bucket each, at most ``buffer_size`` rows; ``out`` gets their buckets.

    Rows are gathered into bucket order a chunk of whole buckets at a time (one ``take``
    per column and chunk, the next two chunks in helper threads while this one is
    written), so the shard is never copied whole; each part is a zero-copy slice of its
    chunk.
    """
    order = BucketOrder(shard.keys, key_dtype)
    chunks = order.chunks(GATHER_ROWS)

    def gather(chunk: tuple[int, int]) -> pa.RecordBatch:
        index = order.rows(*chunk)
        columns = {name: shard.take(name, index) for name in shard.columns}
        values = columns.pop(VALUE_COLUMN)
        return make(np.take(shard.keys, index), values, columns)

    # The next chunks are gathered (numpy's take releases the GIL) while this one is
    # written: two threads, as a chunk's gather takes longer than its write.
    gathered = map_ahead(gather, chunks, depth=GATHER_AHEAD, name="gather")
    for (first, last), batch in zip(chunks, gathered, strict=True):
        base = order.start(first)
        for bucket in range(first, last):
            start, end = order.start(bucket) - base, int(order.ends[bucket]) - base
            for at in range(start, end, buffer_size):
                out.append(bucket)
                yield batch.slice(at, min(buffer_size, end - at))


def _table_order_batches(
    shard: ShardRows | SnapshotRows,
    make: BatchMaker,
    buffer_size: int,
    out: list[int],
    encoded: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Batches of at most ``buffer_size`` rows in the order ``shard`` holds them, each
    of the shard's one bucket (``out`` gets a 0 a batch): slices of its arrays (zero-copy;
    a table snapshot read in store order is the row store itself), or, for values given
    as rows of the store, gathered a chunk at a time in helper threads.

    ``encoded``: ``make`` stores the values at another precision, a conversion of every
    value, made for the next batches in helper threads while this one is written (numpy
    lets go of the interpreter lock while it converts)."""
    keys, columns = shard.keys, dict(shard.columns)
    values = columns.pop(VALUE_COLUMN)
    arrays = {name: c for name, c in columns.items() if isinstance(c, np.ndarray)}
    if isinstance(values, np.ndarray) and len(arrays) == len(columns):

        def piece(at: int) -> pa.RecordBatch:
            end = at + buffer_size
            extras = {name: c[at:end] for name, c in arrays.items()}
            return make(keys[at:end], values[at:end], extras)

        starts = range(0, len(keys), buffer_size)
        pieces = map_ahead(piece, starts, GATHER_AHEAD, "encode") if encoded else map(piece, starts)
        for batch in pieces:
            out.append(0)
            yield batch
        return

    def gather(at: int) -> pa.RecordBatch:
        index = np.arange(at, min(at + GATHER_ROWS, len(keys)))
        extras = {name: shard.take(name, index) for name in columns}
        return make(keys[index], shard.take(VALUE_COLUMN, index), extras)

    starts = range(0, len(keys), GATHER_ROWS)
    for batch in map_ahead(gather, starts, depth=GATHER_AHEAD, name="gather"):
        for at in range(0, batch.num_rows, buffer_size):
            out.append(0)
            yield batch.slice(at, buffer_size)


def _read(
    held: ShardRows | PendingShardRows | DeviceShardRows, bucketed: bool
) -> ShardRows | SnapshotRows | DeviceShardRows:
    """The rows of a held shard: a snapshot is read now, in the order its table holds
    them where it can and the writer keeps that order."""
    if not isinstance(held, PendingShardRows):
        return held
    if not bucketed and held.read_in_store_order is not None:
        in_order = held.read_in_store_order()
        if in_order is not None:
            return in_order
    return held.read()


def _string_keys(keys: np.ndarray) -> np.ndarray:
    if keys.dtype == object and len(keys) and isinstance(keys[0], bytes):
        return np.asarray(pa.array(keys, pa.binary()).cast(pa.string()).to_numpy(False))
    return keys


def write_shard(
    backend: Backend,
    rows: VariableRows,
    shard_index: int,
    *,
    rank: int,
    global_shard: int,
    format_name: str,
    buffer_size: int | None,
    bucketed: bool = True,
    tombstone: bool = False,
    compression: str = "none",
    compression_level: int | None = None,
    value_precision: str | None = None,
) -> ShardRecord:
    """Write one table shard as one file of parts; return its record.

    ``bucketed``: the rows are grouped by key bucket (:mod:`~de_store.checkpoint.buckets`), a
    bucket per part, so that each of several restoring processes reads only its share;
    otherwise the shard is one bucket, its rows in the order the table holds them (no
    sort and no gather: the fastest save; every restoring process reads every part).
    ``buffer_size``: rows per part; None: :func:`~de_store.formats.base.part_rows` of
    the shard's schema (parts of about 16 MiB).
    ``tombstone``: the rows are a delta's removed keys (a tombstone shard). Rows held on
    another task's device are brought here first (the saver writes them on that device
    when it can: :func:`de_store.saver.device_shards.write_shard`). ``compression`` (with
    ``compression_level``) is the format's codec; ``value_precision`` the precision the
    ``value`` column is stored at (:mod:`de_store.formats.precision`; tombstones are
    always exact).

    Raises
    ------
    ValueError
        The format has no such codec, the variable's values cannot be stored at
        ``value_precision``, or a row holds a value that precision cannot.
    """
    precision = None if tombstone else value_precision
    value_precisions.check_precision(precision, rows.value_dtype, rows.name)
    fmt = compressed_format(format_name, compression, compression_level)
    shard = _read(rows.shards[shard_index], bucketed)
    info = schema_info(rows, global_shard, precision)
    stem = names.shard_stem(rows.name, rank, shard_index, tombstone=tombstone)
    if isinstance(shard, DeviceShardRows):
        shard = shard.to_host()
    if rows.key_dtype == "string":
        shard = dataclasses.replace(shard, keys=_string_keys(shard.keys))
    path = stem + fmt.suffix
    if buffer_size is None:
        buffer_size = part_rows(info)
    part_buckets: list[int] = []
    num_buckets = choose_num_buckets(shard.rows) if bucketed else 1
    make = batch_maker(info.arrow_schema(), precision, rows.name)
    if num_buckets == 1:
        encoded = precision is not None
        batches = _table_order_batches(shard, make, buffer_size, part_buckets, encoded)
    else:
        batches = _bucketed_batches(shard, rows.key_dtype, make, buffer_size, part_buckets)
    shard_info = fmt.write(backend, path, batches, schema_info=info, buffer_size=buffer_size)
    if len(part_buckets) != len(shard_info.parts):
        raise AssertionError(f"{path}: {len(shard_info.parts)} parts, {len(part_buckets)} batches")
    return ShardRecord(
        rank=rank,
        shard=global_shard,
        info=plain_dict(shard_info),
        num_buckets=num_buckets,
        part_buckets=part_buckets,
        value_precision=precision,
    )


def plain_dict(value: Any) -> Any:
    """``dataclasses.asdict`` of a record of plain values (what ``ShardInfo.to_dict``
    returns), without its deep copies: a shard of 5040 parts has about 20,000 records."""
    fields = _FIELDS.get(type(value))
    if fields is None:
        fields = _FIELDS[type(value)] = _field_names(type(value))
    if fields:
        return {name: plain_dict(getattr(value, name)) for name in fields}
    if isinstance(value, tuple | list):
        return type(value)(plain_dict(item) for item in value)
    if isinstance(value, dict):
        return {key: plain_dict(item) for key, item in value.items()}
    return value


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """The field names of a dataclass, none for other types."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def tombstone_rows(rows: VariableRows) -> VariableRows:
    """The removed keys of a delta as rows of their own (one zero int64 per key)."""
    shards = [
        ShardRows(keys, {VALUE_COLUMN: np.zeros((len(keys), 1), np.int64)})
        for keys in rows.removed or []
    ]
    return VariableRows(rows.name, rows.key_dtype, TOMBSTONE_COLUMN.dtype, TOMBSTONE_COLUMN.dim,
                        {VALUE_COLUMN: TOMBSTONE_COLUMN}, shards)  # fmt: skip


def entry_for(
    rows: VariableRows,
    records: list[ShardRecord],
    format_name: str,
    removed: list[ShardRecord] | None = None,
    *,
    compression: str = "none",
    compression_level: int | None = None,
    value_precision: str | None = None,
) -> VariableEntry:
    """The manifest entry of ``rows`` written as ``records`` (and tombstone shards
    ``removed``) in ``format_name``, with the codec and value precision they were written
    with, and the columns as stored where they differ from the variable's."""
    stored: dict[str, ColumnSpec] = {}
    if value_precision is not None:
        stored[VALUE_COLUMN] = ColumnSpec(value_precisions.stored_dtype(value_precision), rows.dim)
        stored.update(
            (c.name, ColumnSpec(c.dtype, c.width or 1))
            for c in value_precisions.scale_columns(value_precision)
        )
    return VariableEntry(
        name=rows.name,
        key_dtype=rows.key_dtype,
        value_dtype=rows.value_dtype,
        dim=rows.dim,
        columns=dict(rows.columns),
        format=format_name,
        shard_count=len(records),
        shards=records,
        incremental=rows.incremental,
        removed=list(removed or []),
        compression=compression,
        compression_level=compression_level if compression != "none" else None,
        value_precision=value_precision,
        stored_columns=stored,
    )


# --- reading ----------------------------------------------------------------------------
def parts_for_rank(record: ShardRecord, proc_rank: int, proc_size: int) -> list[int]:
    """Indices of the parts of ``record`` that may hold keys of rank ``proc_rank``."""
    step = math.gcd(record.num_buckets, proc_size)
    wanted = proc_rank % step
    return [i for i, b in enumerate(record.part_buckets) if b % step == wanted]


def bucket_rows(record: ShardRecord, proc_rank: int, proc_size: int) -> list[tuple[int, int, int]]:
    """``(num_buckets, bucket, rows)`` of each part of ``record`` that rank ``proc_rank``
    reads (its keys and, where buckets are shared between ranks, others')."""
    parts = record.info["parts"]
    return [
        (record.num_buckets, record.part_buckets[i], int(parts[i]["rows"]))
        for i in parts_for_rank(record, proc_rank, proc_size)
    ]


def read_shard_rows(
    folder: Backend,
    record: ShardRecord,
    parts: list[int],
    *,
    buffer_size: int,
    key_dtype: str | None = None,
    proc_rank: int = 0,
    proc_size: int = 1,
) -> Iterator[ShardRows]:
    """Read ``parts`` of one shard file under ``folder`` as numpy rows, checked as they come
    (see :func:`~de_store.checkpoint.checks.read_checked`). With ``proc_size`` > 1 only the rows
    of rank ``proc_rank`` are returned. ``key_dtype`` defaults to the shard's own.

    Raises
    ------
    CheckpointCorruptError
        A check failed, or the file cannot be read as its record describes; the message
        names the file.
    """
    for keys, values, extras, ranks in read_checked(
        folder, record, parts, buffer_size=buffer_size, key_dtype=key_dtype, proc_size=proc_size
    ):
        if record.value_precision is not None:
            values, extras = _decoded(record, values, extras)
        rows = ShardRows(keys, {VALUE_COLUMN: values, **extras})
        yield rows if ranks is None else rows_where(rows, ranks == proc_rank)


def _decoded(
    record: ShardRecord, values: np.ndarray, extras: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A shard's stored values back at float32 (its record says their precision)."""
    precision = str(record.value_precision)
    if precision not in value_precisions.PRECISIONS:
        raise CheckpointCorruptError(
            f"{record.path}: values stored at value_precision {precision!r}, which this "
            f"de_store does not read (it reads {list(value_precisions.PRECISIONS)})"
        )
    return value_precisions.decode(values, extras, precision)
