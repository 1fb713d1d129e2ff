"""Table helpers for tests."""

from __future__ import annotations

import dataclasses

from de_store.tables import HashTable, _kernels


def with_unordered_scatters(table: HashTable) -> HashTable:
    """Make ``table`` run the kernels of a table on a GPU, where a scatter keeps an
    arbitrary writer: its claim races are confirmed and the last of repeated keys picked
    with extra rounds. Those kernels run on a CPU as well, so tests there cover them."""
    config = dataclasses.replace(table._kernels.config, serial_scatter=False)
    table._kernels = _kernels.kernels_for(config)
    return table


def with_row_growth(table: HashTable, reserve: bool) -> HashTable:
    """Make ``table`` grow its row store the way a process whose CPU allocator hands freed
    memory back does (``reserve``: into unwritten stores sized for its index) or the way
    one whose allocator keeps it does (a gather), whichever this process's allocator is,
    so tests cover both (``Config.reserve_rows``)."""
    config = dataclasses.replace(table._kernels.config, reserve_rows=reserve)
    table._kernels = _kernels.kernels_for(config)
    return table


def without_lock(table: HashTable) -> HashTable:
    """Make ``table`` run kernels that do not take its mutex: unsafe under concurrent
    calls, for measuring what the lock costs (``benchmarks/table_bench.py``)."""
    config = dataclasses.replace(table._kernels.config, locked=False)
    table._kernels = _kernels.kernels_for(config)
    return table
