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
import pytest
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


def variable(name: str, key_dtype: tf.DType = tf.int64, shards: int = 2) -> ds.Variable:
    return ds.Variable(name, key_dtype, tf.float32, dim=3, devices=CPUS[:shards])


def as_keys(numbers: np.ndarray, key_dtype: tf.DType) -> tf.Tensor:
    if key_dtype == tf.string:
        return tf.constant([str(n).encode() for n in numbers])
    return tf.constant(numbers, key_dtype)


def contents(var: ds.Variable) -> dict:
    keys, values = var.export()
    rows = zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)
    return {k: tuple(v) for k, v in rows}


def key_of(number: int, key_dtype: tf.DType) -> object:
    return str(number).encode() if key_dtype == tf.string else number


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.string], ids=["HashTable", "MutableTable"])
def test_threads_upserting_one_variable_end_with_every_last_write(key_dtype) -> None:
    """Each thread grows the variable with its own keys, half of them rewritten by its
    next round; the tables grow while the threads race."""
    var, threads, rounds = variable("threads_upsert", key_dtype), 3, 3
    expected: dict = {}

    def keys_of(thread: int, round_: int) -> np.ndarray:
        return (np.arange(BATCH) + round_ * BATCH // 2) * threads + thread

    def upsert(thread: int) -> Callable[[], None]:
        def run() -> None:
            for round_ in range(rounds):
                numbers = keys_of(thread, round_)
                values = np.stack([numbers % 997, np.full(BATCH, thread), np.full(BATCH, round_)])
                var.upsert(as_keys(numbers, key_dtype), values.T.astype(np.float32))

        return run

    run_threads(*(upsert(t) for t in range(threads)))
    for thread in range(threads):
        for round_ in range(rounds):
            for number in keys_of(thread, round_).tolist():
                expected[key_of(number, key_dtype)] = (number % 997, thread, round_)
    assert int(var.size()) == len(expected)
    assert contents(var) == expected


def test_threads_accumulating_into_the_same_keys_lose_no_update() -> None:
    var, threads, rounds = variable("threads_accum"), 4, 5
    numbers = np.arange(BATCH, dtype=np.int64) * 7

    def accum() -> None:
        for _ in range(rounds):
            var.accum(numbers, np.ones([BATCH, 3], np.float32))

    run_threads(*[accum] * threads)
    total = float(threads * rounds)
    assert contents(var) == {n: (total, total, total) for n in numbers.tolist()}


def test_readers_see_whole_batches_while_writers_upsert_and_remove() -> None:
    """Writers add batches of new keys and remove earlier batches; readers look up, export
    and count meanwhile: every count is whole batches, every row is one write's row."""
    var, batches = variable("threads_readers"), 8
    seen: list[tuple[int, int]] = []
    finished = threading.Event()

    def batch(index: int) -> np.ndarray:
        return np.arange(BATCH, dtype=np.int64) + index * BATCH

    def write() -> None:
        for index in range(batches):
            var.upsert(batch(index), np.full([BATCH, 3], index, np.float32))
            if index % 2:
                var.remove(batch(index - 1))
        finished.set()

    def read() -> None:
        probe = np.arange(0, batches * BATCH, 97, dtype=np.int64)
        while not finished.is_set():
            keys, values = (t.numpy() for t in var.export())
            assert len(keys) % BATCH == 0 and len(np.unique(keys)) == len(keys)
            assert np.all(values == (keys // BATCH)[:, None])
            found, exists = (t.numpy() for t in var.lookup(probe, return_exists=True))
            assert np.all(found[exists] == (probe[exists] // BATCH)[:, None])
            assert np.all(found[~exists] == 0)
            seen.append((int(var.size()), len(keys)))

    run_threads(write, read, read)
    assert all(size % BATCH == 0 for size, _ in seen), seen
    kept = np.concatenate([batch(i) for i in range(1, batches, 2)])
    assert contents(var) == {k: (k // BATCH,) * 3 for k in kept.tolist()}


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
    """Two train steps run at once from threads, each over both variables, in opposite
    orders: no deadlock, no lost update."""
    first, second = variable("steps_first"), variable("steps_second")
    numbers = tf.range(BATCH, dtype=tf.int64) * 3
    ones = tf.ones([BATCH, 3])

    def step_over(one: ds.Variable, other: ds.Variable) -> Callable[[], tf.Tensor]:
        @tf.function
        def step() -> tf.Tensor:
            rows = one.lookup(numbers)
            one.accum(numbers, ones)
            other.accum(numbers, ones + 0 * rows)  # waits for the lookup of ``one``
            return other.size()

        return step

    forward, backward = step_over(first, second), step_over(second, first)

    def repeat(step: Callable[[], tf.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(6):
                assert int(step()) == BATCH

        return run

    forward(), backward()  # traced before the threads start
    run_threads(repeat(forward), repeat(backward), repeat(forward))
    expected = {n: (20.0,) * 3 for n in numbers.numpy().tolist()}  # 1 + 1 + 6 * 3 each
    assert contents(first) == expected and contents(second) == expected


def test_a_tf_function_and_eager_calls_share_a_table() -> None:
    var = variable("steps_and_eager", shards=1)
    numbers = np.arange(BATCH, dtype=np.int64)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def step(keys: tf.Tensor) -> None:
        var.accum(keys, tf.ones([tf.size(keys), 3]))

    def graph_steps() -> None:
        for start in range(0, 4 * BATCH, BATCH):
            step(tf.constant(numbers + start))

    def eager_steps() -> None:
        for start in range(0, 4 * BATCH, BATCH):
            var.accum(numbers + start, np.ones([BATCH, 3], np.float32))
            var.remove(numbers[:10] + start + 10**9)

    run_threads(graph_steps, eager_steps)
    assert contents(var) == {n: (2.0,) * 3 for n in range(4 * BATCH)}


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
