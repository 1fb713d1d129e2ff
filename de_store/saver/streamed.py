"""A restore that loads an empty variable's rows while its shards are still being read.

A restore reads and checks every part before it replaces a table's content, so that a
damaged checkpoint leaves the variable as it was. For a variable that holds nothing
(what a fresh process restores into), "as it was" is empty: its rows can be loaded as
they arrive, and a failure empties it again. The reading then overlaps the loading, and
the read buffers are reused instead of the whole shard being held in new memory at once.
The reading thread also makes the load batches (the parts' rows joined, or split by table
shard), so that the loading thread only loads: at 10M x 16 the joins copy 720 MB, which
the loads would otherwise wait for.

A restore's plan takes this path where the rows read are exactly the rows loaded: one
process (``proc_size == 1``), a variable whose tables and companions are all empty
(:mod:`de_store.saver.restore_plan`). It streams a checkpoint's full link; the deltas of
a chain are read and checked before it, and apply after it. Anything that goes wrong
while streaming (a damaged part, a storage error, a key held twice) empties the variable
and hands the link back to the restore's read-everything-first path
(:mod:`de_store.saver.restore_read`), which retries, loads, or reports the damage as it
always does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from de_store.backends.base import Backend
from de_store.checkpoint import shards
from de_store.checkpoint.manifest import VariableEntry
from de_store.checkpoint.variable_rows import ShardRows, even_batches
from de_store.formats._shard import map_ahead
from de_store.progress import Progress
from de_store.saver.rows import ByShard, apply_rows, load_rows, routes_by_hash, shard_batches

T = TypeVar("T")

#: Bytes of rows read ahead of the load at most (the read buffers of that much are reused).
READ_AHEAD_BYTES = 256 << 20


def rows_bytes(rows: ShardRows) -> int:
    """Bytes of the arrays of ``rows`` (object arrays count their pointers)."""
    return rows.keys.nbytes + sum(column.nbytes for column in rows.columns.values())


def load_while_reading(
    variable: Any,
    folder: Backend,
    entry: VariableEntry,
    rows: int,
    shares: Sequence[int],
    *,
    ready: Callable[[], object],
    buffer_size: int,
    bar: Progress,
) -> bool:
    """Load the ``rows`` rows of ``entry`` (shard files under ``folder``) into the empty
    ``variable`` while they are read; ``ready()`` returns once its tables were grown
    (``restore_room.grow_for_restore``), and the reading starts then, when the first rows
    are asked for: its threads (drawing, decoding and checking parts in Python) would
    share the interpreter with the traces of the load's kernels in a new process, and
    delay them more than the read takes.

    Returns False, the variable emptied again, when anything failed (the error is not
    raised: the caller reads the link the other way, which retries or reports it).
    """
    read = _read_entry(folder, entry, buffer_size)
    ahead: Generator[Any, None, None]
    source: Iterable[ShardRows] | ByShard
    if routes_by_hash(variable):  # split and regrouped by table shard in the reading thread
        ahead = _read_ahead(shard_batches(read, variable, shares), _pair_bytes)
        source = ByShard(_counted(ahead, bar, lambda pair: pair[1].rows))
    else:  # regrouped into the load batches in the reading thread
        ahead = _read_ahead(even_batches(read, rows, load_rows(variable)), rows_bytes)
        source = _counted(ahead, bar, lambda batch: batch.rows)
    try:
        ready()
        with variable.exclusive():
            try:
                apply_rows(variable, entry.columns, source, shares, rows=rows)
                if int(variable.size()) == rows:  # else a key was held twice
                    return True
            except Exception:  # the other path retries or reports it
                pass
            except BaseException:
                variable.clear()
                raise
            variable.clear()
            return False
    finally:
        ahead.close()


def _read_ahead(items: Iterable[T], size: Callable[[T], int]) -> Generator[T, None, None]:
    """``items``, drawn by a helper thread ``de_store-stream`` at most
    :data:`READ_AHEAD_BYTES` (``size(item)``) ahead of the loads."""
    return map_ahead(_same, items, 1, "stream", limit=READ_AHEAD_BYTES, size=size)


def _same(item: T) -> T:
    return item


def _read_entry(folder: Backend, entry: VariableEntry, buffer_size: int) -> Iterator[ShardRows]:
    for record in entry.shards:
        parts = shards.parts_for_rank(record, 0, 1)
        if parts:
            yield from shards.read_shard_rows(
                folder, record, parts, buffer_size=buffer_size, key_dtype=entry.key_dtype
            )


def _pair_bytes(pair: tuple[int, ShardRows]) -> int:
    return rows_bytes(pair[1])


def _counted(items: Iterable[T], bar: Progress, rows: Callable[[T], int]) -> Iterator[T]:
    for item in items:
        bar.update(rows(item))
        yield item
