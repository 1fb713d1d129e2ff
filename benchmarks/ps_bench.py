"""Bytes moved to the chief when a ParameterServerStrategy job saves its tables.

Starts a local cluster (``--ps`` parameter-server tasks and one worker, each a
``tf.distribute.Server`` process on a free port; this process is the chief), fills a
de_store Variable spread over the PS tasks with ``--keys`` keys of ``--dim`` float32, and
saves it with ``tf.train.CheckpointManager`` from the chief: the PS tasks write their own
tables. It measures the save's time and the bytes received on the loopback interface
while it runs (the cluster's only traffic then), next to the table's bytes (keys +
values). The reference is the same save with ``experimental_io_device`` set to the
chief, which reads every row into the chief and writes them there.

Usage::

    python benchmarks/ps_bench.py --keys 2000000 --dim 16 --ps 2

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from de_store.testing.servers import free_ports

SERVER = (
    "import json, os, tensorflow as tf\n"
    "c = tf.distribute.cluster_resolver.TFConfigClusterResolver()\n"
    "tf.distribute.Server(c.cluster_spec(), job_name=c.task_type, task_index=c.task_id,"
    " protocol='grpc', start=True).join()\n"
)


def _loopback_received() -> int:
    with open("/proc/net/dev") as file:
        for line in file:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ps", type=int, default=2)
    args = parser.parse_args()
    ports = iter(free_ports(args.ps + 2))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}"],
        "ps": [f"127.0.0.1:{next(ports)}" for _ in range(args.ps)],
    }

    def env(job: str, task: int) -> dict[str, str]:
        config = {"cluster": cluster, "task": {"type": job, "index": task}}
        return dict(os.environ, TF_CONFIG=json.dumps(config), TF_CPP_MIN_LOG_LEVEL="3")

    tasks = [("worker", 0)] + [("ps", i) for i in range(args.ps)]
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
        print(json.dumps(_measure(args)))
    finally:
        for server in servers:
            server.kill()


def _measure(args: argparse.Namespace) -> dict[str, object]:
    import numpy as np
    import tensorflow as tf

    import de_store as ds

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        emb = ds.get_variable(
            "emb", dim=args.dim, devices=[f"/job:ps/task:{i}" for i in range(args.ps)],
            init_size=args.keys, kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )  # fmt: skip
    rng = np.random.default_rng(0)
    for start in range(0, args.keys, 1 << 20):
        keys = np.arange(start, min(start + (1 << 20), args.keys), dtype=np.int64)
        emb.upsert(keys, rng.standard_normal((len(keys), args.dim), dtype=np.float32))
    directory = tempfile.mkdtemp()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=emb), directory, max_to_keep=3)
    seconds, moved = _save(manager, None)
    # the reference: the same save with every row read into the chief and written there
    chief = tf.train.CheckpointOptions(
        experimental_io_device="/job:chief/replica:0/task:0/device:CPU:0"
    )
    chief_seconds, chief_moved = _save(manager, chief)
    table_bytes = args.keys * (8 + 4 * args.dim)
    result = {
        "keys": args.keys, "dim": args.dim, "ps_tasks": args.ps,
        "save_s": round(seconds, 3), "table_bytes": table_bytes,
        "loopback_bytes_during_save": moved,
        "moved_per_table_byte": round(moved / table_bytes, 4),
        "through_chief_save_s": round(chief_seconds, 3),
        "through_chief_moved_per_table_byte": round(chief_moved / table_bytes, 4),
    }  # fmt: skip
    print(
        f"saved {args.keys:,} x {args.dim} from {args.ps} PS tasks in {seconds:.2f} s, "
        f"written by the PS tasks; {moved / 1e6:.2f} MB moved to the chief for "
        f"{table_bytes / 1e6:.1f} MB of table"
    )
    print(
        f"reference, every row read into the chief (experimental_io_device): "
        f"{chief_seconds:.2f} s, {chief_moved / 1e6:.1f} MB moved to the chief"
    )
    return result


def _save(manager: object, options: object) -> tuple[float, int]:
    """Seconds and loopback bytes of one ``manager.save``."""
    before, start = _loopback_received(), time.perf_counter()
    manager.save(options=options)  # type: ignore[attr-defined]
    return time.perf_counter() - start, _loopback_received() - before


if __name__ == "__main__":
    main()
