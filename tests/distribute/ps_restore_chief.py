"""The chief of a PS cluster whose restores the PS tasks read (tests/distribute/test_ps_restore.py).

``ps_restore_chief.py DIR OUT``, in a cluster of 3 PS tasks: a Variable on PS tasks 0 and 1
with an Adagrad slot, filled from this process and saved by ``tf.train.Checkpoint`` (each
task writes its binary shard files), then restored into fresh Variables on 2 and on 3 PS
tasks. For each restore: whether the values and slots are exactly the saved ones, the
keys each task holds, and the TCP bytes this process sent and received meanwhile (what
its sockets count). Then a save through this process (``experimental_io_device``: parquet
shards) and its restore, which goes through this process too (the reference), and a
restore from the binary checkpoint with a byte of a shard file changed, into a Variable
holding rows (the error, and whether the Variable kept its rows). Writes everything to
OUT (JSON), with the ``de_store`` INFO lines of each restore.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import de_store as ds

#: 2 key buckets in each of the 2 shard files: a restore into 2 tasks reads each part
#: where its rows belong, one into 3 reads each file on one task and sends rows on.
DIM, KEYS = 256, 70_000
CHIEF_CPU = "/job:chief/replica:0/task:0/device:CPU:0"
SLOT = "adagrad_accumulator"


def tcp_bytes() -> np.ndarray:
    """Bytes this process's TCP sockets have sent (and had acknowledged) and received:
    ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` of Linux's ``tcp_info``."""
    total = np.zeros(2, np.int64)
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
                    total += struct.unpack_from("<QQ", info, 120)
    return total


class Lines(logging.Handler):
    """The ``de_store`` INFO lines logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def variable(strategy: tf.distribute.Strategy, tasks: int) -> ds.Variable:
    with strategy.scope():
        return ds.Variable(
            "emb", dim=DIM, devices=[f"/job:ps/task:{i}" for i in range(tasks)],
            initializer=0.0, init_size=KEYS,
            kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )  # fmt: skip


def content(emb: ds.Variable) -> dict[str, np.ndarray]:
    """Keys (sorted), values and slot rows in key order, read into this process."""
    keys, values = (np.asarray(x) for x in emb.export())
    order = np.argsort(keys)
    found = {"keys": keys[order], "values": values[order]}
    slot = emb.companions().get(SLOT)
    if slot is not None:
        slot_keys, slot_values = (np.asarray(x) for x in slot.export())
        found["slot_keys"] = np.sort(slot_keys)
        found["slot"] = slot_values[np.argsort(slot_keys)]
    return found


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def restore(emb: ds.Variable, prefix: str, io_device: str | None = None) -> dict[str, Any]:
    """Restore ``prefix`` into ``emb``: the bytes this process moved, its INFO lines and
    the error raised, if any."""
    lines = Lines()
    logging.getLogger("de_store").addHandler(lines)
    options = tf.train.CheckpointOptions(experimental_io_device=io_device)
    before = tcp_bytes()
    try:
        tf.train.Checkpoint(emb=emb).restore(prefix, options=options).expect_partial()
        error = None
    except Exception as err:
        error = {"type": type(err).__name__, "message": str(err)}
    sent, received = (int(n) for n in tcp_bytes() - before)
    logging.getLogger("de_store").removeHandler(lines)
    return {"chief_sent": sent, "chief_received": received, "lines": lines.lines, "error": error}


def per_task(emb: ds.Variable) -> dict[str, Any]:
    """Each task's key count, and whether every key is on the task its hash names."""
    sizes, placed = [], True
    for index, shard in enumerate(emb.shards):
        with tf.device(emb.devices[index]):
            keys = shard.export_all()[0]
            placed &= bool(tf.reduce_all(tf.math.floormod(keys, len(emb.shards)) == index))
        sizes.append(int(tf.size(keys)))
    return {"per_task": sizes, "placed": placed}


def main() -> None:
    directory, out = Path(sys.argv[1]), sys.argv[2]
    logging.getLogger("de_store").setLevel(logging.INFO)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    source = filled(variable(strategy, 2), KEYS)
    saved = content(source)
    binary = tf.train.Checkpoint(emb=source).save(str(directory / "binary" / "ckpt"))
    report: dict[str, Any] = {"keys": KEYS, "table_bytes": shard_bytes(directory / "binary")}
    # TensorFlow sends each task the table kernels' functions on their first use there
    # (about 1 MB): a small restore first, so that the figures below are the restores'
    small = tf.train.Checkpoint(emb=filled(variable(strategy, 2), 100))
    small_prefix = small.save(str(directory / "small" / "ckpt"))
    for tasks in (2, 3):
        restore(variable(strategy, tasks), small_prefix)
    for name, tasks in [("two", 2), ("three", 3)]:
        target = variable(strategy, tasks)
        report[name] = restore(target, binary)
        report[name].update(per_task(target), exact=same(content(target), saved))
    chief = tf.train.CheckpointOptions(experimental_io_device=CHIEF_CPU)
    parquet = tf.train.Checkpoint(emb=source).save(
        str(directory / "parquet" / "ckpt"), options=chief
    )
    target = variable(strategy, 2)
    report["parquet"] = restore(target, parquet)
    report["parquet"].update(exact=same(content(target), saved))
    report["damaged"] = damaged(strategy, directory, binary)
    with open(out, "w") as file:
        json.dump(report, file)


def filled(emb: ds.Variable, count: int) -> ds.Variable:
    """``emb`` holding ``count`` keys, with rows of their Adagrad slot."""
    ids = tf.constant(np.random.default_rng(5).permutation(count * 7)[:count], tf.int64)
    rows = tf.sin(tf.cast(ids[:, None] * DIM + tf.range(DIM, dtype=tf.int64), tf.float32))
    emb.upsert(ids, rows)
    emb.companion(SLOT, DIM, tf.float32).upsert(ids, tf.square(rows) + 0.1)
    return emb


def shard_bytes(folder: Path) -> int:
    """Bytes of the shard files under ``folder`` (the table's keys, values and slots)."""
    return sum(p.stat().st_size for p in folder.rglob("emb/*") if p.is_file())


def damaged(strategy: tf.distribute.Strategy, directory: Path, prefix: str) -> dict[str, Any]:
    """A byte of a values file of the binary checkpoint changed, restored into a Variable
    holding other rows: the error, and whether the Variable kept them."""
    target = variable(strategy, 3)
    target.upsert(tf.range(100, dtype=tf.int64), tf.ones([100, DIM]))
    before = content(target)
    values = sorted((directory / "binary" / "de_store").rglob("*-values"))[0]
    data = bytearray(values.read_bytes())
    data[len(data) // 2] ^= 1
    values.write_bytes(bytes(data))
    found = restore(target, prefix)
    found.update(unchanged=same(content(target), before), file=str(values))
    return found


if __name__ == "__main__":
    main()
