"""Restores read where the tables live: each parameter server reads its own rows.

A restore into a Variable whose table shards live on other tasks (the PS tasks of a
``ParameterServerStrategy``) has those tasks read the checkpoint's binary shard files
with TensorFlow ops placed on them. The rows go from the storage to the task that holds
them; this process (the chief) reads the manifest and the files' sizes, writes a few kB
of bundle indexes and receives counts. The steps, each one call away:

- :func:`plan_for`: whether the tasks can read the variable's entry (else why not, one
  INFO line), and :func:`plan_entry`: which task reads which parts. A shard file's parts
  are grouped into runs, contiguous parts that one task reads as one tensor per column.
  Where the table shard count ``n`` divides a shard's ``num_buckets``, every row of bucket
  ``b`` belongs to table shard ``b mod n`` (``default_partition_fn`` is ``floormod(key,
  n)``, the bucket's own hash): that shard's task reads the part. Otherwise (2 PS tasks
  saved, 3 restore; a one-process save of one bucket) the task of table shard ``shard
  mod n`` reads the whole file, which in a restore into as many tasks as saved it holds
  only that task's rows, and sends each other task its rows, task to task.
- :func:`read_on_devices`: this process writes, in a temporary folder ``.restore-*`` of
  the checkpoint folder, one TensorFlow bundle index per shard file (each run's dtype,
  shape, byte range and crc32c, from the manifest) beside a symlink to the file, as the
  bundle's data file. ``RestoreV2`` on the reading task reads each run and checks its
  bytes against that crc32c. The task then checks that every key lies in its part's
  bucket (:class:`~de_store.checkpoint.checks.PartBuckets`' check), and each table shard's
  rows are concatenated on its task. The temporary folder is removed.
- :mod:`~de_store.saver.device_load` checks that no key is held twice and loads the
  rows, each task its own.

This needs storage that is a local path every task sees at the same path, as the save
written on the devices does (:mod:`~de_store.saver.device_shards`), and a checkpoint
folder this process can write the indexes in. Anything else is read through this
process: object stores, a read-only folder, shards that are not ``binary`` (parquet,
arrow, string keys), incremental chains, an IO device set
(``CheckpointOptions(experimental_io_device=...)``), a partitioner other than
``default_partition_fn``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from de_store.backends import Location
from de_store.checkpoint import names
from de_store.checkpoint._tf_bundle import TensorEntry, data_path, index_bytes, index_path
from de_store.checkpoint.manifest import ShardRecord, VariableEntry
from de_store.checkpoint.variable_rows import VALUE_COLUMN
from de_store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ChecksumError,
    FormatError,
)
from de_store.formats._stream import check_crc_value, crc32c_combine
from de_store.formats.base import ShardInfo, location
from de_store.formats.binary import column_layout
from de_store.progress import Progress
from de_store.saver._lazy_tf import on_device, tf
from de_store.saver.rows import SavedVariable, io_device, routes_by_hash

if TYPE_CHECKING:
    from de_store.backends.base import Backend

logger = logging.getLogger("de_store")

T = TypeVar("T")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Run:
    """Parts ``first`` to ``last - 1`` of the shard file ``record`` (its index in the
    entry's shards), contiguous in each of its files, that the task of table shard
    ``reader`` reads as one tensor per column. ``target``: the table shard every row of
    them belongs to; None when they hold rows of several (the reader sends each its own).
    """

    record: int
    first: int
    last: int
    reader: int
    target: int | None

    @property
    def name(self) -> str:
        """Its tensors' name in the bundle indexes."""
        return f"{self.first:08d}"


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What the tasks of a variable's table shards (``devices``) read of its checkpoint
    entry, whose shard files (``infos``, checked by ``check_link``) are in ``folder``."""

    folder: Backend
    entry: VariableEntry
    infos: tuple[ShardInfo, ...]
    devices: tuple[str, ...]
    runs: tuple[Run, ...]

    def groups(self) -> dict[tuple[int, int], list[Run]]:
        """The runs by ``(reader, record)``: what one task reads of one file."""
        found: dict[tuple[int, int], list[Run]] = {}
        for run in self.runs:
            found.setdefault((run.reader, run.record), []).append(run)
        return found


@dataclasses.dataclass
class Piece:
    """Rows of one shard file for one table shard, that the task of table shard
    ``reader`` read: tensors on that task."""

    path: str
    keys: Any
    columns: dict[str, Any]
    rows: int
    reader: int


@dataclasses.dataclass
class HeldShard:
    """The rows of one table shard, held on its task (``keys`` None when there are none),
    and the shard file of each stretch of them in order, as ``(path, rows)``."""

    keys: Any
    columns: dict[str, Any]
    rows: int
    sources: list[tuple[str, int]]


@dataclasses.dataclass
class DeviceRows:
    """A variable's rows read by :func:`read_on_devices`: per table shard, on its task."""

    plan: DevicePlan
    shards: list[HeldShard]

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)


# --- plan ---------------------------------------------------------------------------------
def plan_for(
    variable: SavedVariable, chain: Sequence[tuple[str, Any, VariableEntry]], backend: Backend,
    proc_size: int,
) -> DevicePlan | None:  # fmt: skip
    """How the tasks of ``variable``'s table shards read its rows of ``chain`` (links
    ``(folder, manifest, entry)`` under ``backend``, checked by ``check_link``); None
    where its tables live in this process, or where the rows go through this process
    (one INFO line then says why)."""
    devices = tuple(variable.devices)
    if not devices or not all(map(_is_remote, devices)):
        return None
    reason = _through_this_process(variable, chain, backend, proc_size)
    if reason is not None:
        logger.info("rows for %s are read through this process: %s", ", ".join(devices), reason)
        return None
    folder, _, entry = chain[0]
    return plan_entry(backend.sub(folder), entry, devices)


def _is_remote(device: str) -> bool:
    from de_store.tables._placement import in_remote_scope  # imports TensorFlow

    with tf.device(device):
        return in_remote_scope()


def _through_this_process(
    variable: SavedVariable, chain: Sequence[tuple[str, Any, VariableEntry]], backend: Backend,
    proc_size: int,
) -> str | None:  # fmt: skip
    """Why the tasks of ``variable`` cannot read ``chain`` themselves (None: they can)."""
    folder, _, entry = chain[0]
    where = Location(backend, folder).url
    local = backend.local_path(folder)
    if io_device() is not None:
        return f"experimental_io_device {io_device()!r} is set"
    if local is None:
        return f"{backend.url} is not a local path those tasks can read"
    if proc_size > 1:
        return f"{proc_size} processes restore it, each its share of the keys"
    if len(chain) > 1 or entry.removed:
        return f"{where} is incremental (a chain of {len(chain)} checkpoints)"
    if entry.key_dtype == "string":
        return "binary shards hold no string keys"
    if entry.value_precision is not None:
        return (f"{where} stores values at {entry.value_precision}; the tasks read them at "
                "the variable's dtype only")  # fmt: skip
    for record in entry.shards:
        if record.info["format"] != "binary":
            return f"shard {record.path} is {record.info['format']}, the tasks read binary only"
    if len(devices := variable.devices) > 1 and not routes_by_hash(variable):
        return (f"its partitioner is not default_partition_fn (the tasks send a row to "
                f"table shard floormod(key, {len(devices)}))")  # fmt: skip
    if not os.access(local, os.W_OK):
        return f"{where} is not writable (the tasks read through bundle indexes written there)"
    return None


def plan_entry(folder: Backend, entry: VariableEntry, devices: Sequence[str]) -> DevicePlan:
    """The runs the tasks of table shards on ``devices`` read of ``entry``'s binary shard
    files, under ``folder`` (see the module's docstring)."""
    infos = tuple(ShardInfo.from_dict(record.info) for record in entry.shards)
    runs: list[Run] = []
    for index, (record, info) in enumerate(zip(entry.shards, infos, strict=True)):
        spread = record.num_buckets % len(devices) != 0
        for i, bucket in enumerate(record.part_buckets):
            target = None if spread else bucket % len(devices)
            reader = record.shard % len(devices) if target is None else target
            last = runs[-1] if runs else None
            if last and last.record == index and (last.reader, last.target) == (reader, target) \
                    and _follows(info, i):  # fmt: skip
                runs[-1] = dataclasses.replace(last, last=i + 1)
            else:
                runs.append(Run(index, i, i + 1, reader, target))
    return DevicePlan(folder, entry, infos, tuple(devices), tuple(runs))


def _follows(info: ShardInfo, part: int) -> bool:
    """Whether part ``part`` starts where the part before it ends, in every file."""
    before, ranges = info.parts[part - 1].ranges, info.parts[part].ranges
    return all(a.end == b.offset for a, b in zip(before, ranges, strict=True))


# --- read ---------------------------------------------------------------------------------
def read_on_devices(plan: DevicePlan, bar: Progress | None = None) -> DeviceRows:
    """Every row of ``plan``, read and checked on the tasks (see the module's docstring).

    Raises
    ------
    ChecksumError
        A byte read differs from what its crc32c says; names the file and its parts.
    CheckpointCorruptError
        A part holds keys of another bucket than its record says; names the file.
    CheckpointError
        A task could not read a file (the folder is not shared with it, it died ...).
    """
    start = time.perf_counter()
    _check_file_crcs(plan)
    where = tempfile.mkdtemp(prefix=names.RESTORE_SCRATCH_PREFIX, dir=plan.folder.local_path(""))
    try:
        try:
            prefixes = _write_indexes(plan, where)
        except OSError as err:  # say a filesystem without symlinks
            raise CheckpointError(f"cannot write the bundle indexes the tasks read the shard "
                                  f"files through in {where}: {err}") from err  # fmt: skip
        groups = plan.groups()
        found = each(lambda key: _read_group(plan, *key, groups[key], prefixes), list(groups))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    pieces: list[list[Piece]] = [[] for _ in plan.devices]
    for group in found:
        for target, piece in group:
            pieces[target].append(piece)
    moved = sum(p.rows for t, ps in enumerate(pieces) for p in ps if p.reader != t)
    shards = each(lambda t: _gather(plan, t, pieces[t]), list(range(len(plan.devices))))
    rows = DeviceRows(plan, shards)
    if bar is not None:
        bar.update(rows.rows)
    logger.info(
        "read %s rows of %r (%s of shards) on %s in %.2f s, %s of them sent task to task",
        f"{rows.rows:,}", plan.entry.name, _size(sum(i.bytes for i in plan.infos)),
        ", ".join(plan.devices), time.perf_counter() - start, f"{moved:,}",
    )  # fmt: skip
    return rows


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _check_file_crcs(plan: DevicePlan) -> None:
    """Each file's recorded crc32c must combine from its parts' (those the reads check)."""
    for info in plan.infos:
        for j, file in enumerate(info.files):
            found = 0
            for part in info.parts:
                found = crc32c_combine(found, part.ranges[j].crc32c, part.ranges[j].length)
            check_crc_value(location(plan.folder, file.path), file.crc32c, found)


def _write_indexes(plan: DevicePlan, where: str) -> dict[tuple[int, int], str]:
    """Write, in the folder ``where``, a bundle per file of each shard file read: an
    index of its runs and a symlink to the file as its data file; the bundles' prefixes
    by ``(record, file)``."""
    runs: dict[int, list[Run]] = {}
    for run in plan.runs:
        runs.setdefault(run.record, []).append(run)
    prefixes = {}
    for index, held in runs.items():
        info = plan.infos[index]
        for j, (file, layout) in enumerate(zip(info.files, column_layout(info.schema),
                                               strict=True)):  # fmt: skip
            prefix = os.path.join(where, names.restore_bundle_name(index, j))
            entries = {run.name: _tensor_entry(info, run, j, *layout) for run in held}
            with open(index_path(prefix), "wb") as f:
                f.write(index_bytes(entries))
            os.symlink(os.path.abspath(plan.folder.local_path(file.path) or ""), data_path(prefix))
            prefixes[index, j] = prefix
    return prefixes


def _tensor_entry(info: ShardInfo, run: Run, j: int, dtype: str, width: int) -> TensorEntry:
    """The bundle entry of ``run`` in file ``j`` of ``info`` (keys first: one a row)."""
    parts = info.parts[run.first : run.last]
    rows = sum(part.rows for part in parts)
    shape = (rows,) if j == 0 else (rows, width)
    size = sum(part.ranges[j].length for part in parts)
    enum = tf.as_dtype(dtype).as_datatype_enum
    return TensorEntry(enum, shape, parts[0].ranges[j].offset, size, _run_crc(info, run, j))


def _run_crc(info: ShardInfo, run: Run, j: int) -> int:
    crc = 0
    for part in info.parts[run.first : run.last]:
        crc = crc32c_combine(crc, part.ranges[j].crc32c, part.ranges[j].length)
    return crc


def _read_group(
    plan: DevicePlan, reader: int, index: int, runs: list[Run],
    prefixes: dict[tuple[int, int], str],
) -> list[tuple[int, Piece]]:  # fmt: skip
    """Read ``runs`` of shard file ``index`` on the task of table shard ``reader`` and
    check their keys' buckets; ``(target, rows)`` of each table shard's rows."""
    device, info = plan.devices[reader], plan.infos[index]
    names = [VALUE_COLUMN, *(extra.name for extra in info.schema.extras)]
    out = []
    with tf.device(device):
        read = [_restore(plan, index, j, runs, prefixes, device)
                for j in range(len(info.files))]  # fmt: skip
        _check_buckets(plan, index, runs, read[0])
        for k, run in enumerate(runs):
            columns = {name: read[j + 1][k] for j, name in enumerate(names)}
            rows = sum(part.rows for part in info.parts[run.first : run.last])
            piece = Piece(info.path, read[0][k], columns, rows, reader)
            if run.target is not None:
                out.append((run.target, piece))
            else:
                out += _route(piece, len(plan.devices))
    return out


def _restore(
    plan: DevicePlan, index: int, j: int, runs: list[Run], prefixes: dict[tuple[int, int], str],
    device: str,
) -> list[Any]:  # fmt: skip
    """``RestoreV2`` of ``runs`` from file ``j`` of shard file ``index``, on ``device``."""
    dtype = tf.as_dtype(column_layout(plan.infos[index].schema)[j][0])
    names = [run.name for run in runs]
    try:
        return list(tf.raw_ops.RestoreV2(prefix=prefixes[index, j], tensor_names=names,
                                         shape_and_slices=[""] * len(names),
                                         dtypes=[dtype] * len(names)))  # fmt: skip
    except tf.errors.OpError as err:
        raise _read_error(err, plan, index, j, runs, device) from err


#: How TensorFlow's bundle reader reports bytes that fail their crc32c.
_MISMATCH = re.compile(r"stored (\d+) vs\. calculated on the restored bytes (\d+)")


def _read_error(
    err: Any, plan: DevicePlan, index: int, j: int, runs: list[Run], device: str
) -> Exception:
    """The de_store error for ``err``, raised reading file ``j`` of shard file ``index``."""
    info = plan.infos[index]
    where = location(plan.folder, info.files[j].path)
    message = str(err.message)
    mismatch = _MISMATCH.search(message)
    if isinstance(err, tf.errors.DataLossError) and mismatch:
        stored, found = int(mismatch[1]), int(mismatch[2])
        held = [r for r in runs if _run_crc(info, r, j) == stored] or runs
        spans = [str(r.first) if r.last == r.first + 1 else f"{r.first} to {r.last - 1}"
                 for r in held]  # fmt: skip
        what = ("part " if spans == [str(held[0].first)] else "parts ") + ", ".join(spans)
        return ChecksumError(f"crc32c mismatch in {what} of {where}: expected {stored:#010x}, "
                             f"found {found:#010x} (read on {device})")  # fmt: skip
    cause = f"{type(err).__name__}: {message.splitlines()[0] if message else ''}"
    if isinstance(err, tf.errors.DataLossError):
        return FormatError(f"{where} cannot be read as its manifest records it, on {device}: "
                           f"{cause}")  # fmt: skip
    if isinstance(err, tf.errors.NotFoundError):
        return CheckpointError(
            f"{device} cannot read {where} through the bundle index this process wrote "
            f"beside it ({cause}): the checkpoint folder must be one that every task sees at "
            "the same path (a shared mount); elsewhere restore with tf.train."
            "CheckpointOptions(experimental_io_device=<this process's CPU>) to read every "
            "row through this process"
        )
    return CheckpointError(f"{device} did not read {where} ({cause}); no table was changed")


def _check_buckets(plan: DevicePlan, index: int, runs: list[Run], keys: list[Any]) -> None:
    """Every key of ``runs`` of shard file ``index`` (read as ``keys``, on the device in
    scope) must hash to its part's bucket: a count of the keys that do not comes back per
    run; the part that holds them is looked for only when there are some."""
    record, info = plan.entry.shards[index], plan.infos[index]
    if record.num_buckets == 1:
        return
    wrong = []
    for run, run_keys in zip(runs, keys, strict=True):
        buckets = record.part_buckets[run.first : run.last]
        expected: Any = buckets[0]
        if len(set(buckets)) > 1:
            rows = [part.rows for part in info.parts[run.first : run.last]]
            expected = tf.repeat(tf.constant(buckets, tf.int64), rows)
        wrong.append(_outside(run_keys, record.num_buckets, expected))
    for run, run_keys, count in zip(runs, keys, np.asarray(tf.stack(wrong)).tolist(),
                                    strict=True):  # fmt: skip
        if count:
            _refuse_buckets(record, info, run, run_keys)


def _outside(keys: Any, num_buckets: int, buckets: Any) -> Any:
    """How many of ``keys`` do not hash to ``buckets`` (one, or one a key) of ``num_buckets``."""
    found = tf.math.floormod(tf.cast(keys, tf.int64), num_buckets)
    return tf.math.count_nonzero(tf.not_equal(found, buckets))


def _refuse_buckets(record: ShardRecord, info: ShardInfo, run: Run, keys: Any) -> None:
    """Raise :class:`CheckpointCorruptError` for the first part of ``run`` (read as
    ``keys``) holding keys of another bucket than its record says."""
    start = 0
    for part in range(run.first, run.last):
        rows, bucket = info.parts[part].rows, record.part_buckets[part]
        count = int(_outside(keys[start : start + rows], record.num_buckets, bucket))
        if count:
            raise CheckpointCorruptError(
                f"{record.path}: part {part} is recorded as key bucket {bucket} of "
                f"{record.num_buckets}, but holds {count} key(s) of other buckets; the "
                "manifest's part_buckets do not match the keys"
            )
        start += rows


def _route(piece: Piece, count: int) -> list[tuple[int, Piece]]:
    """``piece``'s rows split by table shard (``floormod(key, count)``), on the device in
    scope (its reader's): ``(table shard, its rows)`` of each shard that gets some."""
    ids = tf.cast(tf.math.floormod(tf.cast(piece.keys, tf.int64), count), tf.int32)
    rows = np.asarray(tf.math.bincount(ids, minlength=count, maxlength=count, dtype=tf.int64))
    keys = tf.dynamic_partition(piece.keys, ids, count)
    columns = {name: tf.dynamic_partition(c, ids, count) for name, c in piece.columns.items()}
    return [
        (t, dataclasses.replace(piece, keys=keys[t], rows=int(n),
                                columns={name: c[t] for name, c in columns.items()}))
        for t, n in enumerate(rows.tolist())
        if n
    ]  # fmt: skip


def _gather(plan: DevicePlan, shard: int, pieces: list[Piece]) -> HeldShard:
    """The ``pieces`` of table shard ``shard`` concatenated on its task (the pieces read
    by other tasks come from them, task to task)."""
    sources = [(piece.path, piece.rows) for piece in pieces]
    if not pieces:
        return HeldShard(None, {}, 0, sources)
    with on_device(plan.devices[shard]):
        keys = _concat([piece.keys for piece in pieces])
        columns = {name: _concat([piece.columns[name] for piece in pieces])
                   for name in pieces[0].columns}  # fmt: skip
    return HeldShard(keys, columns, sum(piece.rows for piece in pieces), sources)


def _concat(tensors: list[Any]) -> Any:
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 0)


def each(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` of each of ``items``, side by side (a thread each: each runs ops on its own
    task, and TensorFlow waits for them outside the GIL); the first error is raised."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(len(items), thread_name_prefix="de_store-ps") as pool:
        futures = [pool.submit(fn, item) for item in items]
        return [future.result() for future in futures]
