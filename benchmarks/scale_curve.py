"""The cost curve: how fill, save and restore scale with the number of keys and the dim.

For each point ``KEYS:DIM`` of ``--points`` (default 1M, 10M and 50M keys at dim 16, 10M
keys at dims 64 and 128), through the user path (``de_store.get_variable`` with
``HashTableCreator(saver=FileSystemSaver())`` and ``tf.train.Checkpoint``) on a local
folder under ``--dir``. One fresh process per point fills the table and saves it (points
share no memory):

* ``fill_s``: every upsert of the rows into the empty table (no ``init_size``: it grows),
  in batches of 2**20 keys, each batch's numpy rows made outside the timing;
* ``sync_save_s``: ``Checkpoint.write``, the best of ``--rounds``, each right after a raw
  write + fsync of the same bytes whose files were deleted before the save
  (``raw_write_fsync_s``, the best of those made before either kind of save: each finds
  free the page cache the other just used, as ``checkpoint_bench.py`` measures them);
  after it, in the same round, the plainest direct write of the same bytes
  (``raw_direct_write_s``, ``harness.raw_direct_write``: each batch copied into one
  page-aligned buffer and written with ``O_DIRECT``, as a save to a local folder writes
  its files, with no page cache taking pages for them); the raw writes and the save each
  start from settled memory
  (``harness.settle_memory``: the host has taken back what the deletions before freed,
  and every page the process holds was touched since; ``settle_touch_ns_per_page`` says
  how far from that state each settling found it; ``--no-settle`` leaves it out);
* ``async_block_s`` / ``async_total_s``: ``Checkpoint.write`` with
  ``CheckpointOptions(enable_async=True)`` until it returns / until ``Checkpoint.sync()``
  returns, the best of ``--rounds``, each right after a raw write + fsync of the same
  bytes whose files were deleted before it, as the synchronous saves are measured (the
  first one, which traces the snapshot function, is also given apart:
  ``async_first_block_s``, ``async_first_total_s``). Each round makes a synchronous and
  an async save, the two taking turns going first: a save's time at 50M moves with the
  memory the page cache is handed, which changes over the rounds (``sync_save_rounds_s``,
  ``async_total_rounds_s``, ``async_block_rounds_s``);
* ``async_block_again_s``: the block of one more async save in each round, made as soon as
  ``sync()`` returned for the one before, with nothing written or deleted between them and
  no settling, as a training loop saves every so many steps (the best of ``--rounds``;
  ``async_block_again_rounds_s``);
* ``peak_rss_save_bytes``: the process's peak RSS over one more synchronous save after the
  timed ones, not timed, the checkpoint the restores read (the kernel's high-water mark,
  reset right before it: ``checkpoint_bench.PeakRss``),
  next to ``rss_before_save_bytes``, ``rss_after_import_bytes`` (TensorFlow and de_store
  imported, no table yet) and ``table_bytes`` (the table's index and its rows in use:
  the rows a store holds past them, unwritten or copied by a growth, count as overhead).
  The fill's growths leave memory in TensorFlow's CPU allocator that the save finds there; the
  first restore process measures a save too (``restored_peak_rss_save_bytes``, against
  ``restored_table_bytes``), a process whose table was sized once, as after a restart,
  and ``peak_rss_restore_bytes``, its peak over the restore;
* ``saved_bytes``: the checkpoint folder's bytes on disk, next to ``raw_bytes``
  (``N * 8`` key bytes + ``N * dim * 4`` value bytes).

A reference for the fill, in one more fresh process: ``dense_fill_s``, TensorFlow's own
hash table (``DenseHashTable``, C++, created empty) filled with the same batches, growing
as they come (``harness.dense_fill``). Its memory comes from the same allocator and the
same machine, so its per-key growth from one point to the next is the floor that memory
sets for any growing fill (``dense_fill_per_key_growth`` in ``targets``). That process's
peak RSS (``dense_fill_peak_rss_bytes``, next to ``dense_fill_rss_after_import_bytes``)
is what the allocator keeps of a growing table that is TensorFlow's own:
``dense_fill_rss_over_rows_and_runtime_mb`` leaves out the rows' bytes (``raw_bytes``)
and the runtime, as ``rss_over_rows_and_runtime_mb`` does for de_store's fill process.
A reference for that memory, in one more fresh process: the plainest growing store
(``harness.plain_growth``: one variable of values and one of keys, doubled when a batch
does not fit, no index) takes the same batches (``plain_growth_s``; ``None``, with
``plain_growth_error``, where a growth found no room in the allocator's pool); what its process
holds after them over the rows' bytes and the runtime
(``plain_growth_rss_over_rows_and_runtime_mb``) is what the allocator keeps of the
buffers that any table growing its rows in one buffer frees. ``rss_at_plain_growth_floor``
in ``targets``: de_store's fill process, while saving, held no more over its table (index
and rows in use) and the runtime.

Then ``--restores`` fresh processes each read the checkpoint into a new variable after
its files were dropped from the page cache (``restore_s``, the fastest; ``restore_first_s``
the first; ``import tensorflow`` timed apart), each verified (the first 1000 rows of every
batch read back exactly), and as many raw cold reads of the same bytes beside them
(``raw_read_s``, the fastest; ``numpy.fromfile``) and as many loads of the same rows into
a ``DenseHashTable`` sized ahead, each in a fresh process whose buckets are new memory as
the restored table's are (``dense_load_s``, the fastest; ``harness.dense_index``).
``restore_over_slower_of_read_and_dense_load`` is the restore over the slower of the two
(issue 37's bound: at most 1.2x at 10M and 50M, ``restore_bound`` in ``targets``). That
bound counts the read as free; on a machine of few cores the reading and the indexing
compete for them. So beside each restore, one more fresh process runs the plainest
restore of the same rows (``harness.plain_restore``: a thread reads the raw files cold
while the other inserts each batch into a ``DenseHashTable`` sized ahead):
``plain_restore_s``, the fastest, and ``restore_over_plain_restore``, the floor this
machine sets a restore.

Every process finds the kernels that a warm-up (a fill, save and restore of
``--warmup-keys`` keys at each dim of the run, not reported) left in a cache directory the
run starts empty, as every process after the first on a machine does: the warm-up traces
every kernel it runs (``_kernels.TRACE_AFTER_S`` set to 0 there, as if it had run its bulk
calls longer). XLA compiles are paid inside every point.

Memory state: ``memory_floor_s`` is, in each point's first restore process, ``tf.fill``
allocating and first touching as many bytes as the restored table holds
(``harness.memory_first_touch``, after the save), and ``memory_s_per_gb`` that per GiB.
On the project's virtual machines memory the guest has not touched since boot costs about
2.4 s per GiB and memory touched before about 0.3 s (``table_bench.py``):
``memory_state`` calls a run ``first touch after boot`` when its largest table took over
1.5 s per GiB, else ``warm``.

Per-key costs (``per_key``, seconds / keys) of every step and reference, for each point;
``growth`` gives, for each dim, each point's per-key costs over those of the next smaller
point of that dim. ``targets`` checks the issue's bars for the most measured dim: at its
largest point, per-key cost at most 1.3x that of the next smaller point for every step,
and peak RSS while saving at most the table's bytes + 512 MiB, in the fill process and in
the restore process (``rss_over_table_and_runtime_mb`` leaves out the RSS the imported
runtime holds before any table exists as well); at each of its points from 10M keys on,
the restore at most 1.2x the slower of its raw read and its Dense load.

Usage::

    python benchmarks/scale_curve.py
    python benchmarks/scale_curve.py --points 1M:16,2M:16 --plot /tmp/curve.png
    python benchmarks/scale_curve.py --points 10M:16,50M:16 --allocator system

``--allocator system`` runs every process with ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1``:
TensorFlow then allocates with malloc and free instead of oneDNN's BFC allocator, which
keeps the buffers a growing table frees (``allocator`` in the JSON says which ran). A
table on the CPU grows its row store into unwritten stores under either (``row_growth``,
read from the fill process's table; docs/architecture.md, *The memory of a growing
table*).

Prints a table, writes a PNG (per-key seconds of each step and reference against keys, log
x; peak RSS while saving over the table's bytes, MiB) to ``--plot`` and the JSON beside it
(``--json``); the last stdout line is that JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import time
from typing import Any

import _harness as harness
from checkpoint_bench import PeakRss
from tfra_bench import folder_bytes

DEFAULT_POINTS = "1M:16,10M:16,50M:16,10M:64,10M:128"
MIB = 1 << 20
#: Peak RSS while saving may exceed the table's bytes by this much (issue 37's bar).
RSS_ALLOWANCE = 512 * MIB
#: Per-key cost of the largest point over the next smaller one (issue 37's bar).
GROWTH_BOUND = 1.3
#: A restore over the slower of its raw read and its Dense load (issue 37's bar), at and
#: past ``RESTORE_BOUND_KEYS`` keys.
RESTORE_BOUND = 1.2
RESTORE_BOUND_KEYS = 10_000_000
#: Seconds per GiB of first touch above which memory counts as untouched since boot.
FIRST_TOUCH_S_PER_GIB = 1.5
STEPS = ("fill", "sync_save", "async_block", "async_block_again", "async_total", "restore")
REFERENCES = (
    "raw_write_fsync",
    "raw_direct_write",
    "raw_read",
    "dense_fill",
    "dense_load",
    "plain_restore",
)
UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}
#: TensorFlow's switch from oneDNN's CPU allocator (a BFC allocator, which keeps the
#: buffers freed in it) to malloc and free (``--allocator system``).
SYSTEM_ALLOCATOR = "TF_ONEDNN_USE_SYSTEM_ALLOCATOR"


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1M:16,2M:16"`` -> ``[(1000000, 16), (2000000, 16)]``."""
    points = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        keys, _, dim = item.partition(":")
        scale = UNITS.get(keys[-1:].upper(), 1)
        number = keys[:-1] if scale > 1 else keys
        if not dim.isdigit() or not number.replace(".", "", 1).isdigit():
            raise ValueError(f"--points: {item!r} is not KEYS:DIM (as 10M:16)")
        points.append((int(float(number) * scale), int(dim)))
    return points


def label(keys: int) -> str:
    for suffix, scale in reversed(UNITS.items()):
        if keys >= scale and keys % scale == 0:
            return f"{keys // scale}{suffix}"
    return str(keys)


# --- phases, each in a fresh process -------------------------------------------------------
def import_tf() -> tuple[Any, Any, float]:
    start = time.perf_counter()
    import tensorflow as tf

    import de_store

    return tf, de_store, time.perf_counter() - start


def make_variable(tf: Any, de_store: Any, dim: int) -> Any:
    """The variable as a user makes it: no ``init_size``, so a fill grows it from empty."""
    creator = de_store.HashTableCreator(saver=de_store.FileSystemSaver())
    return de_store.get_variable(
        "embedding", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, kv_creator=creator
    )


def table_bytes(variable: Any) -> int:
    """The bytes of the table's index and of its rows in use (handed out): the rows a store
    holds past them (left unwritten by a new store, copies of its last row after a
    growth) are not the table's data."""
    from de_store.tables._variables import eager_length

    total = 0
    for table in variable.shards:
        used = int(table.next_row.numpy())
        unwritten = 0
        for store in (table.values, table.row_keys, table.stamps):
            rows = eager_length(store)
            if rows > used:  # the stamps of a table without change tracking stay empty
                row_bytes = store.dtype.size * store.shape[1:].num_elements()
                unwritten += (rows - used) * row_bytes
        total += table.memory_bytes() - unwritten
    return total


def current_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def phase_fill_save(args: argparse.Namespace) -> None:
    os.makedirs(args.work, exist_ok=True)
    tf, de_store, import_s = import_tf()
    if args.warmup:  # traces every kernel it runs, as a process that ran longer would
        from de_store.tables import _kernels

        _kernels.TRACE_AFTER_S = 0.0
    out: dict[str, Any] = {"import_s": import_s, "rss_after_import_bytes": current_rss()}
    variable = make_variable(tf, de_store, args.dim)
    out.update(fill(tf, variable, args))
    out["table_keys"], out["table_bytes"] = int(variable.size()), table_bytes(variable)
    reserves = variable.shards[0]._kernels.config.reserve_rows
    out["row_growth"] = "reserve" if reserves else "gather"  # by the table's device
    checkpoint = tf.train.Checkpoint(embedding=variable)
    out.update(timed_saves(tf, checkpoint, args))
    with PeakRss() as rss:  # one more save, not timed: the checkpoint the restores read
        out["rss_before_save_bytes"] = rss.peak
        checkpoint.write(os.path.join(args.work, "sync", "ckpt"))
    out["peak_rss_save_bytes"] = rss.peak
    harness.raw_write(os.path.join(args.work, "raw"), args.keys, args.dim)  # for raw reads
    for table in variable.all_tables() if args.warmup else []:  # their traces written
        for trace in list(table._kernels._traces.values()):
            trace.result()
    harness.emit(out)


def fill(tf: Any, variable: Any, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of every upsert into the empty table (the rows are made outside the timing);
    ``first_upsert_s`` is the first batch's."""
    seconds, first = 0.0, None
    for batch_keys, batch_values in harness.rows(args.keys, args.dim):
        start = time.perf_counter()
        variable.upsert(tf.constant(batch_keys), tf.constant(batch_values))
        seconds += time.perf_counter() - start
        first = seconds if first is None else first
    start = time.perf_counter()
    variable.size().numpy()  # every upsert done
    return {"fill_s": seconds + time.perf_counter() - start, "first_upsert_s": first or 0.0}


def timed_saves(tf: Any, checkpoint: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds of a synchronous and an async save, each right after a raw write
    of the same bytes whose files were deleted before it (each finds free the page cache
    the other just used), the two saves taking turns going first, and one more async save
    right after each async one: the best raw write, the best of each save (the async one
    until it returned and until ``sync()`` returned; the one after it until it returned), the
    first async save's (which traces the snapshot), and the saved checkpoint's bytes."""
    options = tf.train.CheckpointOptions(enable_async=True)
    raw = os.path.join(args.work, "raw")
    raw_writes: list[float] = []
    direct_writes: list[float] = []
    saves: list[float] = []
    blocked: list[float] = []
    again: list[float] = []
    totals: list[float] = []
    saved_bytes = 0

    settled: list[float] = []

    def settle() -> None:
        if not args.no_settle:
            settled.append(harness.settle_memory()["touch_ns_per_page"])

    def after_raw_write() -> None:
        settle()
        raw_writes.append(harness.raw_write(raw, args.keys, args.dim))
        harness.remove_raw(raw)
        settle()
        direct_writes.append(harness.raw_direct_write(raw, args.keys, args.dim))
        harness.remove_raw(raw)
        settle()

    def sync_save() -> None:
        nonlocal saved_bytes
        folder = os.path.join(args.work, "sync")
        after_raw_write()
        saves.append(harness.timed(lambda: checkpoint.write(os.path.join(folder, "ckpt")))[0])
        saved_bytes = folder_bytes(folder)
        # Deleted: the saves after this one find the page cache as this one found it,
        # holding no checkpoint of this table (with one still cached, 3.7 GB at 50M x 16,
        # an async save's writing thread spent about 1.5x the system time in its writes).
        shutil.rmtree(folder)

    def async_save() -> None:
        folder = os.path.join(args.work, "async")
        after_raw_write()
        start = time.perf_counter()
        checkpoint.write(os.path.join(folder, "ckpt"), options=options)
        blocked.append(time.perf_counter() - start)
        checkpoint.sync()
        totals.append(time.perf_counter() - start)
        start = time.perf_counter()  # the next save of a training loop: nothing freed since
        checkpoint.write(os.path.join(folder, "again"), options=options)
        again.append(time.perf_counter() - start)
        checkpoint.sync()
        shutil.rmtree(folder)

    for index in range(args.rounds):
        for save in (sync_save, async_save) if index % 2 == 0 else (async_save, sync_save):
            save()
    return {
        "raw_write_fsync_s": min(raw_writes),
        "raw_direct_write_s": min(direct_writes),
        "raw_write_rounds_s": raw_writes,
        "raw_direct_write_rounds_s": direct_writes,
        "sync_save_s": min(saves),
        "saved_bytes": saved_bytes,
        "raw_bytes": args.keys * (8 + 4 * args.dim),
        "async_block_s": min(blocked),
        "async_block_again_s": min(again),
        "async_total_s": min(totals),
        "async_first_block_s": blocked[0],
        "async_first_total_s": totals[0],
        "sync_save_rounds_s": saves,
        "async_total_rounds_s": totals,
        "async_block_rounds_s": blocked,
        "async_block_again_rounds_s": again,
        "settle_touch_ns_per_page": settled,
    }


def phase_restore(args: argparse.Namespace) -> None:
    tf, de_store, import_s = import_tf()
    variable = make_variable(tf, de_store, args.dim)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    out: dict[str, Any] = {"import_s": import_s}
    prefix = os.path.join(args.work, "sync", "ckpt")
    out["restore_s"], _ = harness.timed(lambda: checkpoint.read(prefix))
    out["restored_keys"] = int(variable.size())
    if args.first:  # the memory of the restore and a save, before the rows are verified
        out["peak_rss_restore_bytes"] = PeakRss._high_water_mark()  # the process's so far
        save_prefix = os.path.join(args.work, "restored", "ckpt")
        with PeakRss() as rss:  # a save by a process that restored the table, not timed
            out["restored_rss_before_save_bytes"] = rss.peak
            checkpoint.write(save_prefix)
        out["restored_peak_rss_save_bytes"] = rss.peak
        shutil.rmtree(os.path.dirname(save_prefix))
    keys, values = harness.sample_rows(args.keys, args.dim)
    found, exists = variable.lookup(tf.constant(keys), return_exists=True)
    out["verified"] = bool(exists.numpy().all()) and bool((found.numpy() == values).all())
    if args.first:
        # last: the memory tf.fill touches and frees stays in TensorFlow's allocator
        out["memory_floor_s"] = harness.memory_first_touch(tf, table_bytes(variable))
        out["memory_floor_bytes"] = table_bytes(variable)
    harness.emit(out)


def phase_raw_read(args: argparse.Namespace) -> None:
    harness.emit(harness.raw_read(os.path.join(args.work, "raw"), args.dim))


def phase_dense_fill(args: argparse.Namespace) -> None:
    tf, _, _ = import_tf()
    out: dict[str, Any] = {"dense_fill_rss_after_import_bytes": current_rss()}
    out["dense_fill_s"] = harness.dense_fill(tf, args.keys, args.dim)
    out["dense_fill_peak_rss_bytes"] = PeakRss._high_water_mark()  # the process's so far
    harness.emit(out)


def phase_plain_growth(args: argparse.Namespace) -> None:
    tf, _, _ = import_tf()
    out: dict[str, Any] = {"plain_growth_rss_after_import_bytes": current_rss()}
    # held after the fill, as the fill process holds it when it saves (no growth then)
    try:
        seconds, rss = harness.plain_growth(tf, args.keys, args.dim, after=current_rss)
    except tf.errors.ResourceExhaustedError as error:  # the allocator's pool gave out
        seconds, rss = None, None
        out["plain_growth_error"] = error.message.splitlines()[0]
    out["plain_growth_s"], out["plain_growth_rss_after_fill_bytes"] = seconds, rss
    harness.emit(out)


def phase_dense_load(args: argparse.Namespace) -> None:
    tf, _, _ = import_tf()
    harness.emit({"dense_load_s": harness.dense_index(tf, args.keys, args.dim)})


def phase_plain_restore(args: argparse.Namespace) -> None:
    tf, _, _ = import_tf()
    harness.emit(harness.plain_restore(tf, os.path.join(args.work, "raw"), args.dim))


PHASES = {
    "fill_save": phase_fill_save,
    "restore": phase_restore,
    "raw_read": phase_raw_read,
    "dense_fill": phase_dense_fill,
    "plain_growth": phase_plain_growth,
    "dense_load": phase_dense_load,
    "plain_restore": phase_plain_restore,
}


# --- driver ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, phase: str, keys: int, dim: int, *extra: str) -> dict:
    options = ["--keys", str(keys), "--dim", str(dim), "--work", args.work]
    options += ["--rounds", str(args.rounds), *(["--no-settle"] if args.no_settle else []), *extra]
    env = {"DE_STORE_CACHE_DIR": os.path.join(args.run_dir, "cache")}
    if args.allocator == "system":
        env[SYSTEM_ALLOCATOR] = "1"
    return harness.run_phase(__file__, phase, options, env=env)


def measure_point(
    args: argparse.Namespace, keys: int, dim: int, count: int, warmup: bool = False
) -> dict:
    """One point: fill and save in one process, then ``count`` restores and as many raw
    reads, Dense loads and plain restores, each in its own process; then the Dense fill;
    the point's files are removed afterwards."""
    args.work = os.path.join(args.run_dir, f"{label(keys)}-{dim}")
    try:
        point: dict[str, Any] = {"keys": keys, "dim": dim}
        point.update(run(args, "fill_save", keys, dim, *(["--warmup"] if warmup else [])))
        restores, reads, loads, plains = [], [], [], []
        for i in range(count):
            point["cold_reads"] = harness.cold_read_setup(os.path.join(args.work, "sync"))
            flag = ["--first"] if i == 0 else []
            restores.append(run(args, "restore", keys, dim, *flag))
            reads.append(run(args, "raw_read", keys, dim))
            loads.append(run(args, "dense_load", keys, dim))
            plains.append(run(args, "plain_restore", keys, dim))
        point.update(run(args, "dense_fill", keys, dim))
        point.update(run(args, "plain_growth", keys, dim))
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    first = restores[0]
    point["restore_import_s"] = first["import_s"]
    point["restore_first_s"] = first["restore_s"]
    point["restore_s"] = min(r["restore_s"] for r in restores)
    point["restored_keys"] = first["restored_keys"]
    point["verified"] = all(r["verified"] and r["restored_keys"] == keys for r in restores)
    point["raw_read_s"] = min(r["raw_read_s"] for r in reads)
    point["dense_load_s"] = min(r["dense_load_s"] for r in loads)
    point["plain_restore_s"] = min(r["plain_restore_s"] for r in plains)
    for name in ("peak_rss_restore", "restored_rss_before_save", "restored_peak_rss_save"):
        point[f"{name}_bytes"] = first[f"{name}_bytes"]
    point["restored_table_bytes"] = first["memory_floor_bytes"]
    point["memory_floor_s"] = first["memory_floor_s"]
    point["memory_s_per_gb"] = first["memory_floor_s"] / (first["memory_floor_bytes"] / 2**30)
    point.update(derived(point))
    return point


def derived(point: dict[str, Any]) -> dict[str, Any]:
    """A point's per-key costs and its ratios to the same run's references."""
    per_key = {s: point[f"{s}_s"] / point["keys"] for s in STEPS + REFERENCES}
    return {
        "per_key": per_key,
        "sync_save_over_raw_write": point["sync_save_s"] / point["raw_write_fsync_s"],
        "async_total_over_raw_write": point["async_total_s"] / point["raw_write_fsync_s"],
        "sync_save_over_raw_direct_write": point["sync_save_s"] / point["raw_direct_write_s"],
        "async_total_over_raw_direct_write": point["async_total_s"] / point["raw_direct_write_s"],
        "async_block_over_sync_save": point["async_block_s"] / point["sync_save_s"],
        "fill_over_dense_fill": point["fill_s"] / point["dense_fill_s"],
        "restore_over_raw_read": point["restore_s"] / point["raw_read_s"],
        "restore_over_slower_of_read_and_dense_load": point["restore_s"]
        / max(point["raw_read_s"], point["dense_load_s"]),
        "restore_over_plain_restore": point["restore_s"] / point["plain_restore_s"],
        "saved_over_raw_bytes": point["saved_bytes"] / point["raw_bytes"],
        "rss_over_table_mb": (point["peak_rss_save_bytes"] - point["table_bytes"]) / MIB,
        # what the table, the fill and the save hold beyond the imported runtime
        "rss_over_table_and_runtime_mb": (
            point["peak_rss_save_bytes"] - point["table_bytes"] - point["rss_after_import_bytes"]
        )
        / MIB,
        # the same over the rows' bytes, as for the Dense fill (whose buckets hold more)
        "rss_over_rows_and_runtime_mb": over_rows_and_runtime_mb(
            point, "peak_rss_save_bytes", "rss_after_import_bytes"
        ),
        "dense_fill_rss_over_rows_and_runtime_mb": over_rows_and_runtime_mb(
            point, "dense_fill_peak_rss_bytes", "dense_fill_rss_after_import_bytes"
        ),
        "plain_growth_rss_over_rows_and_runtime_mb": over_rows_and_runtime_mb(
            point, "plain_growth_rss_after_fill_bytes", "plain_growth_rss_after_import_bytes"
        ),
        "rss_added_by_save_mb": (point["peak_rss_save_bytes"] - point["rss_before_save_bytes"])
        / MIB,
        # the same save in a process that restored the table (no growth behind it)
        "restored_rss_over_table_mb": (
            point["restored_peak_rss_save_bytes"] - point["restored_table_bytes"]
        )
        / MIB,
    }


def over_rows_and_runtime_mb(point: dict[str, Any], rss: str, after_import: str) -> float | None:
    """MiB of the RSS ``point[rss]`` over the rows' bytes and the RSS its process held after
    its imports (``point[after_import]``); ``None`` where the process ran out of memory."""
    if point[rss] is None:
        return None
    return float(point[rss] - point["raw_bytes"] - point[after_import]) / MIB


def growth(points: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """For each dim, each point's per-key costs over those of the next smaller point."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for dim in sorted({p["dim"] for p in points}):
        series = sorted((p for p in points if p["dim"] == dim), key=lambda p: p["keys"])
        for small, large in itertools.pairwise(series):
            name = f"{label(large['keys'])}_over_{label(small['keys'])}"
            out.setdefault(f"dim{dim}", {})[name] = {
                step: round(large["per_key"][step] / small["per_key"][step], 3)
                for step in STEPS + REFERENCES
            }
    return out


def targets(points: list[dict[str, Any]], grown: dict[str, Any]) -> dict[str, Any]:
    """Issue 37's bars for the dim with the most points (see the module's docstring)."""
    dims = [p["dim"] for p in points]
    dim = max(set(dims), key=lambda d: (dims.count(d), -d))
    largest = max((p for p in points if p["dim"] == dim), key=lambda p: p["keys"])
    out: dict[str, Any] = {"dim": dim, "keys": largest["keys"]}
    pairs = grown.get(f"dim{dim}", {})
    if pairs:
        name, ratios = list(pairs.items())[-1]
        steps = {s: ratios[s] for s in STEPS}
        out["growth"] = name
        out["per_key_growth"] = steps
        out["per_key_growth_met"] = {s: r <= GROWTH_BOUND for s, r in steps.items()}
        # the floor of a fill: TensorFlow's own table, growing in the same memory
        out["dense_fill_per_key_growth"] = ratios["dense_fill"]
    bounded = [p for p in points if p["dim"] == dim and p["keys"] >= RESTORE_BOUND_KEYS]
    bounded.sort(key=lambda p: p["keys"])
    bound = {label(p["keys"]): round(p["restore_over_slower_of_read_and_dense_load"], 3)
             for p in bounded}  # fmt: skip
    out["restore_bound"] = bound
    out["restore_bound_met"] = {name: r <= RESTORE_BOUND for name, r in bound.items()}
    out["restore_over_plain_restore"] = {  # the floor on this machine's cores
        label(p["keys"]): round(p["restore_over_plain_restore"], 3) for p in bounded
    }
    out["rss_over_table_mb"] = round(largest["rss_over_table_mb"], 1)
    out["rss_over_table_and_runtime_mb"] = round(largest["rss_over_table_and_runtime_mb"], 1)
    out["runtime_rss_mb"] = round(largest["rss_after_import_bytes"] / MIB, 1)
    # what the allocator keeps of TensorFlow's own growing table, and of de_store's
    out["rss_over_rows_and_runtime_mb"] = round(largest["rss_over_rows_and_runtime_mb"], 1)
    out["dense_fill_rss_over_rows_and_runtime_mb"] = round(
        largest["dense_fill_rss_over_rows_and_runtime_mb"], 1
    )
    plain = largest["plain_growth_rss_over_rows_and_runtime_mb"]
    out["plain_growth_rss_over_rows_and_runtime_mb"] = None if plain is None else round(plain, 1)
    # the floor the allocator sets: each process holds its own data (de_store's table,
    # index included; the plain store's rows) and the runtime, and over them what the
    # growths left in the allocator; de_store's no more than the plain store's
    # (where the plain store ran out of the allocator's pool, de_store's fill completed)
    out["rss_at_plain_growth_floor"] = (
        plain is None or largest["rss_over_table_and_runtime_mb"] <= plain
    )
    out["restored_rss_over_table_mb"] = round(largest["restored_rss_over_table_mb"], 1)
    out["restored_rss_met"] = largest["restored_rss_over_table_mb"] * MIB <= RSS_ALLOWANCE
    out["rss_met"] = largest["peak_rss_save_bytes"] <= largest["table_bytes"] + RSS_ALLOWANCE
    return out


def machine_state() -> dict[str, Any]:
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return {"uptime_s": round(uptime), "load_average": [round(x, 2) for x in os.getloadavg()]}


def memory_state(points: list[dict[str, Any]]) -> str:
    """How the largest restored table's first touch ran (see the module's docstring)."""
    largest = max(points, key=lambda p: p["restored_table_bytes"])
    return (
        "first touch after boot" if largest["memory_s_per_gb"] > FIRST_TOUCH_S_PER_GIB else "warm"
    )


# --- output ---------------------------------------------------------------------------------
def print_table(points: list[dict[str, Any]]) -> None:
    """Seconds and nanoseconds per key of each step and reference, and the peak RSS while
    saving over the table's bytes (MiB) in the fill process and in a restore process."""
    columns = STEPS + REFERENCES
    header = "".join(f"{c:>19}" for c in columns) + f"{'RSS-table MiB':>16}{'restored':>10}"
    print("point      " + header)
    for p in points:
        cells = "".join(f"{p[f'{c}_s']:>10.3f} s{p['per_key'][c] * 1e9:>6.1f}ns" for c in columns)
        rss = f"{p['rss_over_table_mb']:>16.0f}{p['restored_rss_over_table_mb']:>10.0f}"
        print(f"{label(p['keys']) + ':' + str(p['dim']):<11}{cells}{rss}")


def draw(result: dict[str, Any], path: str) -> None:
    """Per-key seconds of each step and reference against keys (log x, log y), one line per
    dim; peak RSS while saving over the table's bytes (MiB), with and without the RSS of
    the imported runtime, what the save added, and the bar (512 MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    figure, (costs, memory) = plt.subplots(1, 2, figsize=(14, 5.5))
    markers = dict(zip(sorted({p["dim"] for p in points}), "osD^v", strict=False))
    for i, step in enumerate(STEPS + REFERENCES):
        style = "--" if step in REFERENCES else "-"
        for dim, marker in markers.items():
            series = sorted((p for p in points if p["dim"] == dim), key=lambda p: p["keys"])
            costs.plot(
                [p["keys"] for p in series],
                [p["per_key"][step] for p in series],
                style,
                marker=marker,
                color=f"C{i}",
                label=step if dim == min(markers) else None,
            )
    for axes in (costs, memory):  # one legend entry per dim: its marker
        for dim, marker in markers.items():
            axes.plot([], [], marker, color="gray", label=f"dim {dim}")
    costs.set(xscale="log", yscale="log", xlabel="keys", ylabel="seconds per key")
    costs.set_title("per-key cost of each step; references dashed (raw write, read, Dense)")
    costs.legend(fontsize=7, ncol=2)
    figures = (
        ("rss_over_table_mb", "-", "C0", "peak RSS while saving - table"),
        ("rss_over_table_and_runtime_mb", "-", "C2", "the same - RSS after import"),
        ("rss_added_by_save_mb", "--", "C1", "added by the save"),
        ("restored_rss_over_table_mb", "-.", "C4", "a process that restored it"),
        # the floor the allocator sets: TensorFlow's own growing table (over its rows)
        ("dense_fill_rss_over_rows_and_runtime_mb", ":", "C7", "Dense fill - rows - runtime"),
        # and the plainest growing store (one buffer, doubled), over its rows
        ("plain_growth_rss_over_rows_and_runtime_mb", ":", "C8", "plain growth - rows - runtime"),
    )
    for dim, marker in markers.items():
        series = sorted((p for p in points if p["dim"] == dim), key=lambda p: p["keys"])
        for name, style, color, text in figures:
            shown = [p for p in series if p[name] is not None]  # None: out of memory
            memory.plot([p["keys"] for p in shown], [p[name] for p in shown], style,
                        marker=marker, color=color,
                        label=text if dim == min(markers) else None)  # fmt: skip
    memory.axhline(RSS_ALLOWANCE / MIB, color="C3", linestyle=":", label="bar: 512 MiB")
    memory.set(xscale="log", xlabel="keys", ylabel="MiB")
    memory.set_title("peak RSS while saving over the table's bytes")
    memory.legend(fontsize=7)
    figure.suptitle(f"de_store cost curve ({result['memory_state']} memory)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- main -----------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=DEFAULT_POINTS, help="KEYS:DIM,... (1M:16)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="local folder to save in")
    parser.add_argument("--plot", default="docs/scale_curve.png")
    parser.add_argument("--json", default=None, help="default: --plot's path, .json")
    parser.add_argument(
        "--rounds", type=int, default=3, help="sync and async saves, each after a raw write"
    )
    parser.add_argument("--restores", type=int, default=2, help="restore processes a point")
    parser.add_argument("--warmup-keys", type=int, default=1 << 20)
    parser.add_argument(
        "--allocator",
        choices=("default", "system"),
        default="default",
        help=f"system: every process runs with {SYSTEM_ALLOCATOR}=1",
    )
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="time each save and raw write without settling the memory before it",
    )
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--keys", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.phase is not None:
        PHASES[args.phase](args)
        return
    points = parse_points(args.points)
    result: dict[str, Any] = {
        "points_asked": args.points,
        "allocator": args.allocator,
        "settled": not args.no_settle,
    }
    result["machine_before"] = machine_state()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    args.run_dir = tempfile.mkdtemp(prefix="de_store_scale_curve_", dir=args.dir)
    try:
        for dim in sorted({dim for _, dim in points}):  # fills the run's kernel cache
            measure_point(args, args.warmup_keys, dim, count=1, warmup=True)
        result["points"] = []
        for keys, dim in points:
            result["points"].append(measure_point(args, keys, dim, args.restores))
            print(f"{label(keys)}:{dim}: {json.dumps(result['points'][-1])}", flush=True)
    finally:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    result["machine_after"] = machine_state()
    result["memory_state"] = memory_state(result["points"])
    result["growth"] = growth(result["points"])
    result["targets"] = targets(result["points"], result["growth"])
    print_table(result["points"])
    speeds = ", ".join(f"{p['memory_s_per_gb']:.2f}" for p in result["points"])
    print(f"memory state: {result['memory_state']} (first touch, s per GiB: {speeds})")
    print(f"targets: {json.dumps(result['targets'])}")
    draw(result, args.plot)
    with open(args.json or os.path.splitext(args.plot)[0] + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
