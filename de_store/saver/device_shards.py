"""Shards written where their table lives: a parameter server saves its own tables.

A table on another task (a ``ParameterServerStrategy`` PS) is exported into tensors that
stay on that task: the save's snapshot, :class:`DeviceShardRows`. Its shard is then
written there by TensorFlow ops, in the ``binary`` layout: the rows are grouped by key
bucket (``dynamic_partition``) and each column is saved by one ``SaveV2`` op as a bundle
whose tensors are the buckets, in order. A bundle's data file is then exactly a binary
shard file (raw little-endian rows, bucket after bucket), and its index records each
bucket's byte range and crc32c: the parts of the shard's ``ShardInfo``. The saving
process reads only the indexes (a few kB a column), renames the data files to their
binary names, deletes the indexes and fsyncs the files (TensorFlow's file ops do not).
A task that dies while it writes leaves its bundles, complete or under TensorFlow's
temporary names, in the staging folder: :func:`file_name_ends` names them for
``de-store gc``.

The task writes to the checkpoint's staging folder by its local path, so this needs
storage that is a local path the task sees as well (one machine, or a mount every task
shares, as TensorFlow's own checkpoints of parameter servers need). Elsewhere (object
stores, string keys) the rows are copied to the saving process and written by its
backend (:meth:`DeviceShardRows.to_host`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from de_store.backends.local import fsync_dir, fsync_file
from de_store.backends.location import Location
from de_store.checkpoint import names, shards
from de_store.checkpoint._tf_bundle import data_path, index_path, read_index
from de_store.checkpoint.buckets import choose_num_buckets
from de_store.checkpoint.manifest import ShardRecord
from de_store.checkpoint.names import bundle_prefix
from de_store.checkpoint.variable_rows import VALUE_COLUMN, DeviceShardRows, VariableRows
from de_store.errors import CheckpointError
from de_store.formats._shard import shard_info
from de_store.formats._stream import crc32c_combine
from de_store.formats.base import ByteRange, FileInfo, PartInfo, SchemaInfo, ShardInfo
from de_store.formats.binary import column_layout, column_paths, numpy_dtype
from de_store.saver._lazy_tf import tf

if TYPE_CHECKING:
    from de_store.backends.base import Backend

logger = logging.getLogger("de_store")


def write_shard(
    backend: Backend, rows: VariableRows, shard_index: int, *, rank: int, global_shard: int,
    **options: Any,
) -> ShardRecord:  # fmt: skip
    """:func:`de_store.checkpoint.shards.write_shard`, with rows held on another task's
    device written there when it can (always bucketed, as plain binary files: a shard
    compressed or with values at another precision is written by this process)."""
    held = rows.shards[shard_index]
    if isinstance(held, DeviceShardRows):
        tombstone = options.get("tombstone", False)
        stem = names.shard_stem(rows.name, rank, shard_index, tombstone=tombstone)
        if writes_on_device(backend, stem, held, _encoded(options, tombstone)):
            info = shards.schema_info(rows, global_shard)
            num_buckets = choose_num_buckets(held.rows)
            shard_info, part_buckets = write_on_device(backend, stem, held, info, num_buckets)
            return ShardRecord(rank=rank, shard=global_shard, info=shards.plain_dict(shard_info),
                               num_buckets=num_buckets, part_buckets=part_buckets)  # fmt: skip
    return shards.write_shard(
        backend, rows, shard_index, rank=rank, global_shard=global_shard, **options
    )


def _encoded(options: dict[str, Any], tombstone: bool) -> str | None:
    """How the shard is to be encoded beyond plain binary, in words (None: not)."""
    compression = options.get("compression", "none")
    precision = None if tombstone else options.get("value_precision")
    if compression != "none" or precision is not None:
        return f"compression {compression!r} with value_precision {precision!r}"
    return None


def writes_on_device(
    backend: Backend, path: str, rows: DeviceShardRows, encoded: str | None = None
) -> bool:
    """Whether ``rows``' device can write the shard ``path`` itself; when not, logs why
    the rows go through this process. ``encoded``: how the shard is to be encoded beyond
    plain binary (the task writes plain binary only)."""
    if encoded is not None:
        reason = f"the shard is saved with {encoded}; the task writes plain binary"
    elif backend.local_path(path) is None:
        reason = f"{backend.url} is not a local path that task can write"
    elif rows.keys.dtype == tf.string:
        reason = "binary shards hold no string keys"
    else:
        return True
    logger.info("rows on %s go through this process: %s", rows.device, reason)
    return False


def write_on_device(
    backend: Backend,
    path: str,
    rows: DeviceShardRows,
    info: SchemaInfo,
    num_buckets: int,
) -> tuple[ShardInfo, list[int]]:
    """Write ``rows`` as the binary shard ``path`` from their device, one part per
    non-empty bucket; return its ``ShardInfo`` and the bucket of each part."""
    paths = column_paths(path, info)
    local = [backend.local_path(p) or "" for p in paths]
    os.makedirs(os.path.dirname(local[0]), exist_ok=True)
    tensors = [rows.keys, rows.columns[VALUE_COLUMN], *(rows.columns[e.name] for e in info.extras)]
    prefixes = [bundle_prefix(p) for p in local]
    what = f"table shard {info.shard_id} of {info.name!r} to {Location(backend, path).url}"
    counts, lows, highs = _write_bundles(rows.device, prefixes, num_buckets, tensors, what)
    buckets = [int(b) for b in np.flatnonzero(counts)]
    entries = [_entries_of(prefix, buckets, rows.device) for prefix in prefixes]
    row_bytes = [numpy_dtype(d).itemsize * w for d, w in column_layout(info)]
    parts, start = [], 0
    for i, bucket in enumerate(buckets):
        n = int(counts[bucket])
        ranges = []
        for j, found in enumerate(entries):
            entry = found[i]
            if entry.size != n * row_bytes[j]:
                raise AssertionError(f"{prefixes[j]}: bucket {bucket} holds {entry.size} bytes, "
                                     f"expected {n} rows x {row_bytes[j]}")  # fmt: skip
            ranges.append(ByteRange(entry.offset, entry.size, entry.crc32c))
        parts.append(PartInfo(n, start, int(lows[bucket]), int(highs[bucket]), tuple(ranges)))
        start += n
    files = [
        _publish(prefix, final, p, [part.ranges[j] for part in parts])
        for j, (prefix, final, p) in enumerate(zip(prefixes, local, paths, strict=True))
    ]
    fsync_dir(os.path.dirname(local[0]))
    return shard_info("binary", path, info, parts, files), buckets


def _write_bundles(
    device: str, prefixes: list[str], num_buckets: int, tensors: list[Any], what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run :func:`_save_buckets` on ``device``; what it returns, as numpy arrays.

    Raises
    ------
    CheckpointError
        The ops failed there (the task died or cannot be reached, its disk is full ...):
        names the device and ``what`` it was writing, with TensorFlow's error as its cause.
    """
    try:
        with tf.device(device):
            found = _save_buckets(tf.constant(prefixes), num_buckets, tensors)
    except tf.errors.OpError as err:
        cause = str(err.message).split("\n", 1)[0]
        raise CheckpointError(
            f"{device} did not write {what} ({len(prefixes)} TensorFlow bundles): "
            f"{type(err).__name__}: {cause}; the save stops here and commits nothing "
            "(`de-store gc` removes what it wrote)"
        ) from err
    counts, lows, highs = (np.asarray(x) for x in found)
    return counts, lows, highs


def _entries_of(prefix: str, buckets: list[int], device: str) -> list[Any]:
    """The index entries of the ``buckets`` in the bundle ``prefix`` that ``device``
    wrote; the index is then deleted."""
    where = index_path(prefix)
    try:
        with open(where, "rb") as f:
            found = read_index(f.read(), where)
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{device} wrote its shard, but {where} is not there for this process: the "
            "checkpoint folder must be one that every task sees at the same path (a shared "
            "mount); elsewhere save with tf.train.CheckpointOptions(experimental_io_device="
            "<this process's CPU>) to write every row through this process"
        ) from err
    os.unlink(where)
    return [found[_name(b)] for b in buckets]


def _publish(prefix: str, final: str, path: str, ranges: list[ByteRange]) -> FileInfo:
    """Rename the bundle's data file to ``final`` and fsync it; its ``FileInfo``, whose
    crc32c combines those of its parts (they tile the file: checked)."""
    size = os.path.getsize(data_path(prefix))
    crc, end = 0, 0
    for r in ranges:
        if r.offset != end:
            raise AssertionError(f"{data_path(prefix)}: a gap before byte {r.offset}")
        crc, end = crc32c_combine(crc, r.crc32c, r.length), r.end
    if end != size:
        raise AssertionError(f"{data_path(prefix)}: {size} bytes, its parts cover {end}")
    os.replace(data_path(prefix), final)
    fsync_file(final)
    return FileInfo(path, size, crc)


def _name(bucket: int) -> str:
    return f"{bucket:05d}"


def _save_buckets(prefixes: Any, num_buckets: int, tensors: list[Any]) -> tuple[Any, Any, Any]:
    """Run :func:`_bucket_bundles` (one trace per bucket count, columns and dtypes)."""
    global _SAVE_BUCKETS
    if _SAVE_BUCKETS is None:
        _SAVE_BUCKETS = tf.function(_bucket_bundles)
    return _SAVE_BUCKETS(prefixes, num_buckets, tensors)


_SAVE_BUCKETS: Any = None


def _bucket_bundles(prefixes: Any, num_buckets: int, tensors: list[Any]) -> tuple[Any, Any, Any]:
    """Save column ``j`` of ``tensors`` (keys first) as the bundle ``prefixes[j]`` of its
    rows grouped by key bucket; return each bucket's row count, smallest and largest key.

    The bucket is ``floormod(key, num_buckets)``, the saver's for integer keys
    (:func:`~de_store.checkpoint.buckets.key_hash_mod`).
    """
    keys = tensors[0]
    ids = tf.cast(tf.math.floormod(tf.cast(keys, tf.int64), num_buckets), tf.int32)
    counts = tf.math.bincount(ids, minlength=num_buckets, maxlength=num_buckets, dtype=tf.int64)
    lows = tf.math.unsorted_segment_min(keys, ids, num_buckets)
    highs = tf.math.unsorted_segment_max(keys, ids, num_buckets)
    names = [_name(b) for b in range(num_buckets)]
    saves = [
        tf.raw_ops.SaveV2(
            prefix=prefixes[j],
            tensor_names=names,
            shape_and_slices=[""] * num_buckets,
            tensors=tf.dynamic_partition(column, ids, num_buckets),
        )
        for j, column in enumerate(tensors)
    ]
    # SaveV2 is not a stateful op: a function runs it only when an output waits for it
    with tf.control_dependencies(saves):
        return tuple(tf.identity(x) for x in (counts, lows, highs))
