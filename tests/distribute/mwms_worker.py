"""One worker of a MultiWorkerMirroredStrategy cluster (tests/distribute/test_mwms.py).

``mwms_worker.py train URL OUT STEPS [DIE_IN_SAVE]``: this worker's slice of a table
(the keys ``k mod n == rank``) trains on its own batches, lookups and gradient rows going
through ``AllToAllEmbedding``; it saves to ``URL/step-<steps>`` and, with DIE_IN_SAVE,
trains on and saves ``URL/step-<2 * steps>``, killing itself (SIGKILL) once its shards are
written when it is rank 1. ``mwms_worker.py restore URL OUT``: this worker restores its
keys of ``URL``. Both write the slice's content (and the losses) to OUT as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

import de_store as ds
from de_store.checkpoint.barrier import CoordinationServiceBarrier
from de_store.checkpoint.topology import detect_topology
from de_store.distribute import AllToAllEmbedding
from de_store.optimizers import Adagrad

FIELDS, BATCH, ID_SPACE, DIM = 4, 64, 300, 4
LEARNING_RATE = 0.2


def batch(number: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Batch ``number`` (the same on every run): ids and targets."""
    seed = tf.stack([tf.cast(number, tf.int64), tf.constant(11, tf.int64)])
    ids = tf.random.stateless_uniform([BATCH, FIELDS], seed=seed, maxval=ID_SPACE, dtype=tf.int64)
    return ids, tf.reduce_sum(tf.sin(tf.cast(ids, tf.float32)), axis=1)


def loss_of(rows: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(tf.reduce_sum(rows, [1, 2]) - target))


def content(variable: ds.Variable) -> dict[str, list[float]]:
    keys, values = variable.export()
    return {str(k): v for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)}


class _DieOnceShardsWritten(logging.Handler):
    """SIGKILLs this process when the saver logs that this rank's shards are written."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("saved rank"):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, url, out = sys.argv[1:4]
    tf.distribute.MultiWorkerMirroredStrategy()  # joins the cluster and its collectives
    topology = detect_topology()
    size, rank = topology.proc_size, topology.proc_rank
    saver = ds.FileSystemSaver(barrier=CoordinationServiceBarrier(topology), barrier_timeout_s=20)
    variable = ds.Variable("emb", dim=DIM, initializer=0.0)
    result: dict[str, object] = {"rank": rank}
    if mode == "restore":
        ds.restore([variable], url, saver=saver)
    else:
        steps = int(sys.argv[4])
        embedding = AllToAllEmbedding(variable, size, rank)
        optimizer = Adagrad(learning_rate=LEARNING_RATE)

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
        def step(number: tf.Tensor) -> tf.Tensor:
            ids, target = batch(number * size + rank)
            with tf.GradientTape() as tape:
                rows = embedding.lookup(ids)
                tape.watch(rows)
                loss = loss_of(rows, target)
            embedding.apply_gradients(optimizer, ids, tape.gradient(loss, rows))
            return loss

        losses = [float(step(tf.constant(i, tf.int64))) for i in range(steps)]
        ds.save([variable], f"{url}/step-{steps}", saver=saver, blocking=True)
        result["losses"] = losses
        if len(sys.argv) > 5:  # the second save loses rank 1 midway
            result["saved"] = content(variable)
            with open(out, "w") as file:
                json.dump(result, file)
            for i in range(steps, 2 * steps):
                step(tf.constant(i, tf.int64))
            if rank == 1:
                logging.getLogger("de_store.saver").addHandler(_DieOnceShardsWritten())
                logging.getLogger("de_store.saver").setLevel(logging.INFO)
            ds.save([variable], f"{url}/step-{2 * steps}", saver=saver, blocking=True)
            return
    result["values"] = content(variable)
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
