"""ParameterServerStrategy: a de_store Variable spread over the PS tasks of a real local
cluster (a chief, 2 workers, 2 PS tasks: every task a process), trained by steps the
ClusterCoordinator runs on the workers, saved by CheckpointManager from the chief, and
restored into 3 PS tasks and into a single process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.backends import open_location
from de_store.checkpoint.commit import read_manifest
from de_store.cli import main as cli_main
from de_store.optimizers import Adagrad
from tests.distribute import cluster, ps_chief

pytestmark = pytest.mark.slow

STEPS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The chief's report of a training run and its checkpoint directory."""
    directory = tmp_path_factory.mktemp("ps")
    spec = cluster.cluster_spec(chief=1, worker=2, ps=2)
    with cluster.servers(spec, ["worker", "ps"]):
        cluster.run_task(
            "ps_chief.py",
            spec,
            "chief",
            0,
            "train",
            str(directory / "ckpt"),
            str(directory / "train.json"),
            str(STEPS),
        )
    return json.loads((directory / "train.json").read_text()), directory / "ckpt"


def test_the_variable_lives_on_the_ps_tasks_and_trains(trained):
    report, _ = trained
    assert report["devices"] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
    assert all(n > 0 for n in report["per_task"])
    assert sum(report["per_task"]) == len(report["values"])
    losses = report["losses"]
    assert len(losses) == STEPS
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    # as the same steps run one after another in one process (the workers' steps overlap)
    assert np.mean(losses[-10:]) < 1.5 * np.mean(_single_process_losses()[-10:])
    assert sorted(report["slots"]) == ["adagrad_accumulator"]
    assert sorted(report["slots"]["adagrad_accumulator"]) == sorted(report["values"])


def test_each_ps_task_wrote_its_tables_as_binary_shards(trained):
    """The PS tables were written by ops on their PS tasks (``benchmarks/ps_bench.py``
    measures the bytes that reach the chief): binary shards, one per task, a raw file per
    column, every byte covered by the crc32c checks of ``verify``."""
    _, directory = trained
    url = str(directory / "de_store" / "ckpt-1")
    _, manifest = read_manifest(*open_location(url))
    records = manifest.variables["emb"].shards
    assert len(records) == 2
    for record in records:
        assert record.info["format"] == "binary"
        files = [f["path"].rsplit("-", 1)[1] for f in record.info["files"]]
        assert files == ["keys", "values", "adagrad_accumulator"]
    leftovers = [p.name for p in directory.rglob("*") if ".tf." in p.name]
    assert leftovers == []
    assert cli_main(["verify", "-q", url]) == 0


def test_steps_with_more_new_keys_than_the_tables_room_run_as_the_chief_grows_them(trained):
    report, _ = trained
    before = report["before_far"]
    assert report["far_new_keys"] > before["room"]
    losses = report["far_losses"]  # every step ran
    assert len(losses) == ps_chief.FAR_STEPS and all(np.isfinite(losses))
    assert report["size_after_far"] == before["size"] + report["far_new_keys"]
    assert report["rows_after_far"] > before["rows"]  # grown between the steps
    assert report["rows_after_reserve"] >= 2 * report["rows_after_far"]  # reserve still grows


def _single_process_losses() -> list[float]:
    emb = ds.get_variable("emb_reference", dim=ps_chief.DIM, initializer=0.0, bp_v2=True)
    step = ps_chief.make_step(emb, Adagrad(learning_rate=ps_chief.LEARNING_RATE))
    return [float(step(tf.constant(i, tf.int64))) for i in range(STEPS)]


def test_tfras_idiom_trains_on_two_workers_and_a_v1_optimizer_is_refused(trained):
    """Keras 3 Adam through DynamicEmbeddingOptimizer: no worker aborts, the loss falls
    (tests/distribute/test_ps_tfra.py compares one worker's tables with one process's)."""
    report = trained[0]["tfra"]
    assert report["size"] > 150 and report["slots"] == ["adam_m", "adam_v"]
    assert np.mean(report["losses"][-3:]) < np.mean(report["losses"][:3])
    assert list(report["refused"]) == ["v1_adam"]
    assert (
        "VariableError: variable 'refused_v1_adam': its tables live on parameter servers"
        in (report["refused"]["v1_adam"])
    )


def test_the_checkpoint_restores_into_three_ps_tasks(trained, tmp_path):
    report, directory = trained
    spec = cluster.cluster_spec(chief=1, worker=1, ps=3)
    with cluster.servers(spec, ["worker", "ps"]):
        cluster.run_task(
            "ps_chief.py", spec, "chief", 0, "restore", str(directory), str(tmp_path / "r.json")
        )
    restored = json.loads((tmp_path / "r.json").read_text())
    assert len(restored["per_task"]) == 3 and all(n > 0 for n in restored["per_task"])
    assert restored["values"] == report["values"]
    assert restored["slots"] == report["slots"]


def test_the_checkpoint_restores_into_a_single_process(trained):
    report, directory = trained
    emb = ds.get_variable(
        "emb", dim=4, initializer=0.0, kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver())
    )
    tf.train.Checkpoint(emb=emb).restore(tf.train.latest_checkpoint(str(directory)))
    keys, values = emb.export()
    found = {str(k): v for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)}
    assert found == report["values"]
    slot = emb.companions()["adagrad_accumulator"]
    keys, values = slot.export()
    assert len(keys) == len(report["slots"]["adagrad_accumulator"])
