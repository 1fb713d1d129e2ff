"""Fixed-shape tables that grow like TFRA's under a ClusterCoordinator (de_store.tables._ps_growth).

On a real local cluster (a chief, a worker, a PS task: every task a process),
``ps_growth_chief.py`` trains two Variables whose ``init_size`` is a tenth of the keys they
end up holding, with no call between steps: one by a plain ``coordinator.schedule`` loop
(steps of a static batch size), one by tf_keras ``model.fit`` (a batch of unknown size).
Every step runs, the tables and their Adagrad slot tables grow between steps, the rows
equal those of the same steps run in this process, and the checkpoint restores them.

The rest drives the coordinator hook with a stand-in coordinator in this process (a
thread running the scheduled steps in order), on tables created with fixed shapes here.
"""

from __future__ import annotations

import json
import threading
from collections import deque

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.optimizers import Adagrad
from de_store.tables import HashTable, _ps_growth
from tests.distribute import cluster, ps_growth_chief


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The chief's report and its checkpoint directory."""
    directory = tmp_path_factory.mktemp("ps_growth")
    spec = cluster.cluster_spec(chief=1, worker=1, ps=1)
    with cluster.servers(spec, ["worker", "ps"]):
        cluster.run_task(
            "ps_growth_chief.py", spec, "chief", 0, str(directory), str(directory / "r.json")
        )
    return json.loads((directory / "r.json").read_text()), directory


@pytest.fixture(scope="module")
def replayed():
    """Values and slots of the chief's steps run one after another in this process."""
    emb = ds.get_variable("growth_replay", dim=ps_growth_chief.DIM, initializer=0.0, bp_v2=True)
    optimizer = Adagrad(
        learning_rate=ps_growth_chief.LEARNING_RATE,
        initial_accumulator_value=ps_growth_chief.ACCUMULATOR,
    )

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number: tf.Tensor) -> tf.Tensor:
        return ps_growth_chief.train_on(emb, optimizer, ps_growth_chief.batch_ids(number))

    options = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})  # as the chief
    try:
        for number in range(ps_growth_chief.STEPS):
            step(tf.constant(number, tf.int64))
    finally:
        tf.config.optimizer.set_experimental_options(options)
    return {
        "values": ps_growth_chief.content(emb),
        "slots": ps_growth_chief.content(emb.companions()["adagrad_accumulator"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["emb", "fit_emb"])
def test_tables_outgrow_init_size_tenfold_with_no_call_between_steps(trained, name):
    report, _ = trained
    found = report[name]
    assert len(found["values"]) == 10 * ps_growth_chief.INIT_SIZE
    assert sorted(found["slots"]) == sorted(found["values"])
    assert found["capacity_after"][0] >= 8 * found["capacity_before"][0]
    grown = {line.split()[2] for line in report["log"] if line.startswith("grew table")}
    assert {f"{name}/shard_0_of_1", f"{name}/adagrad_accumulator/shard_0_of_1"} <= grown


@pytest.mark.slow
def test_every_step_ran(trained):
    report, _ = trained
    assert len(report["losses"]) == ps_growth_chief.STEPS
    assert all(np.isfinite(report["losses"]))
    assert np.isfinite(report["fit_history"]["loss"][-1])
    # fit's batches have no static size: its first step ran alone, bounding the next ones
    assert any(
        line.startswith("the first step writing fit_emb") and line.endswith("runs alone")
        for line in report["log"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["emb", "fit_emb"])
def test_rows_and_slots_equal_the_steps_run_in_one_process(trained, replayed, name):
    report, _ = trained
    assert report[name]["values"] == replayed["values"]
    assert report[name]["slots"] == replayed["slots"]


@pytest.mark.slow
def test_the_checkpoint_restores_exactly(trained):
    report, directory = trained
    saver = ds.HashTableCreator(saver=ds.FileSystemSaver())
    restored = {
        name: ds.Variable(name, dim=ps_growth_chief.DIM, kv_creator=saver)
        for name in ("emb", "fit_emb")
    }
    checkpoint = tf.train.Checkpoint(**restored)
    checkpoint.restore(tf.train.latest_checkpoint(str(directory))).expect_partial()
    for name, variable in restored.items():
        assert ps_growth_chief.content(variable) == report[name]["values"]
        slot = variable.companions()["adagrad_accumulator"]
        assert ps_growth_chief.content(slot) == report[name]["slots"]


# -- the hook in this process --------------------------------------------------------------
class StandIn:
    """What the hook uses of a ``ClusterCoordinator``: ``join`` and the closure queue's
    counts; one worker thread runs the scheduled functions in order."""

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._ready = threading.Condition()
        self._outstanding = 0
        self.errors: list[Exception] = []
        queue = type("Counts", (), {"qsize": lambda _: self._outstanding})()
        closure_queue = type("Queue", (), {"_queue": queue, "inflight_closure_count": 0})()
        self._cluster = type("Cluster", (), {"closure_queue": closure_queue})()
        threading.Thread(target=self._work, daemon=True).start()

    def put(self, fn, args, kwargs):
        with self._ready:
            self._pending.append((fn, args or (), kwargs or {}))
            self._outstanding += 1
            self._ready.notify_all()

    def join(self):
        with self._ready:
            self._ready.wait_for(lambda: self._outstanding == 0)
        if self.errors:
            raise self.errors[0]

    def _work(self):
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending)
                fn, args, kwargs = self._pending.popleft()
            try:
                fn(*args, **kwargs)
            except Exception as err:  # a step that failed: join raises it
                self.errors.append(err)
            with self._ready:
                self._outstanding -= 1
                self._ready.notify_all()


@pytest.fixture
def hooked(monkeypatch):
    """A stand-in coordinator, and a function scheduling through the hook on it."""
    coordinator, keeper = StandIn(), _ps_growth.Keeper()

    def put(target, fn, args=None, kwargs=None):
        target.put(fn, args, kwargs)

    monkeypatch.setattr(_ps_growth, "_schedule", put)

    def schedule(fn, *args):
        keeper.schedule(coordinator, fn, args, None)

    return coordinator, schedule


def fixed_table(name, track_changes=False):
    return HashTable(
        tf.int64, tf.float32, 2, name=name, init_size=128,
        fixed_shapes=True, track_changes=track_changes,
    )  # fmt: skip


def test_steps_of_a_static_batch_size_never_find_a_table_short(hooked):
    coordinator, schedule = hooked
    table = fixed_table("static_batches")

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number):
        keys = number * 64 + tf.range(64, dtype=tf.int64)  # 64 new keys
        table.insert(keys, tf.ones([64, 2]))

    for number in range(40):
        schedule(step, tf.constant(number, tf.int64))
    coordinator.join()
    assert int(table.size()) == 40 * 64
    assert table.capacity() >= 4096


def test_steps_are_bounded_by_the_size_of_their_batch_argument(hooked, caplog):
    coordinator, schedule = hooked
    table = fixed_table("batch_arguments")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def step(keys):
        unique, _ = tf.unique(keys)
        table.insert(unique, tf.ones([tf.size(unique), 2]))

    sizes = np.random.default_rng(3).integers(40, 400, size=30)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    with caplog.at_level("INFO", logger="de_store"):
        for start, size in zip(starts, sizes, strict=False):
            keys = np.arange(start, start + size, dtype=np.int64)  # an array or a tensor
            schedule(step, keys if start % 2 else tf.constant(keys))
        coordinator.join()
    assert int(table.size()) == int(sizes.sum())
    assert "runs alone" not in caplog.text  # each step's bound is its argument's size


def test_steps_of_unknown_size_run_alone_first_then_within_what_they_passed(hooked, caplog):
    coordinator, schedule = hooked
    table = fixed_table("unknown_batches")

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number):
        size = tf.random.stateless_uniform([], [number, 5], 40, 81, tf.int64)
        keys = number * 100 + tf.range(size)  # no bound before the step runs
        table.insert(keys, tf.ones([size, 2]))

    sizes = [int(tf.random.stateless_uniform([], [n, 5], 40, 81, tf.int64)) for n in range(40)]
    with caplog.at_level("INFO", logger="de_store"):
        for number in range(40):
            schedule(step, tf.constant(number, tf.int64))
        coordinator.join()
    assert int(table.size()) == sum(sizes)
    assert "the first step writing unknown_batches without a static bound runs alone" in caplog.text


def test_removals_in_steps_grow_the_removal_log(hooked):
    coordinator, schedule = hooked
    table = fixed_table("removals", track_changes=True)

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number):
        keys = number * 32 + tf.range(32, dtype=tf.int64)
        table.insert(keys, tf.ones([32, 2]))
        table.remove(keys[:24])  # 24 removals a step: the log starts with room for 16

    for number in range(20):
        schedule(step, tf.constant(number, tf.int64))
    coordinator.join()
    assert int(table.size()) == 20 * 8
    assert int(table.removed.shape[0]) >= 20 * 24


def test_steps_that_write_no_fixed_table_are_scheduled_as_they_are(hooked, monkeypatch):
    coordinator, schedule = hooked
    fixed_table("unwritten")
    reads = []
    monkeypatch.setattr(_ps_growth, "read_loads", lambda tables: reads.append(tables))
    local = ds.Variable("growth_local", dim=2)  # a table of this process: it grows itself

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number):
        local.upsert(number * 8 + tf.range(8, dtype=tf.int64), tf.ones([8, 2]))

    for number in range(5):
        schedule(step, tf.constant(number, tf.int64))
    coordinator.join()
    assert reads == [] and int(local.size()) == 40
