"""Reading an update (:class:`~._watch.Update`) and applying it to live tables.

Reading comes first and whole: every shard file of every link is read and checked
(sizes, crc32c, key buckets) before any table changes, so a damaged checkpoint changes
nothing. A full link read ``staged`` is held in host memory until applied (a copy of its
rows beside the tables); read ``streamed`` it is read twice, once to check it (keeping its
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
from de_store.saver._lazy_tf import on_device
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
    return shards.read_shard_rows(folder, record, parts, buffer_size=options.read_batch_rows,
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

    Tables that hold nothing (the first checkpoint a follower applies, usually) are
    bulk-loaded in batches of a restore's size: no key of theirs can go missing. Else the
    checkpoint's keys are looked up in the tables (steps of :data:`LOOKUP_ROWS` keys, each
    one operation of a table shard) and only the rows the tables do not hold with those
    values are written: a trainer's full checkpoint differs from the previous one by about
    a delta's rows. The tables grow once, for the keys new to them. Read ``staged``, one
    pass of lookups finds the differing rows; read ``streamed``, a first pass counts the
    new keys and the second read looks each batch up again before writing it. The keys
    to remove are looked for only when fewer of the checkpoint's keys were found than the
    tables hold.
    """
    held_before = sum(_shard_sizes(target))
    if not held_before:
        reserve_shards(target, sum(len(keys) for keys in link.keys))
        _upsert(target, _rows_of(backend, link, options), load_rows(target), done, load=True)
        return
    found, differing = _compare(target, link)
    reserve_shards(target, sum(len(keys) for keys in link.keys) - found)
    if link.values is not None:
        rows: Any = (
            (keys[at], values[at])
            for keys, values, at in zip(link.keys, link.values, differing, strict=True)
        )
    else:
        rows = _differing_rows(target, _rows_of(backend, link, options))
    _upsert(target, rows, chunk_rows, done)
    if found < held_before:
        _remove(target, [_stale(target, link.keys)], chunk_rows, done)


def _compare(target: Any, link: LinkRows) -> tuple[int, list[np.ndarray]]:
    """One pass of lookups over the link's keys: how many of them the tables hold, and
    for each batch of the link the positions of the rows to write (staged: the rows not
    held with those values; streamed: the keys not held)."""
    found = 0
    differing = []
    for index, keys in enumerate(link.keys):
        values = None if link.values is None else link.values[index]
        positions = [np.zeros(0, np.int64)]
        for start in range(0, len(keys), LOOKUP_ROWS):
            write_at, exists = _to_write(target, keys[start : start + LOOKUP_ROWS], values, start)
            found += int(exists.sum())
            positions.append(write_at)
        differing.append(np.concatenate(positions))
    return found, differing


#: Keys one lookup step of a full checkpoint over live tables looks up (about 10 ms on a
#: 10M-key table): the lookups of the serving threads wait at most one step.
LOOKUP_ROWS = 1 << 16


def _to_write(
    target: Any, keys: np.ndarray, values: np.ndarray | None, offset: int
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (from ``offset``) of ``keys`` whose rows the tables do not hold with
    ``values`` (the batch's whole values; None: those of the keys not held), and whether
    each key is held."""
    held_rows, exists = look_up(target, keys)
    write = ~exists
    if values is not None:
        rows = values[offset : offset + len(keys)]
        write[exists] = ~(held_rows[exists] == rows[exists]).all(axis=1)
    return np.flatnonzero(write) + offset, exists


def _differing_rows(target: Any, rows: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The ``(keys, values)`` of each batch of ``rows`` that the tables do not hold."""
    for keys, values in rows:
        for start in range(0, len(keys), LOOKUP_ROWS):
            at, _ = _to_write(target, keys[start : start + LOOKUP_ROWS], values, start)
            yield keys[at], values[at]


def _stale(target: Any, keys: list[np.ndarray]) -> np.ndarray:
    """The keys the tables hold that are not among ``keys`` (exported one table shard at
    a time, keys only)."""
    wanted = np.sort(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
    stale = []
    for core, device in zip(target.shards, target.devices, strict=True):
        with on_device(device):  # beside the serving threads' lookups there
            held = np.asarray(core.export_all()[0])
        found = _as_read(held)
        at = np.minimum(np.searchsorted(wanted, found), max(len(wanted) - 1, 0))
        missing = np.ones(len(held), bool) if not len(wanted) else wanted[at] != found
        stale.append(held[missing])
    return np.concatenate(stale)


def _as_read(keys: np.ndarray) -> np.ndarray:
    """Keys exported from a table as a shard read gives them back: string keys come out
    of TensorFlow as ``bytes`` and out of a shard as ``str`` (shards store UTF-8)."""
    if keys.dtype != object or not len(keys) or not isinstance(keys[0], bytes):
        return keys
    return np.array([key.decode() for key in keys], dtype=object)


def _shard_sizes(target: Any) -> list[int]:
    sizes = []
    for core, device in zip(target.shards, target.devices, strict=True):
        with on_device(device):
            sizes.append(int(core.size()))
    return sizes


def look_up(variable: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, exists)`` of ``keys`` in ``variable``'s table shards, each shard's part as
    one operation of that shard (rows of keys not held: whatever the shard returns). On a
    device other than the host's first CPU, a shard's ops hold the lock that keeps them
    from running beside another thread's (``de_store.tables._locking.EAGER_ON_DEVICE``)."""
    import tensorflow as tf

    key_tensor = tf.constant(keys, variable.key_dtype)
    if len(variable.shards) == 1:
        with on_device(variable.devices[0]):
            shard_rows, shard_exists = variable.shards[0].lookup(key_tensor)
        return shard_rows.numpy(), shard_exists.numpy()
    rows = np.empty((len(keys), variable.dim), variable.value_dtype.as_numpy_dtype)
    exists = np.empty(len(keys), bool)
    for core, device, (shard_keys, positions) in zip(
        variable.shards, variable.devices, variable.partition(key_tensor), strict=True
    ):
        with on_device(device):
            shard_rows, shard_exists = core.lookup(shard_keys)
        at = positions.numpy()
        rows[at] = shard_rows.numpy()
        exists[at] = shard_exists.numpy()
    return rows, exists


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
        with on_device(device):  # beside the serving threads' lookups there
            shard_rows = None if rows is None else tf.gather(rows, positions) if several else rows
            if shard_rows is None:
                core.remove(shard_keys)
            elif load:
                core.load_distinct(shard_keys, shard_rows)
            else:
                core.insert(shard_keys, shard_rows)
