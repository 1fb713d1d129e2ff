"""Which process this is, and how many take part in a save.

``proc_size`` / ``proc_rank`` are given explicitly or detected, in this order, from
``TF_CONFIG`` (a ``tf.distribute`` multi-worker cluster: chief and workers are ranks; in a
cluster with ``ps`` tasks the chief alone saves), Open MPI launch variables
(``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK``) and PMI variables
(``PMI_SIZE`` / ``PMI_RANK``, set by MPICH, Intel MPI and Slurm). Without any of them the
job is a single process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

_WORKER_TASK_TYPES = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The processes of a save or restore.

    Attributes
    ----------
    proc_size: number of processes writing (or reading) the checkpoint.
    proc_rank: this process's rank, ``0 <= proc_rank < proc_size``.
    source: where the figures came from ("explicit", "TF_CONFIG", "OMPI", "PMI", "single").
    """

    proc_size: int
    proc_rank: int
    source: str = "explicit"

    def __post_init__(self) -> None:
        if not isinstance(self.proc_size, int) or self.proc_size < 1:
            raise ValueError(f"proc_size must be an int >= 1, got {self.proc_size!r}")
        if not isinstance(self.proc_rank, int) or not 0 <= self.proc_rank < self.proc_size:
            raise ValueError(
                f"proc_rank must be an int in [0, proc_size={self.proc_size}), "
                f"got proc_rank={self.proc_rank!r}"
            )

    @property
    def is_chief(self) -> bool:
        """Whether this rank merges and commits the manifest."""
        return self.proc_rank == 0


def detect_topology(
    proc_size: int | None = None,
    proc_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """Return the topology from explicit arguments or the launch environment.

    Raises
    ------
    ValueError
        Only one of ``proc_size`` / ``proc_rank`` is given, or they are out of range.
    """
    if (proc_size is None) != (proc_rank is None):
        raise ValueError(
            "proc_size and proc_rank must be given together, got "
            f"proc_size={proc_size!r}, proc_rank={proc_rank!r}"
        )
    if proc_size is not None and proc_rank is not None:
        return Topology(proc_size, proc_rank, "explicit")
    env = os.environ if environ is None else environ
    for detect in (_from_tf_config, _from_ompi, _from_pmi):
        found = detect(env)
        if found is not None:
            return found
    return Topology(1, 0, "single")


def _from_tf_config(env: Mapping[str, str]) -> Topology | None:
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
        cluster = config.get("cluster", {})
        task = config.get("task", {})
        task_type, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"TF_CONFIG is not valid cluster JSON: {raw!r}") from err
    if task_type not in _WORKER_TASK_TYPES:
        return None
    if cluster.get("ps"):
        # A parameter-server cluster: its chief (worker 0 without one) runs the training
        # loop and saves alone; the tables live on the PS tasks and are read from there.
        coordinator = "chief" if cluster.get("chief") else "worker"
        if (task_type, index) == (coordinator, 0):
            return Topology(1, 0, "TF_CONFIG")
        return None
    chiefs = len(cluster.get("chief", []))
    workers = len(cluster.get("worker", []))
    rank = index if task_type == "chief" else chiefs + index
    return Topology(chiefs + workers, rank, "TF_CONFIG")


def _from_env_pair(env: Mapping[str, str], size_var: str, rank_var: str, source: str):
    if size_var not in env or rank_var not in env:
        return None
    try:
        size, rank = int(env[size_var]), int(env[rank_var])
    except ValueError as err:
        raise ValueError(
            f"{size_var}={env[size_var]!r} and {rank_var}={env[rank_var]!r} must be integers"
        ) from err
    return Topology(size, rank, source)


def _from_ompi(env: Mapping[str, str]) -> Topology | None:
    return _from_env_pair(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI")


def _from_pmi(env: Mapping[str, str]) -> Topology | None:
    return _from_env_pair(env, "PMI_SIZE", "PMI_RANK", "PMI")
