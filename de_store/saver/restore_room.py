"""Tables made ready for a restore's rows while its shards are read: grown once for
their share, the bulk load's kernel readied and its race compiled, side by side.

A restore (:mod:`de_store.saver.restore_read`) runs :func:`grow_for_restore` in a helper
thread for each variable that holds nothing, before it reads the first shard; the loads
(:func:`de_store.saver.rows.apply_rows`) then find the room made and the kernels ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from de_store.checkpoint.variable_rows import even_sizes
from de_store.saver._lazy_tf import tf
from de_store.saver.rows import (
    SavedVariable,
    holds_keys,
    load_rows,
    reserve_shard,
    routes_by_hash,
)

__all__ = ["grow_for_restore"]


def grow_for_restore(variable: SavedVariable, rows: int, shares: Sequence[int]) -> None:
    """Make an empty variable ready for ``rows`` restored rows, of which table shard ``i``
    receives ``shares[i]`` (see :func:`~de_store.saver.rows.restore_shares`): grow its
    tables (its values and the companions it has) and run their bulk load once on no rows
    (the first call of a kernel in a process instantiates it), and have XLA compile, or
    load from its cache, what loading batches of that size compiles.

    A restore runs this in a helper thread while it reads the shards, so that loading
    finds the room made (new memory is slow to touch) and the kernels ready; ``clear``
    keeps the room of a table that holds nothing. A variable that holds keys is left as
    it is: the restore empties it only after every shard was read (all or nothing).
    """
    if holds_keys(variable):
        return
    tables = [variable, *variable.companions().values()]
    most = load_rows(variable)
    if routes_by_hash(variable):  # the batches apply_rows loads into each shard
        batch_rows = [even_sizes(max(share, 1), most)[0] for share in shares]
    else:  # the batches apply_rows loads, split over the shards
        batch_rows = [-(-even_sizes(rows, most)[0] // len(variable.shards))] * len(shares)

    def prepare(shard: int) -> None:
        for table in tables:
            _prepare_shard(table, shard, shares[shard], batch_rows[shard])

    # Each shard's device instantiates its own kernels (mostly outside the GIL): the
    # shards are prepared side by side.
    with ThreadPoolExecutor(len(shares), thread_name_prefix="de_store-grow") as pool:
        for done in [pool.submit(prepare, shard) for shard in range(len(shares))]:
            done.result()


def _prepare_shard(table: SavedVariable, shard: int, share: int, batch_rows: int) -> None:
    """Start compiling shard ``shard`` of ``table``'s load of ``batch_rows`` keys for the
    room of ``share`` rows, then grow it for them, while a helper thread runs its bulk
    load once on no rows (see :func:`grow_for_restore`).

    That first call readies the load's kernel: read from the kernel cache or traced (in
    a new container, Python for tenths of a second), then instantiated on the device. It
    needs the growth done only to run, after both, so the two overlap. The compile goes
    first: it traces what it compiles before it starts (:func:`~de_store.tables._xla.prepare_at`),
    and the kernel's trace then finds that part traced; the compile, the longest of the
    three in a new process, runs beside the kernel's trace and the growth.
    """
    # The shard's core directly: the variable's methods take its lock, which would
    # prepare the shards one after the other.
    core = table.shards[shard]
    if hasattr(core, "compile_load"):  # at the capacity the growth makes, from now on
        with tf.device(table.devices[shard]):
            core.compile_load(batch_rows, room_for=share)
    with ThreadPoolExecutor(1, thread_name_prefix="de_store-load-kernel") as helper:
        ready = helper.submit(_load_nothing, table, shard)
        reserve_shard(table, shard, share)
        ready.result()


def _load_nothing(table: SavedVariable, shard: int) -> None:
    # No rows, made on the default device: TensorFlow 2.21's eager ops with a shape input
    # on a table's device, run by two threads at once (this one and the growth beside
    # it), may swap their inputs (see de_store.tables._locking.EAGER_ON_DEVICE).
    keys = tf.zeros([0], table.key_dtype)
    values = tf.zeros([0, table.dim], table.value_dtype)
    with tf.device(table.devices[shard]):
        table.shards[shard].load_distinct(keys, values)
