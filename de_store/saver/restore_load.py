"""The load step of a restore: the rows read replace the tables' content, in order.

Every row was read and checked (:mod:`de_store.saver.restore_read`) before anything here
changes a variable that holds rows. A variable whose full link was loaded while it was
read gets its deltas first (it is emptied again when they fail: it held nothing). Then
each other variable's full link replaces its content and its deltas apply in order (each
removes its keys, upserts its rows), or its tables' tasks load the rows they hold
(:func:`~de_store.saver.device_load.load_on_devices`). Afterwards each variable's next
incremental save is a delta on this checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from de_store.checkpoint.checks import repeated_key
from de_store.checkpoint.manifest import VariableEntry
from de_store.errors import RepeatedKeysError
from de_store.saver import device_load, incremental
from de_store.saver.restore_read import LinkRows, ReadRows, refuse_repeated
from de_store.saver.rows import RestoredVariable, apply_delta, apply_rows

if TYPE_CHECKING:
    from de_store.saver.restore_plan import RestorePlan


def load_rows(plan: RestorePlan, read: Sequence[ReadRows]) -> None:
    """Load what :func:`~de_store.saver.restore_read.read_rows` read for ``plan``."""
    streamed = [(p, rows) for p, rows in zip(plan.variables, read, strict=True) if rows.streamed]
    try:
        for p, rows in streamed:  # its deltas, on the full link loaded while it was read
            with p.variable.exclusive():
                _apply_deltas(p.variable, p.entries[1:], rows.links)
    except BaseException:
        for p, _ in streamed:  # they held nothing: all or nothing
            p.variable.clear()
        raise
    for p, rows in zip(plan.variables, read, strict=True):
        if rows.held is not None:
            device_load.load_on_devices(p.variable, rows.held, p.urls[0])
        elif not rows.streamed:
            _apply_chain(p.variable, p.entries, rows.links, p.urls, p.shares)
        incremental.record_restore(p.variable, plan.where.url, plan.manifest, p.entries)


def _apply_chain(
    variable: RestoredVariable,
    entries: list[VariableEntry],
    links: list[LinkRows],
    folders: list[str],
    shares: Sequence[int],
) -> None:
    """The full link replaces the content; each delta removes its keys, upserts its rows.
    Each table shard is grown first for its entry of ``shares``, the rows it receives.

    The rows were checked by the read step; a key the table still finds repeated (which
    that check rules out) empties the variable, named in the error.
    """
    first = [rows for _, rows in links[0][0]]
    # Eager calls from other threads (a training loop) wait: the size check below and the
    # chain see this restore's rows only, and the restore is one step to them.
    with variable.exclusive():
        try:
            apply_rows(variable, entries[0].columns, first, shares)
            repeated = int(variable.size()) != sum(batch.rows for batch in first)
        except RepeatedKeysError:
            repeated = True
        if repeated:
            variable.clear()
            found = repeated_key((path, r.keys) for path, r in links[0][0])
            refuse_repeated(variable, folders[0], found, " (the variable was emptied)")
        _apply_deltas(variable, entries[1:], links[1:])


def _apply_deltas(
    variable: RestoredVariable, entries: list[VariableEntry], deltas: list[LinkRows]
) -> None:
    """Each delta in order: its removed keys dropped, its rows upserted."""
    for entry, (rows, removed) in zip(entries, deltas, strict=True):
        apply_delta(variable, entry.columns, [r for _, r in rows], [r for _, r in removed])
