"""The chief of a PS cluster whose tables outgrow init_size (tests/distribute/test_ps_growth.py).

``ps_growth_chief.py CKPT_DIR OUT``, under Keras 2 (tf_keras: ``model.fit`` under
``ParameterServerStrategy`` is Keras 2's): two Variables on the PS tasks, each created
with an ``init_size`` a tenth of the keys it ends up holding, trained with Adagrad
(``apply_row_gradients``) and no call from this program between steps:

- ``emb`` by a plain loop of ``coordinator.schedule(step, ...)`` then ``join()``: every
  step draws its ids in the graph (a static batch: the tables' room is bounded from it);
- ``fit_emb`` by ``model.fit`` of a model whose ``train_step`` does the same, on a
  dataset batched without ``drop_remainder`` (no static batch size: the room is bounded
  by what the steps before passed).

Every step brings ``NEW`` keys no step before brought, and ``OLD`` keys of steps at least
``LAG`` steps before. Both Variables are saved by ``CheckpointManager``; OUT (JSON) gets
their content (values and Adagrad slots), the losses of every scheduled step, the table
capacities before and after, and the ``de_store`` log lines.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # Keras 2, read when TensorFlow is imported (the test imports
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # this module for its batches, under Keras 3)

import json
import logging
import sys

import tensorflow as tf

import de_store as ds
from de_store.optimizers import Adagrad

DIM, NEW, OLD, LAG = 2, 64, 32, 8
INIT_SIZE = 192  # two batches of ids
STEPS = FIT_STEPS = 30  # 1,920 keys each: 10 x INIT_SIZE
LEARNING_RATE = 0.05
ACCUMULATOR = 1.0  # Adagrad's first value: every accumulator stays an integer


def batch_ids(step: tf.Tensor) -> tf.Tensor:
    """The ids of step ``step``: ``NEW`` new ones, then ``OLD`` of steps ``LAG`` or more
    before (the new ones again in the first steps)."""
    step = tf.cast(step, tf.int64)
    new = step * NEW + tf.range(NEW, dtype=tf.int64)
    seen = (step - LAG + 1) * NEW  # ids of the steps up to step - LAG
    seed = tf.stack([step, tf.constant(11, tf.int64)])
    drawn = tf.random.stateless_uniform(
        [OLD], seed=seed, minval=0, maxval=tf.maximum(seen, 1), dtype=tf.int64
    )
    return tf.concat([new, tf.where(seen > 0, drawn, new[:OLD])], 0)


def train_on(emb: ds.Variable, optimizer: Adagrad, ids: tf.Tensor) -> tf.Tensor:
    """One update: the loss is the sum of the rows, so each id's gradient is its count."""
    with tf.GradientTape() as tape:
        rows = emb.lookup(ids)
        tape.watch(rows)
        loss = tf.reduce_sum(rows)
    optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, emb)])
    return loss


def variable(strategy: tf.distribute.Strategy, name: str) -> ds.Variable:
    devices = [f"/job:ps/task:{i}" for i in range(strategy.extended._num_ps)]
    with strategy.scope():
        return ds.get_variable(
            name,
            dim=DIM,
            devices=devices,
            initializer=0.0,
            init_size=INIT_SIZE,
            bp_v2=True,
            kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )


def schedule_loop(coordinator: object, strategy: tf.distribute.Strategy) -> tuple:
    emb = variable(strategy, "emb")
    with strategy.scope():
        optimizer = Adagrad(learning_rate=LEARNING_RATE, initial_accumulator_value=ACCUMULATOR)

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number: tf.Tensor) -> tf.Tensor:
        return train_on(emb, optimizer, batch_ids(number))

    before = capacities(emb)
    losses = [coordinator.schedule(step, args=(tf.constant(i, tf.int64),)) for i in range(STEPS)]
    coordinator.join()
    return emb, [float(loss.fetch()) for loss in losses], before


def fit(strategy: tf.distribute.Strategy) -> tuple:
    emb = variable(strategy, "fit_emb")

    class Model(tf.keras.Model):
        def train_step(self, ids: tf.Tensor) -> dict:
            return {"loss": train_on(emb, self.optimizer, ids)}

    def dataset(context: tf.distribute.InputContext) -> tf.data.Dataset:
        steps = tf.data.Dataset.range(FIT_STEPS).shard(
            context.num_input_pipelines, context.input_pipeline_id
        )
        return steps.map(batch_ids).unbatch().batch(NEW + OLD).repeat()

    with strategy.scope():
        model = Model()
        model.compile(Adagrad(learning_rate=LEARNING_RATE, initial_accumulator_value=ACCUMULATOR))
    before = capacities(emb)
    history = model.fit(
        tf.keras.utils.experimental.DatasetCreator(dataset),
        epochs=1,
        steps_per_epoch=FIT_STEPS,
        verbose=0,
    )
    return emb, history.history, before


def capacities(emb: ds.Variable) -> list[int]:
    return [shard.capacity() for shard in emb.shards]


def content(emb: ds.Variable) -> dict[str, list[float]]:
    keys, values = emb.export()
    return {str(k): v for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)}


class Lines(logging.Handler):
    """The ``de_store`` log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    directory, out = sys.argv[1:3]
    # Grappler off: the worker instantiates each step function (again after every growth,
    # whose variables have new shapes) in about half the time on a small test machine
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    lines = Lines()
    logger = logging.getLogger("de_store")
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    emb, losses, before = schedule_loop(coordinator, strategy)
    fit_emb, history, fit_before = fit(strategy)
    report = {"losses": losses, "fit_history": history}
    for name, variable, capacity in (("emb", emb, before), ("fit_emb", fit_emb, fit_before)):
        report[name] = {
            "values": content(variable),
            "slots": content(variable.companions()["adagrad_accumulator"]),
            "capacity_before": capacity,
            "capacity_after": capacities(variable),
        }
    checkpoint = tf.train.Checkpoint(emb=emb, fit_emb=fit_emb)
    report["saved"] = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=1).save()
    report["log"] = lines.lines
    with open(out, "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
