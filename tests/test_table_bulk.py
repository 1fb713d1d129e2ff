"""Bulk calls: eager calls of 65,536 keys or more run their kernel's ops one by one (no
trace), their compiled probe rounds first as TensorFlow ops while XLA compiles the shape in
the background, compiled afterwards; every way gives the same table."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from de_store.errors import RepeatedKeysError
from de_store.tables import (
    HashTable,
    _capacity,
    _claim_loop,
    _index,
    _kernels,
    _probing,
    _table_ops,
    _xla,
)

BULK = _kernels.OP_BY_OP_MIN_KEYS


def _every_bulk_call_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk calls run op by op, as in a process that has not traced their kernels and
    whose kernel cache holds none (the kernels are shared by every table of a config, and
    other tests of this process trace them)."""
    monkeypatch.setattr(_kernels.Kernels, "_cached", lambda self, name: False)
    monkeypatch.setattr(_kernels.Kernels, "_trace_behind", lambda self, name: None)


def _nothing_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that has compiled no shape yet (other tests of this one may have):
    the first bulk calls run their compiled rounds as TensorFlow ops."""
    monkeypatch.setattr(_xla, "_compiled", set())


def _plain_races(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the races run as plain TensorFlow ops from now on, in order."""
    sizes: list[int] = []
    for race in _index.race_from.values():
        run = _index.plain[race]
        monkeypatch.setitem(
            _index.plain,
            race,
            lambda index, keys, *rest, run=run: (
                sizes.append(int(keys.shape[0])) or run(index, keys, *rest)
            ),
        )
    return sizes


def _held_compiles(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background compiles from now on start only once the event returned is set."""
    gate = threading.Event()
    compile_shape = _xla._compile

    def held(*args: object) -> None:
        assert gate.wait(60)
        compile_shape(*args)

    monkeypatch.setattr(_xla, "_compile", held)
    return gate


def _model_insert(model: dict, keys: np.ndarray, values: np.ndarray) -> None:
    for key, row in zip(keys.tolist(), values, strict=True):
        model[key] = row  # the last of repeated keys wins


def _check(table: HashTable, model: dict) -> None:
    keys, rows = table.export_all()
    got = dict(zip(keys.numpy().tolist(), rows.numpy(), strict=True))
    assert got.keys() == model.keys()
    for key, row in model.items():
        np.testing.assert_array_equal(got[key], row)


def test_bulk_calls_give_the_table_small_calls_give(monkeypatch):
    rng = np.random.default_rng(3)
    bulk = HashTable(tf.int64, tf.float32, 4, name="bulk")
    small = HashTable(tf.int64, tf.float32, 4, name="small")
    model: dict = {}
    calls = []
    run = _kernels.Kernels._op_by_op
    _every_bulk_call_op_by_op(monkeypatch)
    _nothing_compiled(monkeypatch)
    monkeypatch.setattr(
        _kernels.Kernels,
        "_op_by_op",
        lambda self, name, *a: calls.append(name) or run(self, name, *a),
    )
    for step in range(3):  # the same shapes again: compiled once the background is done
        keys = rng.integers(0, 3 * BULK, BULK + 1000)  # repeats, and keys of earlier steps
        values = rng.normal(size=(keys.size, 4)).astype(np.float32)
        bulk.insert(tf.constant(keys), tf.constant(values))
        for at in range(0, keys.size, 20_000):
            small.insert(tf.constant(keys[at : at + 20_000]), tf.constant(values[at : at + 20_000]))
        _model_insert(model, keys, values)
        probe = rng.integers(0, 4 * BULK, BULK)  # present and missing keys
        got, found = bulk.lookup(tf.constant(probe))
        want_found = np.array([k in model for k in probe.tolist()])
        np.testing.assert_array_equal(found.numpy(), want_found)
        want = np.stack([model.get(k, np.zeros(4, np.float32)) for k in probe.tolist()])
        np.testing.assert_array_equal(got.numpy(), want)
        if step == 0:
            _xla.wait_for_compiles()
    assert calls.count("insert") == 3 and calls.count("lookup") == 3
    gone = rng.choice(np.fromiter(model, np.int64), BULK, replace=False)
    bulk.remove(tf.constant(gone))
    for at in range(0, gone.size, 20_000):
        small.remove(tf.constant(gone[at : at + 20_000]))
    for key in gone.tolist():
        del model[key]
    assert calls.count("remove") == 1
    _check(bulk, model)
    _check(small, model)
    assert int(bulk.size()) == int(small.size()) == len(model)


def test_a_bulk_load_restores_every_row_and_refuses_repeated_keys():
    rng = np.random.default_rng(4)
    keys = rng.choice(10**12, 2 * BULK, replace=False)
    values = rng.normal(size=(keys.size, 3)).astype(np.float32)
    table = HashTable(tf.int64, tf.float32, 3, name="loaded")
    table.load_distinct(tf.constant(keys), tf.constant(values))
    _check(table, dict(zip(keys.tolist(), values, strict=True)))
    repeated = np.concatenate([keys[:BULK], keys[:5]])
    again = HashTable(tf.int64, tf.float32, 3, name="again")
    with pytest.raises(RepeatedKeysError, match="'again'"):
        again.load_distinct(tf.constant(repeated), tf.zeros([repeated.size, 3]))


def test_a_bulk_load_near_the_load_limit_races_again_for_the_keys_its_first_race_left(
    monkeypatch,
):
    _every_bulk_call_op_by_op(monkeypatch)  # place runs eagerly: each branch taken is seen
    left = []
    race_again = _probing.ProbeOps._race_again

    def counted(self, keys, rows, start):
        left.append(int(tf.size(keys)))
        return race_again(self, keys, rows, start)

    monkeypatch.setattr(_probing.ProbeOps, "_race_again", counted)
    rng = np.random.default_rng(5)
    keys = rng.choice(10**12, 380_000, replace=False)  # 0.72 of the capacity reserved
    values = rng.normal(size=(keys.size, 3)).astype(np.float32)
    table = HashTable(tf.int64, tf.float32, 3, name="near_limit")
    table.reserve(keys.size)
    table.load_distinct(tf.constant(keys), tf.constant(values))
    assert left and left[0] >= _index.COMPILED_MIN_KEYS
    found, exists = table.lookup(tf.constant(keys))  # through the index
    assert bool(tf.reduce_all(exists))
    np.testing.assert_array_equal(found.numpy(), values)
    _check(table, dict(zip(keys.tolist(), values, strict=True)))
    # keys repeated at the end of the batch, where the first race leaves most keys
    repeated = np.concatenate([keys, keys[-5:]])
    again = HashTable(tf.int64, tf.float32, 3, name="near_limit_again")
    again.reserve(repeated.size)
    with pytest.raises(RepeatedKeysError, match="'near_limit_again'"):
        again.load_distinct(tf.constant(repeated), tf.zeros([repeated.size, 3]))
    assert int(again.size()) == 0


def test_a_bulk_load_whose_room_was_taken_loads_by_the_kernel_that_grows(monkeypatch):
    """An eager bulk load makes room, then runs a kernel that does not grow; when the room
    is gone by then (another thread's insert took it), that kernel fails before it writes
    and the load runs again with growth: every row is loaded once."""
    rng = np.random.default_rng(5)
    keys = rng.choice(10**12, BULK, replace=False)
    values = rng.normal(size=(keys.size, 3)).astype(np.float32)
    table = HashTable(tf.int64, tf.float32, 3, name="taken")
    kernels: list[str] = []
    run = HashTable._run

    def no_room_made(self: HashTable, kernel: str, *args: tf.Tensor) -> object:
        kernels.append(kernel)
        return None if kernel == "prepare" else run(self, kernel, *args)

    monkeypatch.setattr(HashTable, "_run", no_room_made)
    table.load_distinct(tf.constant(keys), tf.constant(values))
    assert kernels == ["prepare", "load_prepared", "load_distinct"]
    monkeypatch.undo()
    _check(table, dict(zip(keys.tolist(), values, strict=True)))
    assert int(table.size()) == keys.size


@pytest.mark.parametrize("held", [0, 3 * BULK], ids=["empty", "holding_keys"])
def test_the_load_compile_started_before_a_growth_is_the_one_the_grown_table_runs(held):
    """A restore starts compiling its loads before it grows the tables
    (``compile_load(count, room_for=rows)``), for the capacity the growth will give: the
    shape its loads run at once the table has grown."""
    table = HashTable(tf.int64, tf.float32, 3, name="ahead")
    if held:
        keys = np.arange(held, dtype=np.int64)
        table.insert(tf.constant(keys), tf.zeros([held, 3]))
    rows = 5 * BULK
    table.compile_load(BULK, room_for=rows)
    _xla.wait_for_compiles()
    compiled = set(_xla._compiled)
    table.reserve(rows)
    race = _index.race_from[table._kernels.config.serial_scatter]
    assert _xla._signature(race, table.index, _index.load_race_args()) in compiled


def test_a_growing_bulk_insert_starts_its_race_compile_before_its_rehash(monkeypatch):
    """An eager insert that grows its table has XLA compile the race at the capacity it
    grows to before it rehashes, so that the compile and the rehash overlap: the shape the
    batch's race and every later bulk insert of the grown table run."""
    _every_bulk_call_op_by_op(monkeypatch)
    _nothing_compiled(monkeypatch)
    table = HashTable(tf.int64, tf.float32, 3, name="compiled_ahead")
    race = _index.race_from[table._kernels.config.serial_scatter]
    asked: list[bool] = []
    rehash = _capacity.CapacityOps.rehash

    def watched(self: _capacity.CapacityOps, capacity: tf.Tensor, compiled: bool = False) -> None:
        signature = _xla._signature(race, self.t.index, _index.load_race_args(), int(capacity))
        with _xla._lock:
            asked.append(signature in _xla._pending or signature in _xla._compiled)
        rehash(self, capacity, compiled)

    monkeypatch.setattr(_capacity.CapacityOps, "rehash", watched)
    keys = np.random.default_rng(10).choice(10**12, BULK, replace=False)
    values = np.arange(3 * BULK, dtype=np.float32).reshape(BULK, 3)
    table.insert(tf.constant(keys), tf.constant(values))
    assert asked == [True]
    _xla.wait_for_compiles()
    assert _xla.compiled_race(race, table.index)
    _check(table, dict(zip(keys.tolist(), values, strict=True)))


def test_a_race_of_many_keys_waits_for_its_compile_instead_of_running_plain(monkeypatch):
    """An eager race of ``WAIT_MIN_KEYS`` keys or more, in a process that has not compiled
    its shape, waits for the compile and runs compiled: its plain rounds would take about
    as long. Smaller races run plain meanwhile. Both give the same table."""
    _every_bulk_call_op_by_op(monkeypatch)
    _nothing_compiled(monkeypatch)
    plain_keys = _plain_races(monkeypatch)
    monkeypatch.setattr(_claim_loop, "WAIT_MIN_KEYS", 2 * BULK)
    rng = np.random.default_rng(11)
    model: dict = {}
    waited = HashTable(tf.int64, tf.float32, 2, name="waited")
    keys = rng.integers(0, 3 * BULK, 2 * BULK)  # repeated keys too
    values = rng.normal(size=(keys.size, 2)).astype(np.float32)
    waited.insert(tf.constant(keys), tf.constant(values))
    _model_insert(model, keys, values)
    assert plain_keys == []
    _check(waited, model)
    # A compile that does not end while the smaller race runs (this process's XLA may
    # have compiled the shape for an earlier test, and would be done at once).
    _nothing_compiled(monkeypatch)
    gate = _held_compiles(monkeypatch)
    ran_plain = HashTable(tf.int64, tf.float32, 2, name="ran_plain")
    ran_plain.insert(tf.constant(keys[:BULK]), tf.constant(values[:BULK]))
    gate.set()
    _xla.wait_for_compiles()
    assert plain_keys[0] == BULK
    first: dict = {}
    _model_insert(first, keys[:BULK], values[:BULK])
    _check(ran_plain, first)


@pytest.mark.parametrize("ahead", ["/CPU:1", None], ids=["own_device", "compile_ahead"])
def test_a_race_off_the_first_cpu_runs_plain_while_its_compile_needs_the_eager_lock(
    monkeypatch, ahead
):
    """The compiling thread makes its stand-in index off the host's first CPU holding
    ``EAGER_ON_DEVICE``, which an op-by-op call holds from its first op to its last: a
    race of many keys does not wait for a compile that needs it, its own (a table on
    another device) or one queued before it, and runs its plain rounds instead."""
    _every_bulk_call_op_by_op(monkeypatch)
    _nothing_compiled(monkeypatch)
    monkeypatch.setattr(_claim_loop, "WAIT_MIN_KEYS", BULK)
    plain_keys = _plain_races(monkeypatch)
    gate = _held_compiles(monkeypatch)
    if ahead is not None:  # a compile for a table on another device, queued first
        with tf.device(ahead):
            other = HashTable(tf.int64, tf.float32, 2, name="other_device")
        other.compile_load(BULK, room_for=4 * BULK)
    with tf.device("/CPU:1" if ahead is None else "/CPU:0"):
        table = HashTable(tf.int64, tf.float32, 2, name="lock_needed")
    keys = np.random.default_rng(12).choice(10**12, BULK, replace=False)
    values = np.ones([BULK, 2], np.float32)
    errors: list[BaseException] = []

    def insert() -> None:
        try:
            table.insert(tf.constant(keys), tf.constant(values))
        except BaseException as err:  # reported below
            errors.append(err)

    writer = threading.Thread(target=insert, daemon=True)
    writer.start()
    writer.join(60)
    gate.set()
    assert not writer.is_alive(), "the insert waited for a compile that waits for it"
    _xla.wait_for_compiles()
    assert errors == [] and plain_keys[0] == BULK
    _check(table, dict(zip(keys.tolist(), values, strict=True)))


def test_threads_run_bulk_calls_on_other_devices_at_once(monkeypatch):
    """Tables on a device other than the default one, written by two threads at once with
    every call op by op (TensorFlow's eager slices there are not safe from two threads at
    once: the calls take turns)."""
    monkeypatch.setattr(_kernels, "OP_BY_OP_MIN_KEYS", 1)
    _every_bulk_call_op_by_op(monkeypatch)
    with tf.device("/CPU:1"):
        tables = [HashTable(tf.int64, tf.float32, 2, name=f"t{i}") for i in range(2)]
    errors: list[BaseException] = []

    def write(table: HashTable, seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                keys = rng.integers(0, 500, 40)
                table.insert(tf.constant(keys), tf.ones([40, 2]))
                table.lookup(tf.constant(keys))
        except BaseException as err:  # reported below, with the thread's table
            errors.append(err)

    threads = [threading.Thread(target=write, args=(t, i)) for i, t in enumerate(tables)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


class _Clock:
    """A ``time`` stand-in whose every op-by-op call takes ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.started = 0.0, step, False

    def perf_counter(self) -> float:
        if self.started:
            self.now += self.step
        self.started = not self.started
        return self.now


def test_a_kernel_is_traced_behind_its_bulk_calls_once_they_took_trace_after_s(monkeypatch):
    """Bulk calls of a kernel not traced run op by op; its trace starts in the background
    only once those calls took ``TRACE_AFTER_S`` in all (a few bulk calls are faster
    without it), and once only."""
    table = HashTable(tf.int64, tf.float32, 6, name="traced_later")
    kernels = table._kernels
    kernels._op_by_op_s.clear()
    traced: list[str] = []
    monkeypatch.setattr(_kernels.Kernels, "_cached", lambda self, name: False)
    monkeypatch.setattr(_kernels.Kernels, "_trace_behind", lambda self, name: traced.append(name))
    monkeypatch.setattr(_kernels, "time", _Clock(0.4 * _kernels.TRACE_AFTER_S))
    rng = np.random.default_rng(6)
    seen = []
    for _ in range(4):
        keys = rng.integers(0, 10**9, BULK)
        table.insert(tf.constant(keys), tf.zeros([BULK, 6]))
        seen.append(list(traced))
    assert seen == [[], [], ["insert"], ["insert", "insert"]]  # asked again: one trace
    assert kernels._op_by_op_s["insert"] == pytest.approx(1.6 * _kernels.TRACE_AFTER_S)


def test_a_traced_insert_runs_op_by_op_until_its_race_is_compiled(monkeypatch):
    """A bulk insert whose kernel is traced still runs op by op while this process has not
    compiled the race of the table's capacity (the traced kernel would wait for it), and
    traced once it has."""
    table = HashTable(tf.int64, tf.float32, 6, name="until_compiled")
    rng = np.random.default_rng(8)
    table.insert(tf.constant(rng.integers(0, 10**9, 10)), tf.zeros([10, 6]))  # traced
    table.reserve(4 * BULK)  # no growth below
    calls: list[str] = []
    run = _kernels.Kernels._op_by_op
    monkeypatch.setattr(
        _kernels.Kernels,
        "_op_by_op",
        lambda self, name, *a: calls.append(name) or run(self, name, *a),
    )
    _nothing_compiled(monkeypatch)
    table.insert(tf.constant(rng.integers(0, 10**9, BULK)), tf.zeros([BULK, 6]))
    assert calls == ["insert"]
    _xla.wait_for_compiles()
    assert _xla.compiled_race(_index.race_from[table._kernels.config.serial_scatter], table.index)
    table.insert(tf.constant(rng.integers(0, 10**9, BULK)), tf.zeros([BULK, 6]))
    assert calls == ["insert"]


def test_a_bulk_call_that_grew_its_table_hands_freed_memory_back(monkeypatch):
    """The arrays a growth replaced, and the buffers of its steps, go back to the system
    after a bulk insert that grew the table (``malloc_trim``, where TensorFlow allocates
    with malloc); calls that grew nothing, and small calls, leave malloc alone."""
    trims: list[str] = []
    monkeypatch.setattr(_kernels, "release_freed_memory", lambda: trims.append("trim"))
    rng = np.random.default_rng(9)
    keys = rng.choice(10**9, 10 * BULK, replace=False).astype(np.int64)
    values = rng.normal(size=(10 * BULK, 2)).astype(np.float32)
    table = HashTable(tf.int64, tf.float32, 2, name="trimmed")
    model: dict = {}

    def insert(at: slice) -> int:
        table.insert(tf.constant(keys[at]), tf.constant(values[at]))
        _model_insert(model, keys[at], values[at])
        return len(trims)

    assert insert(slice(0, BULK)) == 1  # the empty table grew
    assert insert(slice(0, BULK)) == 1  # the same keys: no growth
    assert insert(slice(BULK, BULK + 100)) == 1  # a small call
    assert insert(slice(BULK + 100, 10 * BULK)) == 2  # past the room the first growth left
    _check(table, model)


def _early_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[tuple[str, int]], list[bool], threading.Event]:
    """The early writes of eager inserts from now on (:class:`_table_ops._EarlyRows`):
    ``(thread name, rows)`` of each, for each whether its rows were the batch's, and an
    event set once one started."""
    written: list[tuple[str, int]] = []
    kept: list[bool] = []
    started = threading.Event()
    write, final = _table_ops._EarlyRows._write, _table_ops._EarlyRows.final

    def watched_write(self: _table_ops._EarlyRows, base: tf.Tensor, n: int) -> None:
        written.append((threading.current_thread().name, n))
        started.set()
        write(self, base, n)

    def watched_final(self: _table_ops._EarlyRows) -> bool:
        result = final(self)
        if self.writing is not None:
            kept.append(result)
        return result

    monkeypatch.setattr(_table_ops._EarlyRows, "_write", watched_write)
    monkeypatch.setattr(_table_ops._EarlyRows, "final", watched_final)
    return written, kept, started


@pytest.mark.parametrize(
    ("before", "early", "kept"),
    [
        ("room", [BULK], [True]),
        ("present_and_repeated", [BULK], [False]),
        ("freed_rows", [], []),
        ("no_room", [], []),
        ("no_room_compile_waited", [BULK], [True]),
    ],
)
def test_an_eager_bulk_insert_writes_its_rows_beside_its_claims(monkeypatch, before, early, kept):
    """An op-by-op insert on the host's first CPU writes its rows in another thread while
    it claims the keys' slots, as they are if every key is new. A batch with present or
    repeated keys writes its rows again where they belong; a table with freed rows to
    hand out, or without room for the batch (unless the race waits for its compile
    anyway), writes none early. Every way, each key holds its last value."""
    _every_bulk_call_op_by_op(monkeypatch)
    rng = np.random.default_rng(13)
    table = HashTable(tf.int64, tf.float32, 3, name="early_rows")
    model: dict = {}
    keys = rng.choice(10**12, 3 * BULK, replace=False)
    values = rng.normal(size=(keys.size, 3)).astype(np.float32)
    if before in ("room", "present_and_repeated"):
        table.reserve(3 * BULK)
    if before in ("present_and_repeated", "freed_rows"):
        table.insert(tf.constant(keys[:BULK]), tf.constant(values[:BULK]))
        _model_insert(model, keys[:BULK], values[:BULK])
    if before == "freed_rows":
        table.remove(tf.constant(keys[:100]))
        for key in keys[:100].tolist():
            del model[key]
    gate = None
    if before == "no_room_compile_waited":  # the race waits for a compile held until then
        _nothing_compiled(monkeypatch)
        monkeypatch.setattr(_claim_loop, "WAIT_MIN_KEYS", BULK)
        gate = _held_compiles(monkeypatch)
    batch = keys[BULK : 2 * BULK]
    if before == "present_and_repeated":  # half present, a tenth repeated
        batch = np.concatenate([keys[: BULK // 2], keys[BULK : BULK + BULK // 2]])
        tenth = BULK // 10
        batch[:tenth] = batch[-tenth:]
    new_values = rng.normal(size=(batch.size, 3)).astype(np.float32)
    written, rows_kept, started = _early_writes(monkeypatch)
    if gate is None:
        table.insert(tf.constant(batch), tf.constant(new_values))
    else:
        inserting = threading.Thread(
            target=table.insert, args=(tf.constant(batch), tf.constant(new_values))
        )
        inserting.start()
        assert started.wait(60), "no early write while the race waited for its compile"
        gate.set()
        inserting.join(60)
        assert not inserting.is_alive()
    _model_insert(model, batch, new_values)
    assert [n for _, n in written] == early
    assert all(name.startswith("de_store-rows") for name, _ in written)
    assert rows_kept == kept
    _check(table, model)
    assert int(table.size()) == len(model)


def test_an_error_of_the_early_writes_reaches_the_caller(monkeypatch):
    _every_bulk_call_op_by_op(monkeypatch)
    table = HashTable(tf.int64, tf.float32, 2, name="early_error")
    table.reserve(2 * BULK)

    def failing(self: _table_ops._EarlyRows, base: tf.Tensor, n: int) -> None:
        raise tf.errors.ResourceExhaustedError(None, None, "no memory for the rows")

    monkeypatch.setattr(_table_ops._EarlyRows, "_write", failing)
    keys = np.arange(BULK, dtype=np.int64)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="no memory for the rows"):
        table.insert(tf.constant(keys), tf.ones([BULK, 2]))
