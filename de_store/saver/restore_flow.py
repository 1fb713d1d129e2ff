"""Restore: a plan built once, then read, then load.

``restore_checkpoint`` is the whole flow; each step is one call away:

1. plan (:mod:`de_store.saver.restore_plan`): the committed manifest, each variable's
   chain (full link + deltas) with every link checked, the parts this rank reads and
   each table shard's share of them, and whether the rows are read on the tables' tasks
   (:mod:`de_store.saver.device_restore`) or streamed into an empty variable
   (:mod:`de_store.saver.streamed`);
2. read (:mod:`de_store.saver.restore_read`): every row the plan names, read and
   checked, no key held twice;
3. load (:mod:`de_store.saver.restore_load`): only then are the tables' contents
   replaced and the deltas applied in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from de_store._memory import release_freed_memory
from de_store.backends import Backend, Location
from de_store.checkpoint import events
from de_store.checkpoint.manifest import Manifest
from de_store.checkpoint.topology import Topology
from de_store.saver.restore_load import load_rows
from de_store.saver.restore_plan import plan_restore
from de_store.saver.restore_read import read_rows
from de_store.saver.rows import RestoredVariable

if TYPE_CHECKING:
    from de_store.saver.core import IOOptions


def restore_checkpoint(
    variables: Sequence[RestoredVariable],
    backend: Backend,
    name: str,
    topology: Topology,
    options: IOOptions,
    check_manifest: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Restore each variable's keys that belong to this rank; all or nothing.

    An incremental checkpoint restores its chain: every link's rows are read first, then
    the full link replaces the tables' content and each delta applies in order. Afterwards
    each variable's next incremental save is a delta on this checkpoint.

    Every link is checked as ``de-store verify`` checks it (:mod:`de_store.checkpoint.checks`):
    its manifest's numbers and its files' sizes before any read, its rows as they are
    read, and no key held twice before any variable that holds rows is emptied. A refused
    restore leaves every variable as it was.

    A variable that holds nothing, restored by one process, loads its full link's rows
    while they are read (:mod:`de_store.saver.streamed`), its chain's deltas read and
    checked before and applied after; when the streaming fails it is emptied and its
    chain is read whole, with retries, like the others'. When the restore fails, every
    variable loaded that way is emptied again: as it was.

    ``check_manifest`` is called with the manifest before anything else is read (the TF
    hook checks there that it is bound to the TF checkpoint being restored).

    Raises
    ------
    CheckpointCorruptError
        A check failed; the message names the file.
    """
    start = time.perf_counter()
    plan = plan_restore(variables, Location(backend, name), topology, options, check_manifest)
    read = read_rows(plan)
    load_rows(plan, read)
    rows = sum(variable.rows for variable in read)
    del read
    release_freed_memory(read_buffers=True)  # the buffers the rows were read into
    events.restored(plan.where.url, topology, rows, plan.links, plan.bytes, start)
    return plan.manifest
