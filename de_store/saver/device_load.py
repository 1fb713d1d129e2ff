"""Loading the rows that the tasks of a variable's tables read (:mod:`device_restore`).

- :func:`check_repeats`: no key held twice, where the variable holds rows (each task
  looks at its own keys: a key's table shard follows from the key, so any repeat meets
  on one task). Only counts come back, and the repeated key when there is one.
- :func:`load_on_devices`: only then is the variable emptied, and each task bulk-loads
  its rows, side by side. An empty variable finds a repeated key while it loads, and is
  emptied again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from de_store.checkpoint.checks import Problem
from de_store.checkpoint.variable_rows import VALUE_COLUMN, even_sizes
from de_store.errors import CheckpointCorruptError, RepeatedKeysError
from de_store.saver._lazy_tf import on_device, tf
from de_store.saver.device_restore import DeviceRows, HeldShard, each
from de_store.saver.rows import (
    RestoredVariable,
    SavedVariable,
    column_targets,
    holds_keys,
    load_rows,
    reserve_shards,
)


def check_repeats(variable: SavedVariable, rows: DeviceRows, url: str) -> None:
    """Refuse ``rows`` (of the checkpoint ``url``) when they hold a key twice, before a
    variable that holds rows is emptied for them (an empty one finds a repeat as it loads
    them: :func:`load_on_devices`)."""
    if not holds_keys(variable):
        return
    shards = list(range(len(rows.shards)))
    if any(each(lambda t: _has_repeat(rows, t), shards)):
        _refuse_repeated(variable, rows, url)


def _has_repeat(rows: DeviceRows, shard: int) -> bool:
    held = rows.shards[shard]
    if held.rows < 2:
        return False
    with on_device(rows.plan.devices[shard]):
        return int(tf.size(tf.unique(held.keys).y)) != held.rows


def _refuse_repeated(
    variable: SavedVariable, rows: DeviceRows, url: str, emptied: str = ""
) -> None:
    """Raise :class:`CheckpointCorruptError` naming a repeated key and its files."""
    found = each(lambda t: _repeated_in(rows, t), list(range(len(rows.shards))))
    problems = [problem for problem in found if problem is not None]
    extra = sum(count for _, count in problems)
    detail = "a key is repeated"
    if problems:
        first = problems[0][0]
        detail = f"{first.path}: {first.message}; {extra} extra copies of keys in all: a " \
                 "checkpoint holds each key once"  # fmt: skip
    raise CheckpointCorruptError(
        f"variable {variable.name!r}: checkpoint {url} is damaged: {detail}{emptied}"
    )


def _repeated_in(rows: DeviceRows, shard: int) -> tuple[Problem, int] | None:
    """A key table shard ``shard`` holds twice, with the files holding it, and how many
    extra copies of keys it holds; None when none."""
    held = rows.shards[shard]
    if held.rows < 2:
        return None
    with on_device(rows.plan.devices[shard]):
        unique, _, counts = tf.unique_with_counts(held.keys)
        extra = held.rows - int(tf.size(unique))
        if not extra:
            return None
        key = unique[tf.argmax(counts)]
        at = np.asarray(tf.where(tf.equal(held.keys, key))[:, 0])
    ends = np.cumsum([n for _, n in held.sources])
    holders = sorted({held.sources[i][0] for i in np.searchsorted(ends, at, side="right")})
    message = f"key {int(key)!r} is held {len(at)} times (in {', '.join(holders)})"
    return Problem(holders[0], message), extra


def load_on_devices(variable: RestoredVariable, rows: DeviceRows, url: str) -> None:
    """Replace ``variable``'s content (and its companions') with ``rows`` (of the
    checkpoint ``url``): each task bulk-loads its table shard's rows, side by side.

    A key the tables find repeated (an empty variable's rows were not checked for one)
    empties the variable, and the error names the key and its files.
    """
    targets = column_targets(variable, rows.plan.entry.columns)
    most = load_rows(variable)
    with variable.exclusive():
        if holds_keys(variable):
            variable.clear()
        shares = [held.rows for held in rows.shards]
        for target in targets.values():
            reserve_shards(target, shares)
        try:
            each(lambda t: _load_shard(targets, t, rows.shards[t], most), list(range(len(shares))))
            repeated = int(variable.size()) != rows.rows
        except RepeatedKeysError:
            repeated = True
        if repeated:
            variable.clear()
            _refuse_repeated(variable, rows, url, " (the variable was emptied)")


def _load_shard(targets: dict[str, SavedVariable], shard: int, held: HeldShard, most: int) -> None:
    """Bulk-load ``held`` into table shard ``shard`` of every column's table, on its task,
    in even batches of at most ``most`` rows (as a restore through this process loads)."""
    if not held.rows:
        return
    start = 0
    with on_device(targets[VALUE_COLUMN].devices[shard]):  # every column's, as companions
        for size in even_sizes(held.rows, most):
            keys = _rows_of(held.keys, start, size, held.rows)
            for column, target in targets.items():
                values = _rows_of(held.columns[column], start, size, held.rows)
                target.shards[shard].load_distinct(keys, values)
            start += size


def _rows_of(tensor: Any, start: int, size: int, rows: int) -> Any:
    """Rows ``start`` to ``start + size - 1`` of ``tensor`` (of ``rows`` rows), sliced on
    the device in scope."""
    return tensor if size == rows else tensor[start : start + size]
