"""A local ``ParameterServerStrategy`` cluster for the benchmarks: a chief (this process),
workers and PS tasks, each other task a ``tf.distribute.Server`` process on a free
127.0.0.1 port, described by ``TF_CONFIG``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from de_store.testing.servers import free_ports

SERVER = (
    "import tensorflow as tf\n"
    "c = tf.distribute.cluster_resolver.TFConfigClusterResolver()\n"
    "tf.distribute.Server(c.cluster_spec(), job_name=c.task_type, task_index=c.task_id,"
    " protocol='grpc', start=True).join()\n"
)


@contextmanager
def chief_of(workers: int, ps: int) -> Iterator[dict[str, list[str]]]:
    """Start the servers of ``workers`` workers and ``ps`` PS tasks, make this process the
    cluster's chief (``TF_CONFIG`` in ``os.environ``) and yield the cluster; kill the
    servers on exit."""
    ports = iter(free_ports(workers + ps + 1))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
        "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)],
    }

    def env(job: str, task: int) -> dict[str, str]:
        config = {"cluster": cluster, "task": {"type": job, "index": task}}
        return dict(os.environ, TF_CONFIG=json.dumps(config), TF_CPP_MIN_LOG_LEVEL="3")

    tasks = [("worker", i) for i in range(workers)] + [("ps", i) for i in range(ps)]
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", SERVER],
            env=env(job, task),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for job, task in tasks
    ]
    os.environ.update(env("chief", 0))
    try:
        yield cluster
    finally:
        for server in servers:
            server.kill()
        for server in servers:
            server.wait()
