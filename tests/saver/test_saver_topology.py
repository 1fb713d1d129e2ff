"""Which rank a process is, from arguments or the launch environment."""

from __future__ import annotations

import json

import pytest

from de_store.checkpoint.topology import Topology, detect_topology


def test_explicit_arguments_win_over_environment() -> None:
    env = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"}
    assert detect_topology(4, 1, env) == Topology(4, 1, "explicit")


def test_single_process_without_launch_variables() -> None:
    assert detect_topology(environ={}) == Topology(1, 0, "single")


def test_tf_config_counts_chief_then_workers() -> None:
    cluster = {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}
    config = {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    assert detect_topology(environ={"TF_CONFIG": json.dumps(config)}) == Topology(3, 2, "TF_CONFIG")


@pytest.mark.parametrize(
    ("cluster", "task", "source"),
    [
        ({"chief": ["h0:1"], "worker": ["h1:1"], "ps": ["h3:1"]}, ("chief", 0), "TF_CONFIG"),
        ({"chief": ["h0:1"], "worker": ["h1:1"], "ps": ["h3:1"]}, ("worker", 0), "single"),
        ({"worker": ["h1:1", "h2:1"], "ps": ["h3:1"]}, ("worker", 0), "TF_CONFIG"),
    ],
)
def test_tf_config_of_a_parameter_server_cluster_saves_from_its_chief_alone(
    cluster: dict, task: tuple, source: str
) -> None:
    config = {"cluster": cluster, "task": {"type": task[0], "index": task[1]}}
    found = detect_topology(environ={"TF_CONFIG": json.dumps(config)})
    assert (found.proc_size, found.proc_rank, found.source) == (1, 0, source)


def test_tf_config_ps_task_is_not_a_saving_rank() -> None:
    config = {"cluster": {"worker": ["h1:1"], "ps": ["h3:1"]}, "task": {"type": "ps", "index": 0}}
    assert detect_topology(environ={"TF_CONFIG": json.dumps(config)}).source == "single"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, Topology(4, 2, "OMPI")),
        ({"PMI_SIZE": "3", "PMI_RANK": "0"}, Topology(3, 0, "PMI")),
    ],
)
def test_mpi_launch_variables(env: dict[str, str], expected: Topology) -> None:
    assert detect_topology(environ=env) == expected


def test_rank_out_of_range_names_both_values() -> None:
    with pytest.raises(
        ValueError, match=r"proc_rank must be an int in \[0, proc_size=2\), got proc_rank=2"
    ):
        detect_topology(2, 2)


def test_only_one_of_size_and_rank_is_an_error() -> None:
    with pytest.raises(ValueError, match="proc_size=2, proc_rank=None"):
        detect_topology(2, None)


def test_malformed_tf_config_names_it() -> None:
    with pytest.raises(ValueError, match="TF_CONFIG is not valid cluster JSON"):
        detect_topology(environ={"TF_CONFIG": "{not json"})
