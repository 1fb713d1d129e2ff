"""Checkpoint save and restore of a dynamic embedding table, against raw references.

Measures, through the user path (``de_store.get_variable`` with a ``FileSystemSaver`` and
``tf.train.Checkpoint``), on a local temporary directory:

* ``sync_save_s``: ``Checkpoint.write`` (one process: the rows in the order the table
  holds them), the best of five, each right after a raw write of the same bytes
  (``raw_write_fsync_s``, the best of those five) whose files were deleted before the
  save (so that each finds free the page cache the other just used); ``bucketed_save_s``:
  ``de_store.save(..., bucketed=True)``, the rows grouped by key bucket as a job of
  several processes saves them;
* ``async_block_s`` / ``async_total_s``: ``Checkpoint.save`` with
  ``CheckpointOptions(enable_async=True)`` until it returns / until ``Checkpoint.sync()``
  returns (the first async save, so it includes tracing the snapshot function);
* ``async_next_write_s``: an upsert of 131,072 present keys right after the async save
  returned (it copies the buffers the save's snapshot still holds), next to ``write_s``,
  the same upsert before any save; ``async_stall_*`` in ``ratios`` adds the block and
  what the next write paid more;
* ``restore_s``: ``Checkpoint.read`` in a fresh process, files evicted from the page cache
  first (``import tensorflow`` is timed apart, as ``restore_import_tf_s``), the faster of
  two such processes, after an earlier restore process left its traced kernels and XLA
  executables in de_store's cache directory (one the run starts empty);
  ``restore_cold_cache_s``: that earlier restore;
  ``memory_floor_s``: in that process, after the restore, ``tf.fill`` allocating and first
  touching as many bytes as the restored table holds (the floor memory sets a restore on
  this machine, next to the cold read of the same rows);
  ``dense_index_s``: TensorFlow's own hash table (``DenseHashTable``, sized ahead)
  created for the same rows and inserting them, the plainest way to index the keys the
  restore reads, in a fresh process beside each restore (the faster of two): its buckets
  are new memory, first touched, as the restored table's are;
  ``dense_index_warm_s``: the same in the restore's process after it, where TensorFlow's
  allocator hands out memory the restore touched and freed (faster on this machine, so
  not the restore's reference);
  ``plain_restore_s``: the plainest restore of the same rows, in a fresh process beside
  each restore (the faster of two; ``harness.plain_restore``): a thread reads the raw
  files cold while another inserts each batch into a ``DenseHashTable`` sized ahead. The
  bound above counts the read as free; on a machine of few cores the two compete, and
  this is the floor they set a restore there (``ratios.restore_over_plain_restore``);
  ``repeat_check_s``: the check that no key is held twice, which a restore into a
  variable that holds rows makes before emptying it (``format_<name>_restore_s`` restore
  into such a variable: ``ratios`` gives the check's share of the parquet one);
* ``reshard_restore_s``: the same (the faster of two) into a variable with another number
  of shards (logical CPU devices), after an earlier such restore
  (``reshard_restore_cold_cache_s``: its XLA compiles are for other shapes);
* references on the same bytes (``N * 8`` key bytes + ``N * D * 4`` value bytes):
  ``numpy.tofile`` + fsync, a cold ``numpy.fromfile``, and TF's own checkpoint of a dense
  ``[N, D]`` variable (write, then a cold read in a fresh process); ``bucket_reorder_s``,
  numpy and Arrow putting the rows in key-bucket order (the grouping a bucketed shard
  holds its rows in);
* ``peak_rss_save_bytes``: the process's peak RSS during one more synchronous save, not
  timed (the kernel's high-water mark, reset before it; see ``PeakRss``), next to
  ``rss_before_save_bytes`` and ``table_bytes`` (the table's variables).

Each save also goes through ``de_store.save`` per shard format (``format_<name>_save_s``,
``format_<name>_restore_s``). Ratios to the references are in ``ratios``. Figures on a
shared machine are noisy: compare ratios from the same run.

Usage::

    python benchmarks/checkpoint_bench.py --keys 10000000 --dim 16

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import _harness as harness
import numpy as np
from _harness import (
    FILL_BATCH,
    bucket_reorder,
    drop_cache,
    emit,
    raw_write,
    remove_raw,
    rows,
    sample_rows,
    timed,
)

#: Synchronous saves measured, each after a raw write of the same bytes: the best of each.
SAVE_ROUNDS = 5


# --- helpers shared by the phases ----------------------------------------------------------
class PeakRss:
    """This process's peak RSS over the ``with`` block (``peak``, bytes).

    Linux keeps the peak itself (``VmHWM`` in ``/proc/self/status``), and writing ``5`` to
    ``/proc/self/clear_refs`` resets it to the current RSS: nothing runs beside what is
    measured. Elsewhere a thread samples the RSS every ``interval`` seconds; sampling
    slows the save it samples (a 10M save here takes about twice as long), so no timed
    step runs in this block.
    """

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0

    @staticmethod
    def _high_water_mark() -> int:
        try:
            return harness.proc_status("VmHWM").get("VmHWM", 0)
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakRss:
        self.peak = self._process.memory_info().rss
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, self._high_water_mark())
        self.peak = max(self.peak, self._process.memory_info().rss)


def setup_tf(shards: int) -> tuple[Any, Any, float]:
    """Import TF with ``shards`` logical CPUs; return (tf, de_store, import seconds)."""
    start = time.perf_counter()
    import tensorflow as tf

    import de_store

    seconds = time.perf_counter() - start
    cpu = tf.config.list_physical_devices("CPU")[0]
    if shards > 1:
        config = [tf.config.LogicalDeviceConfiguration() for _ in range(shards)]
        tf.config.set_logical_device_configuration(cpu, config)
    return tf, de_store, seconds


def make_variable(tf: Any, de_store: Any, args: argparse.Namespace, shards: int) -> Any:
    devices = [f"/CPU:{i}" for i in range(shards)] if shards > 1 else None
    saver = de_store.FileSystemSaver(format=args.format)
    return de_store.get_variable(
        "embedding",
        key_dtype=tf.int64,
        value_dtype=tf.float32,
        dim=args.dim,
        devices=devices,
        init_size=args.keys,
        kv_creator=de_store.HashTableCreator(saver=saver),
    )


def table_bytes(variable: Any) -> int:
    total = 0
    for shard in variable.shards:
        size = getattr(shard, "memory_bytes", None)
        if size is not None:
            total += int(size())
        else:
            total += sum(int(np.prod(v.shape)) * v.dtype.size for v in shard.variables)
    return total


# --- phase: save (one process: raw write, fill, saves, TF dense save) -----------------------
def phase_save(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    out["bucket_reorder_s"] = bucket_reorder(args.keys, args.dim)
    tf, de_store, _ = setup_tf(args.shards)
    out.update(table_saves(tf, de_store, args))
    out.update(tf_dense_save(tf, args))
    emit(out)


def table_saves(tf: Any, de_store: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fill the table, then save it: sync (``SAVE_ROUNDS`` timed, one more for the peak
    RSS), async twice, bucketed, each format."""
    out: dict[str, Any] = {}
    variable = make_variable(tf, de_store, args, args.shards)
    start = time.perf_counter()
    for batch_keys, batch_values in rows(args.keys, args.dim):
        variable.upsert(batch_keys, batch_values)
    out["fill_s"] = time.perf_counter() - start
    out["table_keys"] = int(variable.size())
    out["table_bytes"] = table_bytes(variable)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    raw, sync = os.path.join(args.dir, "raw"), os.path.join(args.dir, "sync")
    raw_writes, sync_saves = [], []
    for _ in range(SAVE_ROUNDS):  # the best of each
        # Each finds free the page cache the other just used: memory this virtual machine
        # has not touched lately costs far more to write into (a save right after a raw
        # write whose files are kept takes about twice as long as one after they are gone).
        shutil.rmtree(sync, ignore_errors=True)
        raw_writes.append(raw_write(raw, args.keys, args.dim))
        remove_raw(raw)
        sync_saves.append(timed(lambda: checkpoint.write(os.path.join(sync, "ckpt")))[0])
    out["raw_write_fsync_s"], out["sync_save_s"] = min(raw_writes), min(sync_saves)
    raw_write(raw, args.keys, args.dim)  # for the raw read reference
    with PeakRss() as rss:  # one more save, not timed
        out["rss_before_save_bytes"] = rss.peak
        checkpoint.write(os.path.join(args.dir, "rss", "ckpt"))
    out["peak_rss_save_bytes"] = rss.peak
    options = tf.train.CheckpointOptions(enable_async=True)
    prefix = os.path.join(args.dir, "async", "ckpt")
    step_keys, step_values = next(rows(min(args.keys, 1 << 17), args.dim))
    out["write_s"] = min(  # warm: the first upsert of a batch size traces and compiles
        timed(lambda: variable.upsert(step_keys, step_values))[0] for _ in range(3)
    )
    for suffix in ("", "_second"):
        start = time.perf_counter()
        checkpoint.save(prefix, options=options)
        out[f"async_block{suffix}_s"] = time.perf_counter() - start
        # the first write after the save copies the buffers the snapshot holds
        out[f"async_next_write{suffix}_s"], _ = timed(
            lambda: variable.upsert(step_keys, step_values)
        )
        checkpoint.sync()
        out[f"async_total{suffix}_s"] = time.perf_counter() - start
    url = os.path.join(args.dir, "bucketed")
    out["bucketed_save_s"], _ = timed(
        lambda: de_store.save([variable], url, bucketed=True, blocking=True)
    )
    for name in args.formats:
        url = os.path.join(args.dir, f"format-{name}")
        out[f"format_{name}_save_s"], _ = timed(
            lambda url=url, name=name: de_store.save([variable], url, format=name, blocking=True)
        )
    return out


def tf_dense_save(tf: Any, args: argparse.Namespace) -> dict[str, float]:
    dense = tf.Variable(tf.zeros([args.keys, args.dim], tf.float32))
    for start in range(0, args.keys, FILL_BATCH):
        n = min(FILL_BATCH, args.keys - start)
        dense[start : start + n].assign(tf.random.normal([n, args.dim]))
    checkpoint = tf.train.Checkpoint(dense=dense)
    seconds, _ = timed(lambda: checkpoint.write(os.path.join(args.dir, "dense", "ckpt")))
    return {"tf_dense_save_s": seconds}


# --- phase: restore (a fresh process per restore) ------------------------------------------
def phase_restore(args: argparse.Namespace) -> None:
    drop_cache(args.dir)
    tf, de_store, import_s = setup_tf(args.shards)
    variable = make_variable(tf, de_store, args, args.shards)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    out: dict[str, Any] = {"import_tf_s": import_s}
    out["restore_s"], _ = timed(lambda: checkpoint.read(os.path.join(args.dir, "sync", "ckpt")))
    out["restored_keys"] = int(variable.size())
    out["verified"] = verify(variable, args)
    # the table's bytes allocated and first touched by tf.fill, the restored table alive
    out["memory_floor_s"] = harness.memory_first_touch(tf, table_bytes(variable))
    if args.shards == args.save_shards:
        if args.formats:  # once: the same keys indexed by TensorFlow's own table
            out["dense_index_warm_s"] = harness.dense_index(tf, args.keys, args.dim)
            out["repeat_check_s"] = repeat_check(variable)
        for name in args.formats:
            drop_cache(args.dir)
            url = os.path.join(args.dir, f"format-{name}")
            out[f"format_{name}_restore_s"], _ = timed(
                lambda url=url: de_store.restore([variable], url)
            )
            out["verified"] = out["verified"] and verify(variable, args)
        del checkpoint, variable
        drop_cache(args.dir)
        dense = tf.Variable(tf.zeros([args.keys, args.dim], tf.float32))
        dense_checkpoint = tf.train.Checkpoint(dense=dense)
        path = os.path.join(args.dir, "dense", "ckpt")
        out["tf_dense_restore_s"], _ = timed(lambda: dense_checkpoint.read(path))
    emit(out)


def repeat_check(variable: Any) -> float:
    """Seconds of the check a restore into a variable holding rows makes before emptying
    it (no key held twice), on the restored keys in batches of the reader's size."""
    from de_store.checkpoint.checks import has_repeated_key

    keys = np.asarray(variable.export()[0])
    batches = [keys[i : i + 65536] for i in range(0, len(keys), 65536)]
    seconds, repeated = timed(lambda: has_repeated_key(batches))
    assert not repeated
    return seconds


def verify(variable: Any, args: argparse.Namespace) -> bool:
    keys, values = sample_rows(args.keys, args.dim)
    found, exists = variable.lookup(keys, return_exists=True)
    return bool(np.all(exists.numpy())) and bool(np.array_equal(found.numpy(), values))


def phase_raw_read(args: argparse.Namespace) -> None:
    emit(harness.raw_read(os.path.join(args.dir, "raw"), args.dim))


def phase_dense_index(args: argparse.Namespace) -> None:
    """The restore's indexing reference in a fresh process (no table before it)."""
    import tensorflow as tf

    emit({"dense_index_s": harness.dense_index(tf, args.keys, args.dim)})


def phase_plain_restore(args: argparse.Namespace) -> None:
    """The plainest restore of the rows, reading and indexing at once, in a fresh process."""
    import tensorflow as tf

    emit(harness.plain_restore(tf, os.path.join(args.dir, "raw"), args.dim))


# --- driver -----------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, **changes: Any) -> dict[str, Any]:
    """Run ``phase`` in a fresh Python process; return the figures it printed."""
    values = {**vars(args), **changes}
    options = ["--keys", str(values["keys"]), "--dim", str(values["dim"])]
    options += ["--shards", str(values["shards"]), "--save-shards", str(args.shards)]
    options += ["--format", values["format"], "--dir", values["dir"]]
    options += ["--formats", *values["formats"]]  # none given: "--formats" alone, an empty list
    cache = {"DE_STORE_CACHE_DIR": os.path.join(args.dir, "cache")}
    return harness.run_phase(__file__, phase, options, env=cache)


def ratios(r: dict[str, Any]) -> dict[str, float]:
    out = {
        "sync_save_over_raw_write": r["sync_save_s"] / r["raw_write_fsync_s"],
        "bucketed_save_over_raw_write_and_reorder": r["bucketed_save_s"]
        / (r["raw_write_fsync_s"] + r["bucket_reorder_s"]),
        "async_block_over_sync_save": r["async_block_s"] / r["sync_save_s"],
        "async_block_second_over_sync_save": r["async_block_second_s"] / r["sync_save_s"],
        # what training waits for in all: the save call, and what the next write pays more
        "async_stall_over_sync_save": (r["async_block_s"] + r["async_next_write_s"] - r["write_s"])
        / r["sync_save_s"],
        "async_stall_second_over_sync_save": (
            r["async_block_second_s"] + r["async_next_write_second_s"] - r["write_s"]
        )
        / r["sync_save_s"],
        "restore_over_raw_read": r["restore_s"] / r["raw_read_s"],
        # the floor: the cold read of the same bytes, and the memory the table takes
        "restore_over_raw_read_and_memory": r["restore_s"]
        / (r["raw_read_s"] + r["memory_floor_s"]),
        # the floor of the read and the indexing: the same keys read, then indexed by
        # TensorFlow's own hash table
        "restore_over_raw_read_and_dense_index": r["restore_s"]
        / (r["raw_read_s"] + r["dense_index_s"]),
        # the bound a restore that overlaps its reading and its indexing can reach: the
        # slower of the two (the target: at most 1.2x)
        "restore_over_slower_of_raw_read_and_dense_index": r["restore_s"]
        / max(r["raw_read_s"], r["dense_index_s"]),
        # the floor on this machine's cores: a thread reading while another indexes
        "restore_over_plain_restore": r["restore_s"] / r["plain_restore_s"],
        # the same with the index built in the restore's process after it (warm memory)
        "restore_over_slower_of_raw_read_and_warm_dense_index": r["restore_s"]
        / max(r["raw_read_s"], r["dense_index_warm_s"]),
        "reshard_restore_over_raw_read": r["reshard_restore_s"] / r["raw_read_s"],
        "reshard_restore_over_restore": r["reshard_restore_s"] / r["restore_s"],
        "sync_save_over_tf_dense_save": r["sync_save_s"] / r["tf_dense_save_s"],
        "restore_over_tf_dense_restore": r["restore_s"] / r["tf_dense_restore_s"],
        "repeat_check_over_restore_into_rows": r["repeat_check_s"] / r["format_parquet_restore_s"],
        "peak_rss_save_over_before_mb": (r["peak_rss_save_bytes"] - r["rss_before_save_bytes"])
        / 2**20,
    }
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--shards", type=int, default=1, help="table shards (logical CPUs)")
    parser.add_argument("--reshard", type=int, default=2, help="shards of the reshard restore")
    parser.add_argument("--format", default="parquet", help="format of the FileSystemSaver")
    parser.add_argument("--formats", nargs="*", default=["parquet", "arrow"])
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-shards", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        phases = {
            "save": phase_save,
            "restore": phase_restore,
            "raw_read": phase_raw_read,
            "dense_index": phase_dense_index,
            "plain_restore": phase_plain_restore,
        }
        phases[args.phase](args)
        return
    args.dir = tempfile.mkdtemp(prefix="de_store_ckpt_bench_", dir="/tmp")
    try:
        result: dict[str, Any] = {"keys": args.keys, "dim": args.dim, "format": args.format}
        result.update(run_phase(args, "save"))
        print(f"save phase: {json.dumps(result)}", flush=True)
        reads = [run_phase(args, "raw_read")]
        cold = run_phase(args, "restore", formats=[])  # traces the restore's kernels
        result["restore_cold_cache_s"] = cold["restore_s"]
        reads.append(run_phase(args, "raw_read"))  # beside each restore: the best of two
        result.update(min(reads, key=lambda r: r["raw_read_s"]))
        restore = run_phase(args, "restore")
        indexes = [run_phase(args, "dense_index")]
        plains = [run_phase(args, "plain_restore")]
        again = run_phase(args, "restore", formats=[])
        indexes.append(run_phase(args, "dense_index"))
        plains.append(run_phase(args, "plain_restore"))
        result.update(min(indexes, key=lambda r: r["dense_index_s"]))
        result.update(min(plains, key=lambda r: r["plain_restore_s"]))
        result["restore_import_tf_s"] = restore.pop("import_tf_s")
        result.update(restore)
        result["restore_s"] = min(restore["restore_s"], again["restore_s"])
        result["verified"] = restore["verified"] and again["verified"]
        print(f"restore phase: {json.dumps(restore)}", flush=True)
        reshard = run_phase(args, "restore", shards=args.reshard, formats=[])
        result["reshard_restore_cold_cache_s"] = reshard["restore_s"]
        reshards = [run_phase(args, "restore", shards=args.reshard, formats=[]) for _ in range(2)]
        result["reshard_restore_s"] = min(r["restore_s"] for r in reshards)
        result["reshard_shards"] = args.reshard
        result["reshard_verified"] = all(r["verified"] for r in reshards)
        result["ratios"] = ratios(result)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
