"""de_store against TFRA 0.8.1: filling a table, saving it, restoring it in a fresh process.

Both sides go through the same user path, each with its own library: ``get_variable`` with
a ``FileSystemSaver`` in its ``kv_creator`` (TFRA: ``CuckooHashTableCreator``, de_store:
``HashTableCreator``), ``upsert`` in batches of 1M keys, and ``tf.train.Checkpoint``. For
each side, one fresh process fills the table and saves it, and another restores it after
the page cache was dropped:

* ``{side}_fill_s``: ``get_variable`` and every upsert of the rows into the empty table,
  each trace and XLA compile included (``{side}_first_upsert_s`` is the first batch's);
* ``{side}_save_s``: ``Checkpoint.write``;
* ``{side}_restore_s``: ``Checkpoint.read`` into a new variable; ``{side}_restored_keys``
  and ``{side}_verified`` (the first 1000 rows of every batch read back exactly);
* ``{side}_import_s``: importing the library and TensorFlow, timed apart (de_store's
  modules are imported on first use: the phase asks for the ones it uses here);
* ``de_store_memory_floor_s``: in de_store's restore process, after the restore,
  ``tf.fill`` allocating and first touching as many bytes as the restored table holds:
  with ``raw_read_s``, the floor this machine's disk and memory set a fresh-process
  restore; ``de_store_memory_s_per_gb``, that per GiB, the state of this virtual
  machine's memory (memory it has not touched lately costs several times more to
  touch), the median of the rounds;
* ``plain_restore_s``: the plainest restore of the same rows, in a fresh process of
  de_store's interpreter (TensorFlow only): a thread reads raw files of the rows cold
  while the other inserts each batch into a ``DenseHashTable`` sized ahead
  (``_harness.plain_restore``). The floor a restore meets on this machine's cores, where
  the reading and the indexing compete for them.

de_store keeps its traced kernels in a cache directory (see ``de_store._cache``). In
every round de_store's side runs twice: first with that directory emptied,
``de_store_{fill,first_upsert,save,restore}_cold_cache_s`` (every trace paid, as by the
first process in a new container), then with what those processes left there, as every
later process on a machine finds it. XLA compiles are never kept across processes: every
process pays them, in the background.

``{side}_{step}_cpu_s`` is the CPU time of the step's process (every thread), which other
load on a shared machine changes less than the wall-clock time. The sides run in turn for
``--rounds`` rounds, each side first in every other round (memory a process frees returns
to the host of this virtual machine, and the next process pays to touch it again); each
timing is the best of its rounds after the first, the cache-empty ones too (the first is
every side's warm-up: its first process loads TensorFlow's and the library's files cold).

References on the same bytes (``N * 8`` key bytes + ``N * dim * 4`` value bytes), each the
best of the rounds after the first: ``raw_write_fsync_s`` (``numpy.tofile`` + fsync), the
faster of ``{side}_raw_write_fsync_s``, measured in each side's fill process right before
its save, the files deleted before the save (so that the raw write and the save each find
free the page cache the other just used); ``raw_read_s`` (``numpy.fromfile``, cold)
and ``plain_restore_s`` (above), measured in every round before the sides. ``cold_reads`` says
how the page cache was emptied: ``drop_caches`` (the whole cache, as root) or
``posix_fadvise`` (each file evicted).

The TFRA side runs under ``--tfra-python``, an interpreter of a separate virtual
environment (see docs/benchmarks.md), with ``TF_USE_LEGACY_KERAS=1``; in that process this
script imports TFRA, never de_store. de_store fsyncs and checksums its files; TFRA does
neither.

Usage::

    python benchmarks/tfra_bench.py --tfra-python /work/tfra-venv/bin/python \\
        --keys 5000000 --dim 16

The figures are printed, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import _harness as harness
import numpy as np

SIDES = ("tfra", "de_store")


# --- phases, run in the side's own interpreter ---------------------------------------------
def import_side(side: str) -> tuple[Any, Any, Any]:
    """Import TensorFlow and the side's library; return (tf, library, its table creator)."""
    if side == "tfra":
        import tensorflow as tf
        import tensorflow_recommenders_addons.dynamic_embedding as de

        return tf, de, de.CuckooHashTableCreator
    import tensorflow as tf

    import de_store

    # de_store imports its modules when first asked for them; TFRA's import loads all.
    de_store.get_variable, de_store.FileSystemSaver  # noqa: B018
    return tf, de_store, de_store.HashTableCreator


def make_variable(de: Any, creator: Any, tf: Any, dim: int) -> Any:
    saver = de.FileSystemSaver()
    return de.get_variable(
        "embedding",
        key_dtype=tf.int64,
        value_dtype=tf.float32,
        dim=dim,
        kv_creator=creator(saver=saver),
    )


def phase_fill_save(args: argparse.Namespace) -> None:
    batches = list(harness.rows(args.keys, args.dim))
    import_s, (tf, de, creator) = harness.timed(lambda: import_side(args.side))
    out: dict[str, Any] = {"import_s": import_s}
    start, cpu = time.perf_counter(), time.process_time()
    variable = make_variable(de, creator, tf, args.dim)
    for i, (keys, values) in enumerate(batches):
        variable.upsert(tf.constant(keys), tf.constant(values))
        if i == 0:
            variable.size().numpy()
            out["first_upsert_s"] = time.perf_counter() - start
    out["filled_keys"] = int(variable.size().numpy())
    out["fill_s"], out["fill_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    checkpoint = tf.train.Checkpoint(embedding=variable)
    prefix = os.path.join(args.dir, args.side, "ckpt")
    # The raw write of the same bytes, its files deleted before the save: each finds free
    # the page cache the other used (memory this virtual machine has not touched lately
    # costs far more to write into).
    raw = os.path.join(args.dir, f"raw-{args.side}")
    out["raw_write_fsync_s"] = harness.raw_write(raw, args.keys, args.dim)
    harness.remove_raw(raw)
    cpu = time.process_time()
    out["save_s"], _ = harness.timed(lambda: checkpoint.write(prefix))
    out["save_cpu_s"] = time.process_time() - cpu
    harness.emit(out)


def phase_restore(args: argparse.Namespace) -> None:
    import_s, (tf, de, creator) = harness.timed(lambda: import_side(args.side))
    variable = make_variable(de, creator, tf, args.dim)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    prefix = os.path.join(args.dir, args.side, "ckpt")
    start, cpu = time.perf_counter(), time.process_time()
    checkpoint.read(prefix)
    restored = int(variable.size().numpy())
    out: dict[str, Any] = {"import_s": import_s, "restore_s": time.perf_counter() - start}
    out["restore_cpu_s"] = time.process_time() - cpu
    keys, values = harness.sample_rows(args.keys, args.dim)
    found, exists = variable.lookup(tf.constant(keys), return_exists=True)
    out["restored_keys"] = restored
    out["verified"] = bool(np.all(exists.numpy()) and np.array_equal(found.numpy(), values))
    if args.side == "de_store":  # the floor memory sets: the table's bytes, first touched
        nbytes = _table_bytes(variable)
        out["memory_floor_s"] = harness.memory_first_touch(tf, nbytes)
        out["memory_floor_bytes"] = nbytes
    harness.emit(out)


def _table_bytes(variable: Any) -> int:
    return sum(int(shard.memory_bytes()) for shard in variable.shards)


# --- driver ---------------------------------------------------------------------------------
def run_side(args: argparse.Namespace, side: str, cache_empty: bool = False) -> dict[str, Any]:
    """Fill and save in one fresh process of the side's interpreter, restore in another
    (de_store's with its cache directory emptied first when ``cache_empty``)."""
    if side == "tfra":
        python, env = args.tfra_python, {"TF_USE_LEGACY_KERAS": "1"}
    else:
        cache = os.path.join(args.dir, "cache")
        if cache_empty:
            shutil.rmtree(cache, ignore_errors=True)
        python, env = sys.executable, {"DE_STORE_CACHE_DIR": cache}
    options = ["--side", side, "--keys", str(args.keys), "--dim", str(args.dim)]
    options += ["--dir", args.dir]
    shutil.rmtree(os.path.join(args.dir, side), ignore_errors=True)
    saved = harness.run_phase(__file__, "fill_save", options, python, env)
    cold = harness.cold_read_setup(os.path.join(args.dir, side))
    restored = harness.run_phase(__file__, "restore", options, python, env)
    out = {f"{side}_{k}": v for k, v in saved.items()}
    out[f"{side}_restore_import_s"] = restored.pop("import_s")
    out.update({f"{side}_{k}": v for k, v in restored.items()})
    out[f"{side}_saved_bytes"] = folder_bytes(os.path.join(args.dir, side))
    out["cold_reads"] = cold
    return out


def raw_read_reference(args: argparse.Namespace) -> dict[str, Any]:
    """``raw_read_s`` and ``plain_restore_s`` of the same bytes, written (not timed), then
    read cold in this process and restored the plainest way in a fresh one, in every round
    beside the sides (the disk of a shared machine changes speed from minute to minute)."""
    raw = os.path.join(args.dir, "raw")
    harness.raw_write(raw, args.keys, args.dim)
    try:
        out = harness.raw_read(raw, args.dim)
        options = ["--keys", str(args.keys), "--dim", str(args.dim), "--dir", args.dir]
        out.update(harness.run_phase(__file__, "plain_restore", options))
    finally:
        harness.remove_raw(raw)
    return out


def phase_plain_restore(args: argparse.Namespace) -> None:
    import tensorflow as tf

    harness.emit(harness.plain_restore(tf, os.path.join(args.dir, "raw"), args.dim))


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each timing (``*_s``) as the best of the rounds after the first, as ``timeit``
    reports the best of its repeats; the other figures of the last round, ``*_verified``
    only if every round was."""
    out = dict(rounds[-1])
    for key in out:
        if key.endswith("_s"):
            out[key] = min(r[key] for r in rounds[1:] or rounds)
        elif key.endswith("_verified"):
            out[key] = all(r[key] for r in rounds)
    return out


def cold_cache(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """de_store's figures of the processes that found the cache empty, each the best of
    the rounds after the first."""
    steps = ("fill", "first_upsert", "save", "restore")
    later = rounds[1:] or rounds
    return {f"de_store_{s}_cold_cache_s": min(r[f"de_store_{s}_s"] for r in later) for s in steps}


def folder_bytes(root: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(root)
        for name in names
    )


def ratios(r: dict[str, Any]) -> dict[str, float]:
    """TFRA's time over de_store's for each step (above 1: de_store is faster), and de_store's
    save and restore over the raw references."""
    out = {
        f"{step}_tfra_over_de_store": r[f"tfra_{step}_s"] / r[f"de_store_{step}_s"]
        for step in ("fill", "save", "restore")
    }
    for step in ("fill", "restore"):
        cold = r[f"de_store_{step}_cold_cache_s"]
        out[f"{step}_tfra_over_de_store_cold_cache"] = r[f"tfra_{step}_s"] / cold
    out["de_store_save_over_raw_write"] = r["de_store_save_s"] / r["raw_write_fsync_s"]
    out["de_store_restore_over_raw_read"] = r["de_store_restore_s"] / r["raw_read_s"]
    out["de_store_restore_over_raw_read_and_memory"] = r["de_store_restore_s"] / (
        r["raw_read_s"] + r["de_store_memory_floor_s"]
    )
    out["tfra_save_over_raw_write"] = r["tfra_save_s"] / r["raw_write_fsync_s"]
    out["tfra_restore_over_raw_read"] = r["tfra_restore_s"] / r["raw_read_s"]
    for name in ("de_store_restore", "de_store_restore_cold_cache", "tfra_restore"):
        out[f"{name}_over_plain_restore"] = r[f"{name}_s"] / r["plain_restore_s"]
    return {k: round(v, 3) for k, v in out.items()}


def print_figures(r: dict[str, Any]) -> None:
    print(f"{r['keys']} keys x dim {r['dim']} float32 (seconds)")
    print(f"{'step':<10}{'TFRA':>10}{'de_store':>10}{'TFRA / de_store':>18}")
    for step in ("fill", "save", "restore"):
        tfra, ours = r[f"tfra_{step}_s"], r[f"de_store_{step}_s"]
        print(f"{step:<10}{tfra:>10.2f}{ours:>10.2f}{tfra / ours:>17.2f}x")
    for step in ("fill", "restore"):
        tfra, cold = r[f"tfra_{step}_s"], r[f"de_store_{step}_cold_cache_s"]
        label = f"{step}, cache empty"
        print(f"{label:<20}{tfra:>10.2f}{cold:>10.2f}{tfra / cold:>7.2f}x")
    print(f"raw write + fsync {r['raw_write_fsync_s']:.2f}, raw cold read {r['raw_read_s']:.2f}")
    print(f"plainest restore (cold read + DenseHashTable inserts) {r['plain_restore_s']:.2f}")
    print(f"memory first touch {r['de_store_memory_s_per_gb']:.2f} s per GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tfra-python", help="python of a venv with TFRA 0.8.1 and TF 2.16.2")
    parser.add_argument("--keys", type=int, default=5_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the sides in turn")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        phases = {
            "fill_save": phase_fill_save,
            "restore": phase_restore,
            "plain_restore": phase_plain_restore,
        }
        phases[args.phase](args)
        return
    if not args.tfra_python:
        parser.error("--tfra-python is required: the interpreter of a venv holding TFRA 0.8.1")
    args.dir = tempfile.mkdtemp(prefix="de_store_tfra_bench_", dir="/tmp")
    try:
        result: dict[str, Any] = {"keys": args.keys, "dim": args.dim}
        rounds: dict[str, list[dict[str, Any]]] = {"raw": [], **{side: [] for side in SIDES}}
        cache_empty: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            rounds["raw"].append(raw_read_reference(args))
            # The sides take turns going first: on this virtual machine, memory a process
            # freed returns to the host, and the next process pays to touch it again.
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                if side == "de_store":
                    cache_empty.append(run_side(args, side, cache_empty=True))
                rounds[side].append(run_side(args, side))
        for figures in rounds.values():
            result.update(best_of(figures))
        result.update(cold_cache(cache_empty))
        result["de_store_memory_s_per_gb"] = float(
            np.median(
                [
                    r["de_store_memory_floor_s"] / (r["de_store_memory_floor_bytes"] / 2**30)
                    for r in rounds["de_store"]
                ]
            )
        )
        result["raw_write_fsync_s"] = min(result[f"{side}_raw_write_fsync_s"] for side in SIDES)
        result["rounds"] = args.rounds
        result["ratios"] = ratios(result)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print_figures(result)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
