"""Throughput of HashTable against TensorFlow's MutableHashTable and DenseHashTable.

Usage: ``python benchmarks/table_bench.py --keys N --dim D --batch B``

Measures insert, lookup of present keys, lookup of missing keys and export, in keys per
second, plus the table's own bytes and the process's peak RSS. Lookup results are waited
for, not copied: ``lookup_to_host`` times the lookups of present keys again with every
result copied into numpy arrays (``Tensor.numpy()`` copies; 64 MB per 1M rows of dim 16),
as ``export`` is.
``ours`` grows from empty; ``ours_presized`` is given ``init_size`` like the pre-sized
``dense_hash_table``. Lookups are timed after one untimed lookup of a full batch (for
every table: ours compiles its first probe rounds with XLA once per capacity and batch
size class).
Every table is measured ``--rounds`` times (default 2), the tables in turn, and each
figure is the best of its rounds, as ``timeit`` reports the best of its repeats: on this
virtual machine, memory the guest has not touched since boot (or since the host took it
back) costs about 2.4 s per GB on first touch and 0.3 s per GB after, so the first table
measured in a process pays more for the same buffers. Each round's figures are printed.
``memory_floor`` is the floor this machine's memory sets an insert: the seconds
``tf.fill`` takes to allocate and first touch as many bytes as each of our filled tables
holds, and our insert time as a ratio to it. ``scatter_floor`` is the floor of the work
itself: the plainest TensorFlow ops that put the same batches into a pre-sized table of
our layout (each key hashed, one scatter of its index entry to its home slot, colliding
keys overwriting each other, and one scatter of its row), and our inserts as ratios to it.
``train_step`` times a training-style step (lookup of a batch of present keys, then accum
of deltas for them) on a pre-sized table with change tracking on and off. ``lock`` is
what the table's mutex costs a single thread (every kernel takes it, so that concurrent
calls are atomic): the inserts into a pre-sized table and the lookups, timed batch by
batch in turn on a table with the mutex and one whose kernels are built without it
(``without_lock``), best of ``--rounds``; ``*_cost_pct`` is how much longer the locked
table took, and ``call_us_*`` the microseconds of one eager ``size()`` call (a kernel
that only locks and reads a scalar). The last stdout line is one JSON object with every
figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from _harness import dense_hash_table

from de_store.tables import HashTable
from de_store.tables._index import home_slots
from de_store.testing.tables import without_lock


def _timed(
    batches: list[tf.Tensor], step: Callable[[tf.Tensor], object], to_host: bool = False
) -> float:
    """Keys per second of ``step`` over ``batches``, each result waited for (or, when
    ``to_host``, copied into numpy arrays)."""
    start = time.perf_counter()
    for batch in batches:
        _wait(step(batch), to_host)
    seconds = time.perf_counter() - start
    return sum(int(b.shape[0]) for b in batches) / seconds


def _wait(out: object, to_host: bool = False) -> None:
    """Wait for the tensors of ``out`` by reading one element of each.

    ``Tensor.numpy()`` copies the whole tensor (64 MB for 1M rows of 16 float32), a cost
    the same for every table and no part of a lookup; ``to_host`` pays it all the same.
    """
    for tensor in tf.nest.flatten(out):
        if not isinstance(tensor, tf.Tensor):
            continue
        if to_host:
            tensor.numpy()
        elif tensor.shape.num_elements():
            tf.reshape(tensor, [-1])[-1].numpy()


class _Candidate:
    """Uniform insert/lookup/export over one table implementation."""

    def __init__(self, kind: str, keys: int, dim: int) -> None:
        self.kind, self.dim = kind, dim
        if kind == "ours":
            self.table = HashTable(tf.int64, tf.float32, dim, name="bench")
        elif kind == "ours_presized":  # the same sizing as the DenseHashTable below
            self.table = HashTable(tf.int64, tf.float32, dim, name="bench", init_size=keys)
        elif kind == "mutable_hash_table":
            self.table = tf.lookup.experimental.MutableHashTable(
                tf.int64, tf.float32, tf.zeros([dim])
            )
        else:
            self.table = dense_hash_table(tf, keys, dim)

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        self.table.insert(keys, values)

    def lookup(self, keys: tf.Tensor) -> object:
        return self.table.lookup(keys)

    def export(self) -> object:
        return self.table.export_all() if self.kind.startswith("ours") else self.table.export()

    def table_bytes(self, count: int) -> int:
        if self.kind.startswith("ours"):
            return self.table.memory_bytes()
        if self.kind == "dense_hash_table":
            buckets = int(self.table.export()[0].shape[0])
            return buckets * (8 + 4 * self.dim)
        return -1  # not observable from Python


class _Batches:
    """The keys to insert and the missing keys, in batches, and one batch of values that
    every insert takes (sliced for a shorter last batch): built once, for every table."""

    def __init__(self, keys: np.ndarray, missing: np.ndarray, values: np.ndarray, batch: int):
        splits = range(0, len(keys), batch)
        self.count, self.dim = len(keys), values.shape[1]
        self.keys = [tf.constant(keys[s : s + batch]) for s in splits]
        self.missing = [tf.constant(missing[s : s + batch]) for s in splits]
        self.values = tf.constant(values)

    def values_for(self, keys: tf.Tensor) -> tf.Tensor:
        return self.values[: int(keys.shape[0])]  # a slice along rows copies nothing


def _measure(kind: str, batches: _Batches) -> dict[str, float]:
    candidate = _Candidate(kind, batches.count, batches.dim)
    warm = batches.keys[0][:16]
    candidate.insert(warm, batches.values[:16])
    candidate.lookup(warm)
    key_batches, miss_batches = batches.keys, batches.missing
    result = {"insert": _timed(key_batches, lambda k: candidate.insert(k, batches.values_for(k)))}
    # One untimed lookup of a full batch: XLA compiles our first probe rounds once per
    # index capacity and batch size class, as a training loop does on its first step.
    candidate.lookup(key_batches[0])
    result["lookup"] = _timed(key_batches, candidate.lookup)
    result["lookup_miss"] = _timed(miss_batches, candidate.lookup)
    result["lookup_to_host"] = _timed(key_batches, candidate.lookup, to_host=True)
    start = time.perf_counter()
    _wait(candidate.export(), to_host=True)  # an export is read on the host
    result["export"] = batches.count / (time.perf_counter() - start)
    result["table_bytes"] = candidate.table_bytes(batches.count)
    return result


def _train_step(keys: np.ndarray, values: np.ndarray, batch: int) -> dict[str, float]:
    """Keys per second of lookup + accum steps, with change tracking on and off."""
    dim = values.shape[1]
    rng = np.random.default_rng(1)
    steps = [tf.constant(rng.choice(keys, min(batch, len(keys)), replace=False)) for _ in range(5)]
    deltas = tf.constant(values[: int(steps[0].shape[0])] * 1e-3)
    result = {}
    for tracked in (True, False):
        table = HashTable(
            tf.int64, tf.float32, dim, name="train", init_size=len(keys), track_changes=tracked
        )
        for start in range(0, len(keys), batch):
            table.insert(keys[start : start + batch], values[: len(keys[start : start + batch])])

        def step(batch_keys: tf.Tensor, table: HashTable = table) -> tf.Tensor:
            rows, _ = table.lookup(batch_keys)
            table.accum(batch_keys, deltas, insert_missing=False)
            return rows

        step(steps[0])  # warm up
        result["tracked" if tracked else "untracked"] = _timed(steps, step)
        del table
    return result


def _lock_cost(batches: _Batches, rounds: int) -> dict[str, float]:
    """Inserts and lookups of two pre-sized tables, one with its mutex and one without,
    batch by batch in turn (so that a slower spell of the machine hits both), after one
    untimed pass that traces and compiles every kernel; the best of ``rounds`` passes.
    ``call_us`` is one eager ``size()`` call: a kernel that locks and reads a scalar."""
    tables = {
        "locked": HashTable(
            tf.int64, tf.float32, batches.dim, name="lock", init_size=batches.count
        ),
        "unlocked": without_lock(
            HashTable(tf.int64, tf.float32, batches.dim, name="lock", init_size=batches.count)
        ),
    }
    best: dict[str, float] = {}
    for round_ in range(rounds + 1):  # round 0 warms up
        seconds: dict[str, float] = dict.fromkeys(
            [f"{op}_{kind}" for op in ("insert", "lookup", "call_us") for kind in tables], 0.0
        )
        for table in tables.values():
            table.clear()
        for op in ("insert", "lookup"):
            for keys in batches.keys:
                for kind, table in tables.items():
                    call = table.insert if op == "insert" else table.lookup
                    args = (keys, batches.values_for(keys)) if op == "insert" else (keys,)
                    start = time.perf_counter()
                    _wait(call(*args))
                    seconds[f"{op}_{kind}"] += time.perf_counter() - start
        for _ in range(10):
            for kind, table in tables.items():
                start = time.perf_counter()
                for _ in range(100):
                    table.size()
                seconds[f"call_us_{kind}"] += (time.perf_counter() - start) / 1000 * 1e6
        if round_:
            for key, value in seconds.items():
                best[key] = min(best.get(key, value), value)
    result = {}
    for op in ("insert", "lookup"):
        for kind in tables:
            result[f"{op}_{kind}"] = batches.count / best[f"{op}_{kind}"]
        result[f"{op}_cost_pct"] = 100 * (best[f"{op}_locked"] / best[f"{op}_unlocked"] - 1)
    for kind in tables:
        result[f"call_us_{kind}"] = best[f"call_us_{kind}"]
    return result


def _memory_floors(report: dict, count: int, rounds: int) -> dict[str, float]:
    """For each of our tables: the seconds a plain TensorFlow op (``tf.fill``) takes to
    allocate and first touch as many bytes as the filled table holds (best of
    ``rounds``, a fresh buffer each time), and our insert time over it."""
    out: dict[str, float] = {}
    for kind in ("ours", "ours_presized"):
        nbytes = int(report[kind]["table_bytes"])
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            filled = tf.fill([nbytes // 8], tf.constant(1, tf.int64))
            _wait(filled)
            best = min(best, time.perf_counter() - start)
            del filled
        out[f"{kind}_floor_s"] = round(best, 4)
        out[f"{kind}_insert_s"] = round(count / report[kind]["insert"], 4)
        out[f"{kind}_insert_over_floor"] = round(count / report[kind]["insert"] / best, 2)
    return out


def _scatter_floor(batches: _Batches, rounds: int) -> float:
    """Seconds the plainest TensorFlow ops take to put every batch into a table of our
    layout, pre-sized as ``ours_presized``: each key hashed as ours, one scatter of its
    ``(key, row)`` entry into the index at its home slot (a collision overwrites: no
    probing, no check for a key held) and one scatter of its row into the row store; best
    of ``rounds``, fresh buffers each time. No hash table moves fewer bytes for an insert."""
    capacity = HashTable(tf.int64, tf.float32, batches.dim, init_size=batches.count).capacity()
    return min(_scatter_once(batches, capacity) for _ in range(rounds))


def _scatter_once(batches: _Batches, capacity: int) -> float:
    index = tf.Variable(tf.fill([capacity, 2], tf.constant(-1, tf.int64)))
    store = tf.Variable(tf.zeros([batches.count, batches.dim]))

    @tf.function(autograph=False)
    def put(keys: tf.Tensor, rows: tf.Tensor, values: tf.Tensor) -> None:
        slots = home_slots(keys, tf.constant(capacity - 1, tf.int64))
        index.scatter_nd_update(slots[:, None], tf.stack([keys, rows], 1))
        store.scatter_update(tf.IndexedSlices(values, rows))

    first = batches.keys[0][:16]
    put(first, tf.range(16, dtype=tf.int64), batches.values[:16])  # traced untimed
    start, done = time.perf_counter(), 0
    for keys in batches.keys:
        rows = tf.range(done, done + int(keys.shape[0]), dtype=tf.int64)
        put(keys, rows, batches.values_for(keys))
        done += int(keys.shape[0])
    _wait(store.read_value()[-1])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measure every table this many times, in turn, and report each figure's best",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 1 << 62, int(args.keys * 1.01), dtype=np.int64))
    keys = rng.permutation(keys)[: args.keys]
    missing = -rng.integers(3, 1 << 62, args.keys, dtype=np.int64)  # never inserted
    values = rng.random((min(args.batch, args.keys), args.dim), dtype=np.float32)
    report: dict[str, object] = {"keys": args.keys, "dim": args.dim, "batch": args.batch}
    report["rounds"] = args.rounds
    batches = _Batches(keys, missing, values, args.batch)
    for round_ in range(args.rounds):
        for kind in ("ours", "ours_presized", "mutable_hash_table", "dense_hash_table"):
            result = _measure(kind, batches)
            print(
                f"round {round_ + 1}",
                kind,
                {k: f"{v / 1e6:.2f}M" if k != "table_bytes" else v for k, v in result.items()},
                flush=True,
            )
            best = report.setdefault(kind, result)
            assert isinstance(best, dict)
            report[kind] = {k: max(best[k], v) for k, v in result.items()}
    report["memory_floor"] = _memory_floors(report, args.keys, args.rounds)
    floor = _scatter_floor(batches, args.rounds)
    report["scatter_floor"] = {
        "scatter_floor_s": round(floor, 4),
        **{
            f"{kind}_insert_over_scatter_floor": round(
                args.keys / report[kind]["insert"] / floor, 2
            )
            for kind in ("ours", "ours_presized")
        },
    }
    print(
        "memory_floor", report["memory_floor"], "scatter_floor", report["scatter_floor"], flush=True
    )
    report["lock"] = _lock_cost(batches, args.rounds)
    print("lock", {k: round(v, 2) for k, v in report["lock"].items()}, flush=True)
    report["train_step"] = _train_step(keys, values, args.batch)
    print("train_step", {k: f"{v / 1e6:.2f}M" for k, v in report["train_step"].items()}, flush=True)
    raw = args.keys * (8 + 4 * args.dim)
    report["raw_bytes"] = raw
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(report))


if __name__ == "__main__":
    main()
