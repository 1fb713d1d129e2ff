"""The chief of a PS cluster that loses a PS task in the middle of a save
(tests/distribute/test_ps_killed.py).

``ps_killed_chief.py CKPT_DIR OUT``: a Variable spread over every PS task, with Adagrad
slots, filled from this process and saved by ``CheckpointManager`` (``ckpt-1``); then more
keys and a second save, during which the test kills a PS task. Writes to OUT (JSON) what
the first save saved (values and slots) and how the second one ended, then leaves at once:
the cluster has lost a task, so TensorFlow's shutdown would wait for it.
"""

from __future__ import annotations

import json
import os
import sys

import tensorflow as tf
from ps_chief import content

import de_store as ds
from de_store.optimizers import Adagrad

DIM = 16
#: Keys of the first save (committed) and of the second one (the one that loses a task).
FIRST_KEYS, SECOND_KEYS = 1_000, 10_000


def build(strategy: tf.distribute.Strategy) -> tuple[ds.Variable, Adagrad]:
    devices = [f"/job:ps/task:{i}" for i in range(strategy.extended._num_ps)]
    with strategy.scope():
        emb = ds.get_variable(
            "emb",
            dim=DIM,
            devices=devices,
            initializer=0.0,
            init_size=SECOND_KEYS,
            kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )
        return emb, Adagrad(learning_rate=0.1)


def fill(emb: ds.Variable, optimizer: Adagrad, count: int) -> None:
    """Keys ``0 .. count - 1``: their rows, then one Adagrad update of each."""
    ids = tf.range(count, dtype=tf.int64)
    rows = tf.sin(tf.cast(ids[:, None] * DIM + tf.range(DIM, dtype=tf.int64), tf.float32))
    emb.upsert(ids, rows)
    optimizer.apply_row_gradients([(rows * 0.5, ids, emb)])


def main() -> None:
    directory, out = sys.argv[1:3]
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    emb, optimizer = build(tf.distribute.ParameterServerStrategy(resolver))
    fill(emb, optimizer, FIRST_KEYS)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=emb), directory, max_to_keep=3)
    report: dict[str, object] = {"saved": manager.save(), "dim": DIM, "values": content(emb)}
    report["slots"] = {name: content(c) for name, c in emb.companions().items()}
    fill(emb, optimizer, SECOND_KEYS)
    try:
        report["second"] = manager.save()
    except Exception as err:  # what the user of a PS job sees when a task dies mid-save
        report["error"] = {"type": type(err).__name__, "message": str(err)}
    with open(out, "w") as file:
        json.dump(report, file)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
