"""TFRA's programs under ParameterServerStrategy, on real local clusters (every task a
process): its training idiom (``embedding_lookup(..., return_trainable=True)``,
``tape.gradient`` on the wrapper, ``DynamicEmbeddingOptimizer(...).apply_gradients``) with
every kind of optimizer, and tf_keras ``model.fit`` in the shape of TFRA's
movielens-1m-keras-ps demo with two workers, saved by ``ModelCheckpoint`` and restored
into three PS tasks and into one process (tests/distribute/ps_tfra_chief.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.distribute import cluster

pytestmark = pytest.mark.slow

STEPS = 6
KERAS_2 = {"TF_USE_LEGACY_KERAS": "1"}


def run_chief(spec: dict, env: dict[str, str], *args: str) -> None:
    """``ps_tfra_chief.py`` as the chief of ``spec``, under the Keras ``env`` selects."""
    proc = subprocess.run(
        [sys.executable, str(cluster.HERE / "ps_tfra_chief.py"), *args],
        env={**cluster.task_env(spec, "chief", 0), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


LOOPS = {"keras 3": ({}, "adam,nadam"), "keras 2": (KERAS_2, "adam,legacy_adam,legacy_sgd")}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The idiom's report under Keras 3 and under Keras 2, and tf_keras fit's, on one
    worker and 2 PS tasks (the steps run in order: the idiom's tables must equal those of
    the same steps in one process; tests/compat and tests/keras2 check every optimizer's
    update of rows held as tensors against a dense variable)."""
    directory = tmp_path_factory.mktemp("ps_tfra")
    spec = cluster.cluster_spec(chief=1, worker=1, ps=2)
    reports = {}
    with cluster.servers(spec, ["worker", "ps"]):
        for name, (env, optimizers) in LOOPS.items():
            out = directory / f"{name}.json"
            run_chief(spec, env, "loop", str(out), str(STEPS), optimizers)
            reports[name] = json.loads(out.read_text())
        out = directory / "fit.json"
        run_chief(spec, KERAS_2, "fit", str(out), str(directory / "ckpt"), "8")
        reports["fit"] = json.loads(out.read_text())
    return reports


@pytest.mark.parametrize("keras", ["keras 3", "keras 2"])
def test_tfras_idiom_trains_the_ps_tables_as_one_process_does(one_worker, keras: str) -> None:
    report = dict(one_worker[keras])
    report.pop("refused")
    assert sorted(report) == sorted(LOOPS[keras][1].split(","))
    for name, result in report.items():
        ps, local = result["ps"], result["local"]
        assert sorted(ps) == sorted(local) and len(ps) > 60, name
        for key, row in ps.items():  # the fused legacy kernels round apart by 1 ulp
            np.testing.assert_allclose(row, local[key], rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(result["ps_losses"], result["local_losses"], atol=1e-6)
        assert result["ps_losses"][-1] < result["ps_losses"][0], name
    assert report["adam"]["slots"] == ["adam_m", "adam_v"]


def test_tf_keras_fit_trains_the_tables_with_one_worker(one_worker) -> None:
    tables = one_worker["fit"]["tables"]
    assert len(tables["user_embedding"]) > 150 and len(tables["movie_embedding"]) > 100
    assert sorted(tables["user_embedding"]) == sorted(tables["user_embedding/adam_m"])


@pytest.mark.parametrize("keras", ["keras 3", "keras 2"])
def test_an_optimizer_without_a_tensor_update_fails_its_step_naming_the_variable(
    one_worker, keras: str
) -> None:
    """No worker aborts: the step's tracing raises, and the chief goes on."""
    refused = one_worker[keras]["refused"]
    assert sorted(refused) == (["legacy_rmsprop", "v1_adam"] if keras == "keras 2" else ["v1_adam"])
    for name, error in refused.items():
        assert (
            f"VariableError: variable 'refused_{name}': its tables live on parameter servers"
            in error
        )


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """tf_keras fit in TFRA's demo shape with 2 workers; its report and checkpoints."""
    directory = tmp_path_factory.mktemp("ps_fit")
    spec = cluster.cluster_spec(chief=1, worker=2, ps=2)
    with cluster.servers(spec, ["worker", "ps"]):
        run_chief(spec, KERAS_2, "fit", str(directory / "fit.json"), str(directory / "ckpt"), "15")
    return json.loads((directory / "fit.json").read_text()), directory / "ckpt"


def test_tf_keras_fit_trains_the_tables_with_two_workers(fitted) -> None:
    report, directory = fitted
    tables = report["tables"]
    assert sorted(tables) == sorted(
        f"{layer}{slot}"
        for layer in ("movie_embedding", "user_embedding")
        for slot in ("", "/adam_m", "/adam_v")
    )
    assert len(tables["user_embedding"]) > 250 and len(tables["movie_embedding"]) > 150
    assert all(np.isfinite(row).all() for rows in tables.values() for row in rows.values())
    assert sorted(p.name for p in directory.glob("ckpt-*.index")) == [
        "ckpt-1.index",
        "ckpt-2.index",
    ]


def test_the_fit_checkpoint_restores_exactly_into_three_ps_tasks(fitted, tmp_path) -> None:
    report, directory = fitted
    spec = cluster.cluster_spec(chief=1, worker=1, ps=3)
    with cluster.servers(spec, ["worker", "ps"]):
        run_chief(spec, KERAS_2, "restore", str(tmp_path / "r.json"), str(directory))
    restored = json.loads((tmp_path / "r.json").read_text())
    assert len(restored["per_task"]) == 3 and all(n > 0 for n in restored["per_task"])
    assert restored["tables"] == report["tables"]


def test_the_fit_checkpoint_restores_exactly_into_one_process(fitted, tmp_path) -> None:
    report, directory = fitted
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = subprocess.run(
        [
            sys.executable,
            str(cluster.HERE / "ps_tfra_chief.py"),
            "restore",
            str(tmp_path / "r.json"),
            str(directory),
        ],
        env={**env, **KERAS_2, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    restored = json.loads((tmp_path / "r.json").read_text())
    assert restored["per_task"] == [len(report["tables"]["user_embedding"])]
    assert restored["tables"] == report["tables"]
