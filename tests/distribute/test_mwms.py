"""MultiWorkerMirroredStrategy: a table split over 2 worker processes of a real local
cluster (worker ``r`` owns the keys ``k mod n == r``; lookups and gradient rows go through
collective all-to-all), saved by every worker through the coordination-service barrier,
restored into 3 workers and into one process; and a worker killed in the middle of a save."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.optimizers import Adagrad
from tests.distribute import cluster, mwms_worker

pytestmark = pytest.mark.slow

STEPS = 20
WORKER = str(cluster.HERE / "mwms_worker.py")


def _run_workers(count: int, *args: str, expect_ok: bool = True) -> list[subprocess.Popen]:
    spec = cluster.cluster_spec(worker=count)
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, args[0], args[1], args[2].format(rank=r), *args[3:]],
            env=cluster.task_env(spec, "worker", r),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(count)
    ]
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    if expect_ok:
        codes = [proc.returncode for proc in procs]
        assert codes == [0] * count, [e[-3000:] for e in errors]
    return procs


def _merged(reports: list[dict], field: str = "values") -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for report in reports:
        assert not set(merged) & set(report[field])  # no key on two workers
        merged.update(report[field])
    return merged


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mwms")
    _run_workers(2, "train", str(directory), str(directory / "train-{rank}.json"), str(STEPS))
    reports = [json.loads((directory / f"train-{r}.json").read_text()) for r in range(2)]
    return reports, directory / f"step-{STEPS}"


def _single_process_run(
    workers: int = 2, steps: int = STEPS
) -> tuple[list[list[float]], dict[str, list[float]]]:
    """The same steps in one process: each step's batches of all workers in one loss (the
    sum of the workers' losses), one Adagrad update of every row."""
    variable = ds.Variable(f"emb_reference_{workers}", dim=mwms_worker.DIM, initializer=0.0)
    optimizer = Adagrad(learning_rate=mwms_worker.LEARNING_RATE)

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number):
        batches = [mwms_worker.batch(number * workers + r) for r in range(workers)]
        ids = tf.concat([ids for ids, _ in batches], 0)
        with tf.GradientTape() as tape:
            rows = variable.lookup(ids)
            tape.watch(rows)
            parts = tf.split(rows, workers)
            losses = [mwms_worker.loss_of(p, t) for p, (_, t) in zip(parts, batches, strict=True)]
            loss = tf.add_n(losses)
        optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, variable)])
        return tf.stack(losses)

    losses = [step(tf.constant(i, tf.int64)).numpy().tolist() for i in range(steps)]
    return losses, mwms_worker.content(variable)


def _assert_trains_like_one_process(reports: list[dict], steps: int) -> None:
    workers = len(reports)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert {int(k) % workers for k in report["values"]} == {rank}
    losses, expected = _single_process_run(workers, steps)
    for rank, report in enumerate(reports):  # the same loss, step by step
        np.testing.assert_allclose(report["losses"], [s[rank] for s in losses], rtol=1e-4)
    merged = _merged(reports)
    assert sorted(merged) == sorted(expected)
    for key, row in expected.items():
        np.testing.assert_allclose(merged[key], row, rtol=1e-4, atol=1e-6)


def test_two_workers_own_their_keys_and_train_like_one_process(trained):
    reports, _ = trained
    _assert_trains_like_one_process(reports, STEPS)


def test_three_workers_train_like_one_process(tmp_path):
    steps = 8
    _run_workers(3, "train", str(tmp_path), str(tmp_path / "t-{rank}.json"), str(steps))
    reports = [json.loads((tmp_path / f"t-{r}.json").read_text()) for r in range(3)]
    _assert_trains_like_one_process(reports, steps)


def test_a_checkpoint_of_two_workers_restores_into_three(trained, tmp_path):
    reports, url = trained
    _run_workers(3, "restore", str(url), str(tmp_path / "r-{rank}.json"))
    restored = [json.loads((tmp_path / f"r-{r}.json").read_text()) for r in range(3)]
    for rank, report in enumerate(restored):
        assert {int(k) % 3 for k in report["values"]} == {rank}
    assert _merged(restored) == _merged(reports)


def test_a_checkpoint_of_two_workers_restores_into_one_process(trained):
    reports, url = trained
    variable = ds.Variable("emb", dim=mwms_worker.DIM)
    manifest = ds.restore([variable], str(url))
    assert manifest.proc_size == 2
    assert mwms_worker.content(variable) == _merged(reports)


def test_a_worker_killed_mid_save_commits_nothing_and_the_job_restores_the_last_commit(
    tmp_path,
):
    procs = _run_workers(
        2, "train", str(tmp_path), str(tmp_path / "t-{rank}.json"), str(STEPS), "die",
        expect_ok=False,
    )  # fmt: skip
    assert procs[1].returncode == -9  # rank 1 SIGKILLed itself with its shards written
    assert procs[0].returncode != 0  # rank 0 never met it at the barrier
    with pytest.raises(ds.errors.CheckpointNotFoundError):
        ds.restore([ds.Variable("emb", dim=mwms_worker.DIM)], str(tmp_path / f"step-{2 * STEPS}"))
    saved = _merged([json.loads((tmp_path / f"t-{r}.json").read_text()) for r in range(2)], "saved")
    # the restarted job (two new worker processes) restores the last committed checkpoint
    _run_workers(2, "restore", str(tmp_path / f"step-{STEPS}"), str(tmp_path / "r-{rank}.json"))
    restored = [json.loads((tmp_path / f"r-{r}.json").read_text()) for r in range(2)]
    assert _merged(restored) == saved
