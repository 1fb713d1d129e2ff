"""Tables and Variables used by several threads and by concurrently running tf.functions.

Every call is atomic: a batch upserted, accumulated or removed is seen whole or not at
all, sizes move by whole batches, and the final contents are exactly those of a dict
given the same calls. A hang fails the test through the join timeout; a process abort is
confined to a subprocess (``table_threads_worker.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

import de_store as ds
from de_store.tables import HashTable, MutableTable

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]  # 4, see conftest.py
BATCH = 20_000  # big batches take the compiled probe rounds and races
TIMEOUT_S = 240  # per test; a deadlock or an endless probe loop fails it


def run_threads(*work: Callable[[], None]) -> None:
    """Run each callable in a thread of its own; fail on an error or on a thread still
    running after ``TIMEOUT_S``."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not [t for t in threads if t.is_alive()], f"threads still running after {TIMEOUT_S} s"
    if errors:
        raise errors[0]


def variable(name: str, shards: int = 2) -> ds.Variable:
    return ds.Variable(name, tf.int64, tf.float32, dim=3, devices=CPUS[:shards])


def half_new(round_: int) -> np.ndarray:
    """The keys of round ``round_``: half of them new, half from the round before."""
    return np.arange(BATCH, dtype=np.int64) + round_ * BATCH // 2


def sums_of_ones(rounds: int, adds: int) -> dict:
    """The contents after ``adds`` accumulations of ones into every round's keys."""
    counts = np.zeros((rounds + 1) * BATCH // 2)
    for round_ in range(rounds):
        counts[half_new(round_)] += adds
    return {n: (c, c, c) for n, c in enumerate(counts.tolist())}


def row_of(numbers: np.ndarray) -> np.ndarray:
    """The row upserted for each key: a function of the key only."""
    return np.stack([numbers % 997, numbers % 13, np.ones(len(numbers))], 1).astype(np.float32)


def rows_by_key(numbers: np.ndarray) -> dict:
    """The contents after upserting ``numbers`` with :func:`row_of`."""
    written = np.unique(numbers)
    return dict(zip(written.tolist(), map(tuple, row_of(written).tolist()), strict=True))


def contents(var: ds.Variable) -> dict:
    keys, values = var.export()
    rows = zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)
    return {k: tuple(v) for k, v in rows}


def test_threads_upserting_one_variable_end_with_every_key_written() -> None:
    """Threads upsert random keys from one range (repeats within and across batches) while
    the table grows; a key's row depends on the key only."""
    var, threads, rounds = variable("threads_upsert", shards=1), 2, 10
    draws = np.random.default_rng(7).integers(0, 100_000, [threads, rounds, BATCH])

    def upsert(thread: int) -> Callable[[], None]:
        def run() -> None:
            for round_ in range(rounds):
                var.upsert(draws[thread, round_], row_of(draws[thread, round_]))

        return run

    run_threads(*(upsert(t) for t in range(threads)))
    expected = rows_by_key(draws)
    assert int(var.size()) == len(expected)
    assert contents(var) == expected


def test_threads_accumulating_into_the_same_keys_lose_no_update() -> None:
    """Every round the threads add to the same keys, half of them new (inserted by the
    accumulation itself, racing for the same slots)."""
    var, threads, rounds = variable("threads_accum"), 3, 8

    def accum() -> None:
        for round_ in range(rounds):
            var.accum(half_new(round_), np.ones([BATCH, 3], np.float32))

    run_threads(*[accum] * threads)
    assert contents(var) == sums_of_ones(rounds, threads)


def test_readers_see_whole_batches_while_writers_upsert_and_remove() -> None:
    """Writers add batches of new keys and remove earlier batches; readers look up, export
    and count meanwhile: every count is whole batches, every row is one write's row."""
    var, batches = variable("threads_readers"), 8
    seen: list[tuple[int, int]] = []
    finished = threading.Event()

    def batch(index: int) -> np.ndarray:
        return np.arange(BATCH, dtype=np.int64) + index * BATCH

    written = [0]  # batches upserted so far; the odd ones are never removed

    def write() -> None:
        for index in range(batches):
            var.upsert(batch(index), np.full([BATCH, 3], index, np.float32))
            written[0] = index + 1
            if index % 2:
                var.remove(batch(index - 1))
        finished.set()

    def kept(keys: np.ndarray, before: int) -> np.ndarray:
        """Which of ``keys`` belong to batches never removed, upserted before ``before``."""
        return ((keys // BATCH) % 2 == 1) & (keys // BATCH < before)

    def read() -> None:
        probe = np.arange(0, batches * BATCH, 97, dtype=np.int64)
        while not finished.is_set():
            before = written[0]
            keys, values = (t.numpy() for t in var.export())
            assert len(keys) % BATCH == 0 and len(np.unique(keys)) == len(keys)
            assert np.all(values == (keys // BATCH)[:, None])
            assert np.sum(kept(keys, before)) == BATCH * (before // 2)
            found, exists = (t.numpy() for t in var.lookup(probe, return_exists=True))
            assert np.all(exists[kept(probe, before)])
            assert np.all(found[exists] == (probe[exists] // BATCH)[:, None])
            assert np.all(found[~exists] == 0)
            seen.append((int(var.size()), len(keys)))

    run_threads(write, read, read)
    assert all(size % BATCH == 0 for size, _ in seen), seen
    held = np.concatenate([batch(i) for i in range(1, batches, 2)])
    assert contents(var) == {k: (k // BATCH,) * 3 for k in held.tolist()}


def test_exports_and_clears_race_with_upserts_without_mixing_them() -> None:
    var, rounds = variable("threads_clear", shards=1), 6
    numbers = np.arange(BATCH, dtype=np.int64)
    exports: list[int] = []

    def upsert() -> None:
        for round_ in range(rounds):
            var.upsert(numbers + round_ * BATCH, np.full([BATCH, 3], round_, np.float32))

    def clear_and_export() -> None:
        for _ in range(rounds):
            var.clear()
            keys, values = (t.numpy() for t in var.export())
            assert np.all(values == (keys // BATCH)[:, None])
            exports.append(len(keys))

    run_threads(upsert, clear_and_export)
    assert all(n % BATCH == 0 for n in exports), exports
    held = contents(var)
    rounds_held = sorted({int(k) // BATCH for k in held})
    assert rounds_held == list(range(rounds - len(rounds_held), rounds))  # after a clear
    assert held == {k: (k // BATCH,) * 3 for k in held}


def test_hash_tables_of_one_config_run_at_once_from_threads() -> None:
    """Tables of one config share their kernels (one tf.function each): each keeps its
    own lock and contents."""
    tables = [HashTable(tf.int64, tf.float32, 2, name=f"shared_{i}") for i in range(3)]
    numbers = np.arange(BATCH, dtype=np.int64)

    def fill(table: HashTable, value: float) -> Callable[[], None]:
        def run() -> None:
            for start in range(0, 3 * BATCH, BATCH):
                table.insert(numbers + start, np.full([BATCH, 2], value, np.float32))
                table.accum(numbers + start, np.ones([BATCH, 2], np.float32))

        return run

    run_threads(*(fill(table, float(i)) for i, table in enumerate(tables)))
    for i, table in enumerate(tables):
        keys, values = (t.numpy() for t in table.export_all())
        assert sorted(keys.tolist()) == list(range(3 * BATCH))
        assert np.all(values == i + 1.0)


def test_a_mutable_table_accumulates_and_removes_atomically_from_threads() -> None:
    table = MutableTable(tf.string, tf.float32, 1, name="mutable_threads")
    keys = tf.constant([f"k{i}".encode() for i in range(2000)])

    def accum() -> None:
        for _ in range(20):
            table.accum(keys, tf.ones([2000, 1]))

    def remove_others() -> None:
        for round_ in range(20):
            extra = tf.constant([f"x{round_}_{i}".encode() for i in range(500)])
            table.insert(extra, tf.ones([500, 1]))
            table.remove(extra)

    run_threads(accum, accum, remove_others)
    exported, values = table.export_all()
    assert sorted(exported.numpy().tolist()) == sorted(keys.numpy().tolist())
    assert np.all(values.numpy() == 40.0)
    changed, _, removed = table.export_changes(0)
    assert len(changed.numpy()) == 2000 and len(removed.numpy()) == 20 * 500  # absent now


def test_concurrent_tf_functions_using_two_variables_in_opposite_orders() -> None:
    """Train steps run at once from threads, each over both variables, in opposite
    orders, each call adding to keys half of which are new: no deadlock, no lost update."""
    first, second = variable("steps_first"), variable("steps_second")
    calls = 6

    def step_over(one: ds.Variable, other: ds.Variable) -> Callable[[tf.Tensor], tf.Tensor]:
        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def step(keys: tf.Tensor) -> tf.Tensor:
            ones = tf.ones([tf.size(keys), 3])
            rows = one.lookup(keys)
            one.accum(keys, ones)
            other.accum(keys, ones + 0 * rows)  # waits for the lookup of ``one``
            return other.size()

        return step

    def repeat(step: Callable[[tf.Tensor], tf.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for call in range(calls):
                step(tf.constant(half_new(call)))

        return run

    forward, backward = step_over(first, second), step_over(second, first)
    run_threads(repeat(forward), repeat(backward), repeat(forward))
    expected = sums_of_ones(calls, 3)
    assert contents(first) == expected and contents(second) == expected


def test_a_tf_function_and_eager_calls_share_a_table() -> None:
    var, rounds = variable("steps_and_eager", shards=1), 10
    draws = np.random.default_rng(8).integers(0, 100_000, [2, rounds, BATCH])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def step(keys: tf.Tensor) -> None:
        var.upsert(keys, tf.numpy_function(row_of, [keys], tf.float32, stateful=False))

    def graph_steps() -> None:
        for keys in draws[0]:
            step(tf.constant(keys))

    def eager_steps() -> None:
        for keys in draws[1]:
            var.upsert(keys, row_of(keys))
            var.remove(keys[:10] + 10**9)

    run_threads(graph_steps, eager_steps)
    assert contents(var) == rows_by_key(draws)


def test_restoring_while_a_thread_upserts_neither_aborts_nor_mixes_rows(tmp_path: Path) -> None:
    worker = Path(__file__).with_name("table_threads_worker.py")
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), "5"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["alive"] and got["errors"] == []
    assert got["saved_keys"] and got["saved_values"] == [1.0]
    # The last restore cleared what came before it: the batches held are the last ones
    # written, each one whole.
    held = got["batches"]
    assert held == list(range(got["written"] - len(held), got["written"]))
    assert got["batch_sizes"] in ([], [20_000]) and got["rows_hold_their_batch"]
    assert got["exported"] == got["distinct"] == got["size"] == 50_000 + 20_000 * len(held)
