"""Incremental checkpoints: a delta save against a full one, a chain restore against a full one.

On a local temporary directory, with one ``de_store`` Variable (``HashTable`` shards) of
``--keys`` rows of ``--dim`` float32 values:

* the first save with ``incremental=True`` is full (there is no base yet):
  ``first_full_save_s`` (blocking, with the first save's one-time costs);
* then 5 rounds: a share ``--changed`` of the keys changes (mostly updates, a few inserts
  and removes) and the next save is a delta: ``delta_saves_s`` and ``deltas_bytes`` (the
  bytes of each folder), ``first_delta_save_s`` (with the first delta's one-time costs);
* the same table is then saved once more as a full checkpoint, and the chain is compacted
  into a full checkpoint (``compact_s``, :func:`de_store.compaction.compact`);
* ``full_save_s`` / ``full_bytes``: that second full save (warm, like the deltas) and its
  bytes; ``delta_save_s`` / ``delta_bytes``: the median of the 5 delta saves and the
  bytes of the first delta;
* ``chain_restore_s`` / ``full_restore_s``: restoring the last delta (its whole chain) and
  the full checkpoint of the same table, each in a fresh process with the files evicted
  from the page cache first (as ``checkpoint_bench.py`` does); both restored tables must
  hold the same rows (``restores_match``);
* ``track_step_s`` / ``notrack_step_s``: one training step (``lookup`` + ``accum`` of a
  batch of ``--batch`` keys) on a ``HashTable`` of ``--track-keys`` rows with change
  tracking on and off (``HashTable(track_changes=False)``), median of ``--steps`` steps;
  ``tracking_overhead`` is their ratio minus one.

Usage::

    python benchmarks/incremental_bench.py --keys 10000000 --dim 16 --changed 0.01

The last stdout line is one JSON object with every figure; ``ratios`` compares them with
the targets (delta save at most 5% of a full save in time and bytes, a chain restore at
most 1.3x a full restore).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import _harness as harness
import numpy as np
from _harness import drop_cache, emit

FILL_BATCH = 1 << 20
SEED = 1234
DELTAS = 5
#: Multiplying ids by an odd constant permutes int64: unique keys spread over every bucket.
KEY_MULTIPLIER = np.int64(-7046029254386353131)
#: Shares of the changed keys that are inserted and removed; the rest are updated.
INSERT_SHARE = REMOVE_SHARE = 0.05


def keys_of(ids: np.ndarray) -> np.ndarray:
    return ids.astype(np.int64) * KEY_MULTIPLIER


def initial_rows(keys: int, dim: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(SEED)
    for start in range(0, keys, FILL_BATCH):
        n = min(FILL_BATCH, keys - start)
        ids = np.arange(start, start + n, dtype=np.int64)
        yield keys_of(ids), rng.standard_normal((n, dim), dtype=np.float32)


def folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, files in os.walk(path)
        for name in files
    )


def setup_tf(shards: int) -> tuple[Any, Any]:
    import tensorflow as tf

    import de_store

    if shards > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        config = [tf.config.LogicalDeviceConfiguration() for _ in range(shards)]
        tf.config.set_logical_device_configuration(cpu, config)
    return tf, de_store


def make_variable(tf: Any, de_store: Any, args: argparse.Namespace) -> Any:
    devices = [f"/CPU:{i}" for i in range(args.shards)] if args.shards > 1 else None
    return de_store.get_variable(
        "embedding",
        key_dtype=tf.int64,
        value_dtype=tf.float32,
        dim=args.dim,
        devices=devices,
        init_size=args.keys,
        kv_creator=de_store.HashTableCreator(),
    )


# --- phase: saves (one process) -------------------------------------------------------------
def change(variable: Any, args: argparse.Namespace, round_: int) -> dict[str, int]:
    """Change a share ``args.changed`` of the keys: updates, a few inserts and removes."""
    rng = np.random.default_rng(SEED + round_)
    total = max(1, int(args.keys * args.changed))
    inserts, removes = int(total * INSERT_SHARE), int(total * REMOVE_SHARE)
    updates = total - inserts - removes
    picked = rng.choice(args.keys, updates + removes, replace=False)
    first_new = args.keys + round_ * max(inserts, 1)
    new_ids = np.arange(first_new, first_new + inserts, dtype=np.int64)
    changed = np.concatenate([picked[:updates], new_ids])
    values = rng.standard_normal((len(changed), args.dim), dtype=np.float32)
    variable.upsert(keys_of(changed), values)
    variable.remove(keys_of(picked[updates:]))
    return {"updated": updates, "inserted": inserts, "removed": removes}


def timed_save(de_store: Any, variable: Any, url: str, incremental: bool) -> float:
    start = time.perf_counter()
    de_store.save([variable], url, incremental=incremental, blocking=True)
    return time.perf_counter() - start


def kind_of(url: str) -> str:
    from de_store.catalog import describe

    return str(describe(url)["kind"])


def phase_save(args: argparse.Namespace) -> None:
    tf, de_store = setup_tf(args.shards)
    from de_store.compaction import compact

    variable = make_variable(tf, de_store, args)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    for keys, values in initial_rows(args.keys, args.dim):
        variable.upsert(keys, values)
    out["fill_s"] = time.perf_counter() - start
    base = os.path.join(args.dir, "chain", "ckpt-0")
    out["first_full_save_s"] = timed_save(de_store, variable, base, incremental=True)
    out["first_full_bytes"], out["first_full_kind"] = folder_bytes(base), kind_of(base)
    delta_s, delta_bytes = [], []
    for round_ in range(1, DELTAS + 1):
        out["changes"] = change(variable, args, round_)
        url = os.path.join(args.dir, "chain", f"ckpt-{round_}")
        delta_s.append(timed_save(de_store, variable, url, incremental=True))
        delta_bytes.append(folder_bytes(url))
        out[f"delta_{round_}_kind"] = kind_of(url)
    out["first_delta_save_s"] = delta_s[0]
    out["delta_save_s"], out["delta_bytes"] = statistics.median(delta_s), delta_bytes[0]
    out["delta_saves_s"], out["deltas_bytes"] = delta_s, delta_bytes
    out["table_keys"] = int(variable.size())
    full = os.path.join(args.dir, "full", "ckpt-5")
    out["full_save_s"] = timed_save(de_store, variable, full, incremental=False)
    out["full_bytes"] = folder_bytes(full)
    start = time.perf_counter()
    compact(url, os.path.join(args.dir, "compacted", "ckpt-5"))
    out["compact_s"] = time.perf_counter() - start
    emit(out)


# --- phase: restore (a fresh process each) --------------------------------------------------
def phase_restore(args: argparse.Namespace) -> None:
    url = os.path.join(args.dir, args.which, "ckpt-5")
    drop_cache(args.dir)
    tf, de_store = setup_tf(args.shards)
    variable = make_variable(tf, de_store, args)
    start = time.perf_counter()
    de_store.restore([variable], url)
    out: dict[str, Any] = {"restore_s": time.perf_counter() - start}
    out["restored_keys"] = int(variable.size())
    out["digest"] = table_digest(variable)
    emit(out)


def table_digest(variable: Any) -> str:
    """A digest of every (key, value) row, independent of the table's order."""
    keys, values = [], []
    for shard in variable.shards:
        k, v = shard.export_all()
        keys.append(np.asarray(k))
        values.append(np.asarray(v))
    all_keys, all_values = np.concatenate(keys), np.concatenate(values)
    order = np.argsort(all_keys, kind="stable")
    digest = hashlib.sha256(all_keys[order].tobytes())
    digest.update(np.ascontiguousarray(all_values[order]).tobytes())
    return digest.hexdigest()


# --- phase: change tracking on a training step ----------------------------------------------
def phase_tracking(args: argparse.Namespace) -> None:
    """Both tables side by side, their steps interleaved: machine noise hits both alike."""
    tf, _ = setup_tf(1)
    from de_store.tables import HashTable

    tables = {}
    for track in (True, False):
        table = HashTable(
            tf.int64, tf.float32, args.dim, init_size=args.track_keys, track_changes=track
        )
        for keys, values in initial_rows(args.track_keys, args.dim):
            table.insert(tf.constant(keys), tf.constant(values))
        tables[track] = table
    rng = np.random.default_rng(SEED)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps + 3):  # 3 warm-up steps (tracing)
        keys = tf.constant(keys_of(rng.integers(0, args.track_keys, args.batch)))
        grads = tf.constant(rng.standard_normal((args.batch, args.dim), dtype=np.float32))
        for track, table in tables.items():
            start = time.perf_counter()
            values, _ = table.lookup(keys)
            table.accum(keys, grads * 0.01)
            values.numpy()
            if step >= 3:
                times[track].append(time.perf_counter() - start)
    out: dict[str, Any] = {"track_keys": args.track_keys, "batch": args.batch}
    out["track_step_s"] = statistics.median(times[True])
    out["notrack_step_s"] = statistics.median(times[False])
    out["tracking_overhead"] = out["track_step_s"] / out["notrack_step_s"] - 1
    emit(out)


# --- driver -----------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, **extra: str) -> dict[str, Any]:
    """Run ``phase`` in a fresh Python process; return the figures it printed."""
    options = ["--dir", args.dir]
    for option in ("keys", "dim", "changed", "shards", "track_keys", "batch", "steps"):
        options += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for option, value in extra.items():
        options += [f"--{option}", value]
    return harness.run_phase(__file__, phase, options)


def ratios(r: dict[str, Any]) -> dict[str, float]:
    out = {
        "delta_over_full_save_time": r["delta_save_s"] / r["full_save_s"],
        "delta_over_full_bytes": r["delta_bytes"] / r["full_bytes"],
        "chain_over_full_restore": r["chain_restore_s"] / r["full_restore_s"],
    }
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--changed", type=float, default=0.01, help="share of keys changed")
    parser.add_argument("--shards", type=int, default=1, help="table shards (logical CPUs)")
    parser.add_argument("--track-keys", type=int, default=None, help="rows of the tracking test")
    parser.add_argument("--batch", type=int, default=65536, help="keys per training step")
    parser.add_argument("--steps", type=int, default=30, help="training steps timed")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--which", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.changed <= 1:
        parser.error(f"--changed must be in (0, 1], got {args.changed}")
    if args.track_keys is None:
        args.track_keys = min(args.keys, 2_000_000)
    if args.phase is not None:
        {"save": phase_save, "restore": phase_restore, "tracking": phase_tracking}[args.phase](args)
        return
    args.dir = tempfile.mkdtemp(prefix="de_store_incr_bench_", dir="/tmp")
    try:
        result: dict[str, Any] = {"keys": args.keys, "dim": args.dim, "changed": args.changed}
        result.update(run_phase(args, "save"))
        print(f"save phase: {json.dumps(result)}", flush=True)
        chain = run_phase(args, "restore", which="chain")
        full = run_phase(args, "restore", which="full")
        compacted = run_phase(args, "restore", which="compacted")
        result["chain_restore_s"], result["full_restore_s"] = chain["restore_s"], full["restore_s"]
        result["compacted_restore_s"] = compacted["restore_s"]
        result["restored_keys"] = chain["restored_keys"]
        result["restores_match"] = chain["digest"] == full["digest"] == compacted["digest"]
        print(f"restore phase: chain {chain}, full {full}, compacted {compacted}", flush=True)
        tracking = run_phase(args, "tracking")
        print(f"tracking phase: {json.dumps(tracking)}", flush=True)
        result.update(tracking)
        result["ratios"] = ratios(result)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
