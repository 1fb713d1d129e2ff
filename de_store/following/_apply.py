"""Reading an update (:class:`~._watch.Update`) and applying it to live tables.

Reading comes first and whole: every shard file of every link is read and checked
(sizes, crc32c, key buckets) before any table changes, so a damaged checkpoint changes
nothing. A full link read ``staged`` is held in host memory until applied (a second copy
of the table's rows); read ``streamed`` it is read twice, once to check it (keeping its
keys only) and once while it is applied (one part of a file in memory at a time).

Applying runs in steps of at most ``chunk_rows`` keys. Each step is one operation on each
table shard (insert or remove), atomic under that table's mutex, so a lookup running
meanwhile sees every key's row either as the tables held it before the update or as the
update leaves it, never a row half written; lookups run between the steps. The steps call
the table shards directly, not the Variable's eager methods: those hold the Variable's
Python lock, which a thread looking up in a loop takes again as soon as it lets it go, so
a writer waiting for it could wait for as long as the lookups go on. A TensorFlow mutex
hands itself to its waiters in turn.

A full link upserts its rows first and then removes the keys the tables hold that it does
not, so a key present before and after is never missing; deltas then remove their
tombstoned keys and upsert their rows, in order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from de_store.backends import Backend, Location
from de_store.checkpoint import shards
from de_store.checkpoint.checks import check_link
from de_store.checkpoint.variable_rows import VALUE_COLUMN
from de_store.errors import CheckpointError
from de_store.following._watch import Link, Update
from de_store.saver.core import IOOptions
from de_store.saver.rows import load_rows, reserve_shards

#: How a full link is read: held whole, or checked first and read again while applied.
FULL_LOADS = ("staged", "streamed")


@dataclasses.dataclass
class LinkRows:
    """One link's keys and values (``values`` None: read again while applied) and its
    removed keys."""

    link: Link
    keys: list[np.ndarray]
    values: list[np.ndarray] | None
    removed: list[np.ndarray]


@dataclasses.dataclass
class Applied:
    """What applying an update did: rows upserted and keys removed, over all variables."""

    upserted: int = 0
    removed: int = 0


def check_update(backend: Backend, update: Update, targets: Mapping[str, Any]) -> None:
    """Check every link's numbers and file sizes, and that it fits its variable."""
    for name, links in update.links.items():
        target = targets[name]
        for link in links:
            where = Location(backend, link.folder).url
            check_link(backend, link.folder, link.proc_size, link.entry, where)
            mine = (target.key_dtype.name, target.value_dtype.name, target.dim)
            saved = (link.entry.key_dtype, link.entry.value_dtype, link.entry.dim)
            if mine != saved:
                raise CheckpointError(
                    f"variable {name!r}: checkpoint {where} holds (key_dtype, value_dtype, "
                    f"dim) = {saved}, the followed variable has {mine}"
                )


def read_update(
    backend: Backend, update: Update, options: IOOptions, full_load: str
) -> dict[str, list[LinkRows]]:
    """Every link of ``update`` read and checked; a full link read ``streamed`` keeps its
    keys only."""
    read: dict[str, list[LinkRows]] = {}
    for name, links in update.links.items():
        read[name] = []
        for index, link in enumerate(links):
            keep_values = not (index == 0 and name in update.full and full_load == "streamed")
            read[name].append(_read_link(backend, link, options, keep_values))
    return read


def _read_link(backend: Backend, link: Link, options: IOOptions, keep_values: bool) -> LinkRows:
    folder = backend.sub(link.folder)
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for record in link.entry.shards:
        for batch in options.retry.call(
            functools.partial(_read_file, folder, record, link, options)
        ):
            keys.append(batch.keys)
            if keep_values:
                values.append(batch.columns[VALUE_COLUMN])
    removed = [
        batch.keys
        for record in link.entry.removed
        for batch in options.retry.call(
            functools.partial(_read_file, folder, record, link, options)
        )
    ]
    return LinkRows(link, keys, values if keep_values else None, removed)


def _read_file(folder: Backend, record: Any, link: Link, options: IOOptions) -> list[Any]:
    """One shard file's rows, read whole and checked: the retried step."""
    return list(_batches(folder, record, link, options))


def _batches(folder: Backend, record: Any, link: Link, options: IOOptions) -> Iterator[Any]:
    parts = shards.parts_for_rank(record, 0, 1)
    return shards.read_shard_rows(folder, record, parts, buffer_size=options.buffer_size,
                                  key_dtype=link.entry.key_dtype)  # fmt: skip


def apply_update(
    backend: Backend,
    update: Update,
    read: Mapping[str, list[LinkRows]],
    targets: Mapping[str, Any],
    options: IOOptions,
    chunk_rows: int,
) -> Applied:
    """Apply what :func:`read_update` read to ``targets`` (variable name -> Variable)."""
    done = Applied()
    for name, links in read.items():
        target = targets[name]
        if name in update.full:
            _apply_full(backend, target, links[0], options, chunk_rows, done)
            links = links[1:]
        for link in links:
            _remove(target, link.removed, chunk_rows, done)
            _upsert(target, zip(link.keys, link.values or [], strict=True), chunk_rows, done)
    return done


def _apply_full(
    backend: Backend,
    target: Any,
    link: LinkRows,
    options: IOOptions,
    chunk_rows: int,
    done: Applied,
) -> None:
    """The full link's rows upserted, then the keys it does not hold removed.

    The tables grow once, for the keys new to them. Read ``staged``, only the rows that
    differ from what the tables hold are written: the tables' rows are exported and
    compared in host memory (a trainer's full checkpoint differs from the previous one by
    a delta's rows). Tables that hold nothing (the first checkpoint a follower applies,
    usually) are bulk-loaded in batches of a restore's size: no key of theirs can go
    missing.
    """
    staged = link.values is not None
    live_keys, live_values = _held(target, staged)
    order = np.argsort(live_keys, kind="stable")
    held_keys = live_keys[order]
    del live_keys
    held = np.zeros(len(held_keys), bool)  # held keys the checkpoint holds too
    found = [_find(held_keys, keys) for keys in link.keys]
    for at, hit in found:
        held[at[hit]] = True
    reserve_shards(target, sum(len(hit) - int(hit.sum()) for _, hit in found))
    stale = held_keys[~held]
    del held, held_keys
    if not len(order):
        _upsert(target, _rows_of(backend, link, options), load_rows(target), done, load=True)
        return
    if staged:
        rows: Any = (
            _differing(keys, values, live_values[order[at[hit]]], hit)  # type: ignore[index]
            for keys, values, (at, hit) in zip(link.keys, link.values or [], found, strict=True)
        )
    else:
        rows = _rows_of(backend, link, options)
    _upsert(target, rows, chunk_rows, done)
    _remove(target, [stale], chunk_rows, done)


def _held(target: Any, with_rows: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The keys the tables hold, and with ``with_rows`` their rows (the whole export, shared
    with numpy: ``Tensor.numpy()`` would copy it). Without, each table shard's rows are
    dropped once its keys are taken: one shard's rows exported at a time."""
    import tensorflow as tf

    if with_rows:
        keys, rows = target.export()
        return np.asarray(keys), np.asarray(rows)
    held = []
    for core, device in zip(target.shards, target.devices, strict=True):
        with tf.device(device):
            held.append(np.asarray(core.export_all()[0]))
    return np.concatenate(held), None


def _find(held_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``keys`` is in the sorted ``held_keys``, and whether it is there.

    The keys are searched in sorted order (each search then starts near the last one in
    memory: about 10x faster than searching 10M keys in the order they come)."""
    if not len(held_keys):
        return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
    order = np.argsort(keys)
    at = np.empty(len(keys), np.int64)
    at[order] = np.searchsorted(held_keys, keys[order])
    np.minimum(at, len(held_keys) - 1, out=at)
    return at, held_keys[at] == keys


def _differing(
    keys: np.ndarray, values: np.ndarray, held_rows: np.ndarray, hit: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``keys`` not held with those values (``held_rows``: the rows held of the
    keys where ``hit``)."""
    same = np.zeros(len(keys), bool)
    same[hit] = (held_rows == values[hit]).all(axis=1)
    return keys[~same], values[~same]


def _rows_of(backend: Backend, link: LinkRows, options: IOOptions) -> Any:
    """``(keys, values)`` of a full link: as staged, or read again, checked again."""
    if link.values is not None:
        return zip(link.keys, link.values, strict=True)
    folder = backend.sub(link.link.folder)
    return (
        (batch.keys, batch.columns[VALUE_COLUMN])
        for record in link.link.entry.shards
        for batch in _batches(folder, record, link.link, options)
    )


def _upsert(target: Any, rows: Any, chunk_rows: int, done: Applied, load: bool = False) -> None:
    for keys, values in rows:
        for start in range(0, len(keys), chunk_rows):
            end = start + chunk_rows
            write(target, keys[start:end], values[start:end], load=load)
            done.upserted += len(keys[start:end])


def _remove(target: Any, removed: list[np.ndarray], chunk_rows: int, done: Applied) -> None:
    for keys in removed:
        for start in range(0, len(keys), chunk_rows):
            chunk = keys[start : start + chunk_rows]
            for variable in (target, *target.companions().values()):
                write(variable, chunk)
            done.removed += len(chunk)


def prepare_writes(targets: Mapping[str, Any]) -> None:
    """Run each kind of write step once with no keys: a removal on every variable and
    companion, an insert on every variable. Their first calls in a process load and set up
    the table kernels (a few MiB, kept); made here, after the first checkpoint, they are
    not paid by the first delta, in its lag and in the memory a delta takes."""
    for target in targets.values():
        no_keys = np.zeros(0, target.key_dtype.as_numpy_dtype)
        for variable in (target, *target.companions().values()):
            write(variable, no_keys)
        write(target, no_keys, np.zeros((0, target.dim), target.value_dtype.as_numpy_dtype))


def write(
    variable: Any, keys: np.ndarray, values: np.ndarray | None = None, load: bool = False
) -> None:
    """Insert ``keys`` with ``values`` into ``variable``'s table shards (None: remove them),
    each shard's part as one operation of that shard; ``load``: keys none of them holds,
    bulk-loaded (``load_distinct``)."""
    import tensorflow as tf

    key_tensor = tf.constant(keys, variable.key_dtype)
    rows = None if values is None else tf.constant(values, variable.value_dtype)
    several = len(variable.shards) > 1
    parts = variable.partition(key_tensor)
    for core, device, (shard_keys, positions) in zip(
        variable.shards, variable.devices, parts, strict=True
    ):
        with tf.device(device):
            shard_rows = None if rows is None else tf.gather(rows, positions) if several else rows
            if shard_rows is None:
                core.remove(shard_keys)
            elif load:
                core.load_distinct(shard_keys, shard_rows)
            else:
                core.insert(shard_keys, shard_rows)
