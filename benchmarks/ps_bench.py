"""Bytes moved to the chief when a ParameterServerStrategy job saves and restores its tables.

Starts a local cluster (``--ps`` parameter-server tasks and one worker, each a
``tf.distribute.Server`` process on a free port; this process is the chief), fills a
de_store Variable spread over the PS tasks with ``--keys`` keys of ``--dim`` float32, and
saves it with ``tf.train.CheckpointManager`` from the chief: the PS tasks write their own
tables. It measures the save's time and the bytes received on the loopback interface
while it runs (the cluster's only traffic then), next to the table's bytes (keys +
values). The reference is the same save with ``experimental_io_device`` set to the
chief, which reads every row into the chief and writes them there.

Then it restores the first checkpoint into a new Variable on the same PS tasks, twice:
the PS tasks read their own shard files. It measures each restore's time, the loopback
bytes (all the cluster's traffic: PS task to PS task included) and the chief's own TCP
bytes, sent and received (``tcp_info`` of its sockets), against the same restore with
``experimental_io_device`` set to the chief (every row read by the chief and sent to the
PS tasks). The first restore of the process is the one a job makes when it starts:
TensorFlow sends each PS task the functions of the table kernels it runs there for the
first time (the bulk load's), and the PS tasks compile them.

Usage::

    python benchmarks/ps_bench.py --keys 2000000 --dim 16 --ps 2

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import tempfile
import time

from _cluster import chief_of


def _loopback_received() -> int:
    with open("/proc/net/dev") as file:
        for line in file:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _own_tcp_bytes() -> int:
    """Bytes this process's TCP sockets have sent (and had acknowledged) and received:
    ``tcpi_bytes_acked`` plus ``tcpi_bytes_received`` of Linux's ``tcp_info``."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= 136:
                    total += sum(struct.unpack_from("<QQ", info, 120))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ps", type=int, default=2)
    args = parser.parse_args()
    with chief_of(1, args.ps):
        print(json.dumps(_measure(args)))


def _measure(args: argparse.Namespace) -> dict[str, object]:
    import numpy as np
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    emb = _variable(strategy, args)
    rng = np.random.default_rng(0)
    for start in range(0, args.keys, 1 << 20):
        keys = np.arange(start, min(start + (1 << 20), args.keys), dtype=np.int64)
        emb.upsert(keys, rng.standard_normal((len(keys), args.dim), dtype=np.float32))
    directory = tempfile.mkdtemp()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=emb), directory, max_to_keep=3)
    seconds, moved = _save(manager, None)
    saved = manager.latest_checkpoint
    # the reference: the same save with every row read into the chief and written there
    chief = tf.train.CheckpointOptions(
        experimental_io_device="/job:chief/replica:0/task:0/device:CPU:0"
    )
    chief_seconds, chief_moved = _save(manager, chief)
    table_bytes = args.keys * (8 + 4 * args.dim)
    first = _restore(_variable(strategy, args), saved, None)
    restore = _restore(_variable(strategy, args), saved, None)
    reference = _restore(_variable(strategy, args), saved, chief)
    result = {
        "keys": args.keys, "dim": args.dim, "ps_tasks": args.ps,
        "save_s": round(seconds, 3), "table_bytes": table_bytes,
        "loopback_bytes_during_save": moved,
        "moved_per_table_byte": round(moved / table_bytes, 4),
        "through_chief_save_s": round(chief_seconds, 3),
        "through_chief_moved_per_table_byte": round(chief_moved / table_bytes, 4),
        "first_restore_s": first["s"],
        "first_restore_loopback_bytes": first["loopback"],
        "first_restore_chief_bytes": first["chief"],
        "first_restore_chief_bytes_per_table_byte": round(first["chief"] / table_bytes, 4),
        "restore_s": restore["s"], "restore_loopback_bytes": restore["loopback"],
        "restore_chief_bytes": restore["chief"],
        "restore_chief_bytes_per_table_byte": round(restore["chief"] / table_bytes, 4),
        "through_chief_restore_s": reference["s"],
        "through_chief_restore_loopback_bytes": reference["loopback"],
        "through_chief_restore_chief_bytes": reference["chief"],
        "through_chief_restore_chief_bytes_per_table_byte":
            round(reference["chief"] / table_bytes, 4),
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
    for what, found in [
        ("read by the PS tasks, the process's first restore", first),
        ("read by the PS tasks, again", restore),
        ("reference, through the chief (experimental_io_device)", reference),
    ]:
        print(
            f"restored {found['rows']:,} rows, {what}: {found['s']:.2f} s, "
            f"{found['loopback'] / 1e6:.2f} MB on the loopback, {found['chief'] / 1e6:.2f} MB "
            "sent and received by the chief"
        )
    return result


def _variable(strategy: object, args: argparse.Namespace) -> object:
    """A Variable named ``emb`` with a table shard on each PS task."""
    import de_store as ds

    with strategy.scope():  # type: ignore[attr-defined]
        return ds.Variable(
            "emb", dim=args.dim, devices=[f"/job:ps/task:{i}" for i in range(args.ps)],
            init_size=args.keys, kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )  # fmt: skip


def _save(manager: object, options: object) -> tuple[float, int]:
    """Seconds and loopback bytes of one ``manager.save``."""
    before, start = _loopback_received(), time.perf_counter()
    manager.save(options=options)  # type: ignore[attr-defined]
    return time.perf_counter() - start, _loopback_received() - before


def _restore(emb: object, prefix: str, options: object) -> dict[str, int | float]:
    """Seconds, loopback bytes and the chief's TCP bytes of restoring ``prefix`` into
    ``emb``, and the rows it then holds."""
    import tensorflow as tf

    loopback, chief, start = _loopback_received(), _own_tcp_bytes(), time.perf_counter()
    tf.train.Checkpoint(emb=emb).restore(prefix, options=options).expect_partial()
    seconds = time.perf_counter() - start
    loopback, chief = _loopback_received() - loopback, _own_tcp_bytes() - chief
    rows = int(emb.size())  # type: ignore[attr-defined]
    return {"s": round(seconds, 3), "loopback": loopback, "chief": chief, "rows": rows}


if __name__ == "__main__":
    main()
