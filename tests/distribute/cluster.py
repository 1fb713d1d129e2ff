"""Local TensorFlow clusters for the tf.distribute tests: every task a real process (a
``tf.distribute.Server`` on a free 127.0.0.1 port, described by ``TF_CONFIG``), the
way TensorFlow's own multi-process tests run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from de_store.testing.servers import free_ports

HERE = Path(__file__).parent
SERVER = HERE / "server.py"


def cluster_spec(**jobs: int) -> dict[str, list[str]]:
    """A cluster of ``jobs`` (name -> task count), each task on a free local port."""
    ports = iter(free_ports(sum(jobs.values())))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in jobs.items() if n}


def tf_config(cluster: dict[str, list[str]], job: str, task: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": task}})


def task_env(cluster: dict[str, list[str]], job: str, task: int) -> dict[str, str]:
    env = dict(os.environ, TF_CONFIG=tf_config(cluster, job, task), TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


@contextmanager
def servers(
    cluster: dict[str, list[str]],
    jobs: Sequence[str],
    args: dict[tuple[str, int], Sequence[str]] | None = None,
) -> Iterator[list[subprocess.Popen]]:
    """Start a server process for every task of ``jobs`` (``args``: the arguments of
    ``server.py`` by ``(job, task)``); kill them all on exit. When the body fails and a
    server had exited on its own, the failure names it with its own error output."""
    args = args or {}
    tasks = [(job, task) for job in jobs for task in range(len(cluster.get(job, [])))]
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        try:
            for job, task in tasks:
                with open(Path(logs) / f"{job}{task}", "w") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, str(SERVER), *args.get((job, task), ())],
                            env=task_env(cluster, job, task),
                            stdout=subprocess.DEVNULL,
                            stderr=log,
                        )
                    )
            yield procs
        except BaseException as failure:
            exited = [
                f"the server of {job}:{task} ({cluster[job][task]}) exited with "
                f"{proc.returncode}:\n{(Path(logs) / f'{job}{task}').read_text()[-6000:]}"
                for (job, task), proc in zip(tasks, procs, strict=False)
                if proc.poll() is not None
            ]
            if exited:
                raise AssertionError("\n".join(exited)) from failure
            raise
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()


def run_task(
    script: str,
    cluster: dict[str, list[str]],
    job: str,
    task: int,
    *args: str,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run ``script`` (in this folder) as task ``job:task`` to its end; fail with its
    output when it fails."""
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=task_env(cluster, job, task),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} as {job}:{task} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
        )
    return proc
