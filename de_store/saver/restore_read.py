"""The read step of a restore: every row its plan names, read and checked.

- A variable whose tables live on other tasks has them read its rows there
  (:func:`~de_store.saver.device_restore.read_on_devices`), and checked there for a key
  held twice (:func:`~de_store.saver.device_load.check_repeats`).
- Otherwise this process reads this rank's parts of each link, each shard file one
  retried step, every row checked as it is read
  (:func:`~de_store.checkpoint.checks.read_checked`); a link holding a key twice is
  refused, naming the key and the files that hold it.
- A variable the plan streams (it holds nothing) has its deltas read and checked first,
  then its full link loaded while it is read (:mod:`de_store.saver.streamed`); when that
  fails it is emptied again and its chain is read whole, with retries, like the others'.

Meanwhile a helper thread grows the tables of every empty variable for its share of the
rows (:func:`~de_store.saver.restore_room.grow_for_restore`). When the read fails, every
variable loaded while it was read is emptied again: as it was.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from de_store.backends import Backend
from de_store.checkpoint import shards
from de_store.checkpoint.checks import Problem, has_repeated_key, repeated_key
from de_store.checkpoint.manifest import ShardRecord, VariableEntry
from de_store.checkpoint.topology import Topology
from de_store.errors import CheckpointCorruptError
from de_store.progress import Progress, progress_for
from de_store.saver import device_load, device_restore
from de_store.saver.restore_room import grow_for_restore
from de_store.saver.rows import SavedVariable, ShardRows
from de_store.saver.streamed import load_while_reading

if TYPE_CHECKING:
    from de_store.saver.core import IOOptions
    from de_store.saver.device_restore import DeviceRows
    from de_store.saver.restore_plan import Link, RestorePlan, VariablePlan

#: Rows read from one shard file, with the file's path (to name it in errors).
FileRows = tuple[str, ShardRows]
#: This rank's rows of one link, and its removed keys (tombstones).
LinkRows = tuple[list[FileRows], list[FileRows]]


@dataclasses.dataclass
class ReadRows:
    """What the read step holds of one variable's chain.

    Attributes
    ----------
    links: each link's rows read through this process: none when its tables' tasks read
        them, the deltas only when its full link was loaded while it was read.
    held: the rows its tables' tasks read and hold, or None.
    streamed: its full link was loaded while it was read (only its deltas are to apply).
    loaded: the rows of its chain then (what the log line counts for it), else 0.
    """

    links: list[LinkRows]
    held: DeviceRows | None
    streamed: bool = False
    loaded: int = 0

    @property
    def rows(self) -> int:
        """The rows read (what the restore's log line counts)."""
        rows = sum(r.rows for link_rows, _ in self.links for _, r in link_rows)
        return rows + self.loaded + (self.held.rows if self.held is not None else 0)


def read_rows(plan: RestorePlan) -> list[ReadRows]:
    """Every row of ``plan``, read and checked; the variables it streams are loaded
    (emptied again when the read fails)."""
    options = plan.options
    loaded: list[SavedVariable] = []
    with ThreadPoolExecutor(1, thread_name_prefix="de_store-grow") as pool:
        growing = [pool.submit(grow_for_restore, p.variable, p.rows, p.shares)
                   for p in plan.variables]  # fmt: skip
        try:
            with progress_for(plan.total, "restore", quiet=not options.progress,
                              unit="rows") as bar:  # fmt: skip
                read = _read_all(plan, bar)
                for p, rows, grown in zip(plan.variables, read, growing, strict=True):
                    if p.streamed and _stream(plan, p, rows, grown.result, bar):
                        loaded.append(p.variable)
            for grown in growing:
                grown.result()
            # what a load would find, found before any variable that holds rows is emptied
            for p, rows in zip(plan.variables, read, strict=True):
                _check_repeats(p, rows)
        except BaseException:
            for variable in loaded:  # they held nothing: all or nothing
                variable.clear()
            raise
    return read


def _read_all(plan: RestorePlan, bar: Progress) -> list[ReadRows]:
    """Each variable's rows on its tables' tasks, then the others' through this process
    (a streamed chain's deltas only: its full link is read while it loads)."""
    held = [None if p.on_devices is None else device_restore.read_on_devices(p.on_devices, bar)
            for p in plan.variables]  # fmt: skip
    return [
        ReadRows([] if h is not None else _read_chain(plan, p.read_first, bar), h)
        for p, h in zip(plan.variables, held, strict=True)
    ]


def _stream(
    plan: RestorePlan,
    variable: VariablePlan,
    rows: ReadRows,
    ready: Callable[[], object],
    bar: Progress,
) -> bool:
    """Load ``variable``'s full link while it is read, its deltas checked first; when
    that fails, read its chain whole instead (retried, or its damage reported)."""
    _check_deltas(variable.variable, variable.urls[1:], rows.links)
    at, _, entry = variable.chain[0]
    if load_while_reading(variable.variable, plan.where.backend.sub(at), entry,
                          variable.full_rows, variable.shares, ready=ready,
                          buffer_size=plan.options.read_batch_rows, bar=bar):  # fmt: skip
        rows.streamed, rows.loaded = True, variable.rows
        return True
    rows.links = _read_chain(plan, variable.chain, bar)
    return False


def _check_repeats(variable: VariablePlan, rows: ReadRows) -> None:
    if rows.held is not None:
        device_load.check_repeats(variable.variable, rows.held, variable.urls[0])
    elif not rows.streamed:
        _check_chain_rows(variable.variable, variable.urls, rows.links)


def _check_chain_rows(variable: SavedVariable, folders: list[str], links: list[LinkRows]) -> None:
    """Refuse a chain (links in checkpoints ``folders``) whose full link or a delta holds a
    key twice, before anything is applied, naming the key and the files that hold it."""
    rows = links[0][0]
    if has_repeated_key([r.keys for _, r in rows]):
        refuse_repeated(variable, folders[0], repeated_key((path, r.keys) for path, r in rows))
    _check_deltas(variable, folders[1:], links[1:])


def _check_deltas(variable: SavedVariable, folders: list[str], deltas: list[LinkRows]) -> None:
    """Refuse a chain whose delta (in checkpoint ``folders[i]``) holds a key twice, before
    anything is applied: a sort of its rows (deltas are upserted, which finds no repeat)."""
    for folder, (rows, _) in zip(folders, deltas, strict=True):
        if (found := repeated_key((path, r.keys) for path, r in rows)) is not None:
            refuse_repeated(variable, folder, found)


def refuse_repeated(
    variable: SavedVariable, folder: str, found: Problem | None, emptied: str = ""
) -> None:
    """Raise :class:`CheckpointCorruptError` for the repeated key ``found`` in the
    checkpoint ``folder`` (None: the table found a repeat that the rows do not show)."""
    detail = f"{folder}/{found.path}: {found.message}" if found else "a key is repeated"
    raise CheckpointCorruptError(
        f"variable {variable.name!r}: checkpoint {folder} is damaged: {detail}{emptied}"
    )


def _read_chain(plan: RestorePlan, chain: list[Link], bar: Progress) -> list[LinkRows]:
    """This rank's rows and removed keys of every link of a chain, in order."""
    backend = plan.where.backend
    return [read_link(backend.sub(at), entry, plan.topology, plan.options, bar)
            for at, _, entry in chain]  # fmt: skip


def read_link(
    folder: Backend, entry: VariableEntry, topology: Topology, options: IOOptions, bar: Progress
) -> LinkRows:
    """This rank's rows and removed keys (tombstones) of one link, under ``folder``."""
    rows = _read_records(folder, entry.shards, entry.key_dtype, topology, options, bar)
    removed = _read_records(folder, entry.removed, entry.key_dtype, topology, options, bar)
    return rows, removed


def _read_records(
    folder: Backend,
    records: list[ShardRecord],
    key_dtype: str,
    topology: Topology,
    options: IOOptions,
    bar: Progress,
) -> list[FileRows]:
    out = []
    for record in records:
        parts = shards.parts_for_rank(record, topology.proc_rank, topology.proc_size)
        if not parts:
            bar.update(record.rows)
            continue
        read = functools.partial(_read_parts, folder, record, parts, key_dtype, topology,
                                 options)  # fmt: skip
        out += [(record.path, rows) for rows in options.retry.call(read)]
        bar.update(record.rows)  # shards done, of all the checkpoint's
    return out


def _read_parts(
    folder: Backend,
    record: ShardRecord,
    parts: list[int],
    key_dtype: str,
    topology: Topology,
    options: IOOptions,
) -> list[ShardRows]:
    """This rank's rows of one shard's parts, read whole and checked: the retried step of
    a restore."""
    rows = shards.read_shard_rows(
        folder,
        record,
        parts,
        buffer_size=options.read_batch_rows,
        key_dtype=key_dtype,
        proc_rank=topology.proc_rank,
        proc_size=topology.proc_size,
    )
    return list(rows)
