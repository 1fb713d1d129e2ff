"""TFRA's programs under ParameterServerStrategy, on real local clusters (every task a
process): its training idiom (``embedding_lookup(..., return_trainable=True)``,
``tape.gradient`` on the wrapper, ``DynamicEmbeddingOptimizer(...).apply_gradients``) with
every kind of optimizer, and tf_keras ``model.fit`` in the shape of TFRA's
movielens-1m-keras-ps demo with two workers, its tables growing past ten times their
``init_size`` while it runs, saved by ``ModelCheckpoint`` and restored
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


OPTIMIZERS = "adam,legacy_adam,legacy_sgd"  # tf_keras's current Adam and two legacy ones


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Under Keras 2, on one worker and 2 PS tasks, the idiom's report then tf_keras fit's,
    from one chief process. With one worker the steps run in order: the idiom's tables
    must equal those of the same steps in one process. (tests/distribute/test_ps.py runs
    the idiom under Keras 3 with two workers; tests/compat and tests/keras2 check every
    optimizer's update of rows held as tensors against a dense variable.)"""
    directory = tmp_path_factory.mktemp("ps_tfra")
    spec = cluster.cluster_spec(chief=1, worker=1, ps=2)
    loop, fit = directory / "loop.json", directory / "fit.json"
    with cluster.servers(spec, ["worker", "ps"]):
        run_chief(
            spec, KERAS_2, "loop+fit", str(loop), str(STEPS), OPTIMIZERS,
            str(fit), str(directory / "ckpt"), "8",
        )  # fmt: skip
    return {"keras 2": json.loads(loop.read_text()), "fit": json.loads(fit.read_text())}


def test_tfras_idiom_trains_the_ps_tables_as_one_process_does(one_worker) -> None:
    report = dict(one_worker["keras 2"])
    report.pop("refused")
    assert sorted(report) == sorted(OPTIMIZERS.split(","))
    for name, result in report.items():
        ps, local = result["ps"], result["local"]
        # init_size 6: the tables grew on the PS tasks to 10 times that
        assert sorted(ps) == sorted(local) and len(ps) >= 60, name
        for key, row in ps.items():  # the fused legacy kernels round apart by 1 ulp
            np.testing.assert_allclose(row, local[key], rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(result["ps_losses"], result["local_losses"], atol=1e-6)
        assert result["ps_losses"][-1] < result["ps_losses"][0], name
    assert report["adam"]["slots"] == ["adam_m", "adam_v"]


def test_tf_keras_fit_trains_the_tables_with_one_worker(one_worker) -> None:
    report = one_worker["fit"]
    tables = report["tables"]
    assert len(tables["user_embedding"]) > 150 and len(tables["movie_embedding"]) > 100
    assert sorted(tables["user_embedding"]) == sorted(tables["user_embedding/adam_m"])
    assert len(report["loss"]) == 2
    assert any(name.startswith("user_embedding") for name in report["grown"])


def test_an_optimizer_without_a_tensor_update_fails_its_step_naming_the_variable(
    one_worker,
) -> None:
    """No worker aborts: the step's tracing raises, and the chief goes on."""
    refused = one_worker["keras 2"]["refused"]
    assert sorted(refused) == ["legacy_rmsprop", "v1_adam"]
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
    # init_size 20: the tables grew on the PS tasks while fit ran, to 10x and more
    assert len(tables["user_embedding"]) >= 200 and len(tables["movie_embedding"]) > 150
    assert len(report["loss"]) == 2
    grown = {name.split("/")[0] for name in report["grown"]}
    assert {"user_embedding", "movie_embedding"} <= grown, report["grown"]
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
