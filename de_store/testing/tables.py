"""Table helpers for tests."""

from __future__ import annotations

import dataclasses

from de_store.tables import HashTable, _kernels


def with_unordered_scatters(table: HashTable) -> HashTable:
    """Make ``table`` run the kernels of a table on a GPU, where a scatter keeps an
    arbitrary writer: its claim races are confirmed and the last of repeated keys picked
    with extra rounds. Those kernels run on a CPU as well, so tests there cover them."""
    return _with_config(table, serial_scatter=False)


def with_row_growth(table: HashTable, reserve: bool) -> HashTable:
    """Make ``table`` grow its row store the way a table on a CPU does (``reserve``: into
    unwritten stores sized for its index) or the way one on a GPU does (a gather), so
    tests on a CPU cover both (``Config.reserve_rows``)."""
    return _with_config(table, reserve_rows=reserve)


def without_lock(table: HashTable) -> HashTable:
    """Make ``table`` run kernels that do not take its mutex: unsafe under concurrent
    calls, for measuring what the lock costs (``benchmarks/table_bench.py``)."""
    return _with_config(table, locked=False)


def _with_config(table: HashTable, **fields: bool) -> HashTable:
    """Make ``table`` run the shared kernels of its config with ``fields`` changed."""
    table._kernels = _kernels.kernels_for(dataclasses.replace(table._kernels.config, **fields))
    return table
