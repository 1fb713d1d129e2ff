"""The chief of a ParameterServerStrategy cluster running TFRA's training idiom
(tests/distribute/test_ps_tfra.py).

``ps_tfra_chief.py loop OUT STEPS NAMES``: one Variable per optimizer of ``NAMES`` (comma
separated names of :func:`optimizers`, of the Keras ``tf.keras`` is by
``TF_USE_LEGACY_KERAS``), spread over every PS task, trained
by steps that ``ClusterCoordinator.schedule`` runs on the workers, each step written as a
TFRA user writes it: ``de.embedding_lookup(emb, ids, return_trainable=True)``,
``tape.gradient`` on the wrapper and ``DynamicEmbeddingOptimizer(...).apply_gradients``. The
same steps then run in this process on Variables of its own (no PS), one after another.
OUT gets, per optimizer, both tables and the losses; and for each optimizer that cannot
train tables on parameter servers, the error its step raised.

``ps_tfra_chief.py fit OUT CKPT_DIR STEPS`` (or ``loop+fit`` with both modes' arguments,
in one process): tf_keras ``model.fit`` in the shape of TFRA's
movielens-1m-keras-ps demo (``SquashedEmbedding(devices=ps_devices)`` layers, a ``call``
decorated with ``tf.function``, ``DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam)``,
``ModelCheckpoint``), its layers' ``init_size`` a tenth of the keys its steps bring, and the first
room the growth hook gives (``FIRST_STEP_ROOM``) two batches, so that the tables grow on
the PS tasks while fit runs; then the tables and the growths the hook logged.
``ps_tfra_chief.py restore OUT CKPT_DIR``: the
latest checkpoint of CKPT_DIR restored into the same model on this cluster's PS tasks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import numpy as np
import tensorflow as tf

import de_store as de
from de_store._keras import is_keras_2
from de_store.tables import _ps_growth

DIM, BATCH, ID_SPACE = 4, 16, 200
#: init_size of the loop's Variables: a tenth of the keys its steps bring (they grow)
LOOP_INIT_SIZE = 6
USERS, MOVIES, FIT_BATCH = 300, 200, 32
#: init_size of each layer: a tenth of what fit's steps bring (TFRA's init_size is a hint)
FIT_INIT_SIZE = 20
K = tf.keras.optimizers
LEGACY = K.legacy if is_keras_2() else None  # tf.keras.optimizers.legacy of tf_keras


def optimizers() -> dict[str, Any]:
    """The optimizers every step trains a Variable with, by name."""
    made = {
        "adam": lambda: K.Adam(0.05),
        "sgd_momentum": lambda: K.SGD(0.1, momentum=0.9),
        "adagrad": lambda: K.Adagrad(0.1),
        "rmsprop": lambda: K.RMSprop(0.05),
        "ftrl": lambda: K.Ftrl(0.1),
        "adamw": lambda: K.AdamW(0.05, weight_decay=0.01),
        "nadam": lambda: K.Nadam(0.05),
    }
    if LEGACY is not None:
        made.update(
            legacy_adam=lambda: LEGACY.Adam(0.05),
            legacy_sgd=lambda: LEGACY.SGD(0.1, momentum=0.9, nesterov=True),
            legacy_adagrad=lambda: LEGACY.Adagrad(0.1),
        )
    return made


REFUSED = {"v1_adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05)}
if LEGACY is not None:
    REFUSED["legacy_rmsprop"] = lambda: LEGACY.RMSprop(0.05)


def batch(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    seed = tf.stack([tf.cast(step, tf.int64), tf.constant(3, tf.int64)])
    ids = tf.random.stateless_uniform([BATCH, 2], seed=seed, maxval=ID_SPACE, dtype=tf.int64)
    return ids, tf.reduce_sum(tf.sin(tf.cast(ids, tf.float32)), axis=1)


def make_step(pairs: list[tuple[de.Variable, Any]]) -> Any:
    """A step training each Variable with its optimizer, as TFRA's idiom does."""

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number: tf.Tensor) -> tf.Tensor:
        ids, target = batch(number)
        losses = []
        for emb, optimizer in pairs:
            with tf.GradientTape() as tape:
                rows, wrapper = de.embedding_lookup(emb, ids, return_trainable=True)
                loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, [1, 2]) - target))
            grads = tape.gradient(loss, [wrapper])
            optimizer.apply_gradients(zip(grads, [wrapper], strict=True))
            losses.append(loss)
        return tf.stack(losses)

    return step


def table(variable: de.Variable) -> dict[str, list[float]]:
    keys, values = variable.export()
    return {str(k): v for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)}


def variables(names: list[str], devices: list[str] | None, prefix: str) -> list[de.Variable]:
    return [
        de.get_variable(
            f"{prefix}{name}", dim=DIM, devices=devices, initializer=0.1, init_size=LOOP_INIT_SIZE
        )
        for name in names
    ]


def cluster_strategy() -> Any:
    """The process's one ParameterServerStrategy (with its coordinator)."""
    global _STRATEGY
    if _STRATEGY is None:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        _STRATEGY = tf.distribute.ParameterServerStrategy(resolver)
        tf.distribute.coordinator.ClusterCoordinator(_STRATEGY)
    return _STRATEGY


_STRATEGY: Any = None


def loop(out: str, steps: int, names: list[str]) -> None:
    strategy = cluster_strategy()
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    devices = [f"/job:ps/task:{i}" for i in range(strategy.extended._num_ps)]
    with strategy.scope():
        embs = variables(names, devices, "ps_")
        wrapped = [de.DynamicEmbeddingOptimizer(optimizers()[n]()) for n in names]
    step = make_step(list(zip(embs, wrapped, strict=True)))
    results = [coordinator.schedule(step, args=(tf.constant(i, tf.int64),)) for i in range(steps)]
    coordinator.join()
    ps_losses = np.array([r.fetch() for r in results])
    local = variables(names, None, "local_")
    fresh = [de.DynamicEmbeddingOptimizer(optimizers()[n]()) for n in names]
    local_step = make_step(list(zip(local, fresh, strict=True)))
    local_losses = np.array([local_step(tf.constant(i, tf.int64)).numpy() for i in range(steps)])
    report: dict[str, Any] = {"refused": refusals(strategy, coordinator, devices)}
    for index, name in enumerate(names):
        report[name] = {
            "ps": table(embs[index]),
            "local": table(local[index]),
            "ps_losses": ps_losses[:, index].tolist(),
            "local_losses": local_losses[:, index].tolist(),
            "slots": sorted(embs[index].companions()),
        }
    with open(out, "w") as file:
        json.dump(report, file)


def refusals(strategy: Any, coordinator: Any, devices: list[str]) -> dict[str, str]:
    """The error each optimizer that trains no tables on parameter servers raises."""
    errors = {}
    for name, make in REFUSED.items():
        with strategy.scope():
            emb = de.get_variable(f"refused_{name}", dim=DIM, devices=devices, init_size=400)
            optimizer = de.DynamicEmbeddingOptimizer(make())
        try:
            coordinator.schedule(make_step([(emb, optimizer)]), args=(tf.constant(0, tf.int64),))
            coordinator.join()
            errors[name] = ""
        except Exception as err:  # tf.function tracing reports it as a StagingError
            errors[name] = f"{type(err).__name__}: {err}"
    return errors


class DualChannels(tf.keras.Model):
    """TFRA's movielens-1m-keras-ps model, small: two SquashedEmbedding layers on the PS
    tasks, a ``call`` decorated with ``tf.function``, a softmax over 5 ratings."""

    def __init__(self, devices: list[str] | None) -> None:
        super().__init__()
        saver = de.HashTableCreator(saver=de.FileSystemSaver())  # PS tasks write their shards
        init = tf.keras.initializers.RandomNormal(0.0, 0.5, seed=1)
        self.user_embedding = de.keras.layers.SquashedEmbedding(
            DIM,
            initializer=init,
            devices=devices,
            name="user_embedding",
            kv_creator=saver,
            init_size=FIT_INIT_SIZE,
        )
        self.movie_embedding = de.keras.layers.SquashedEmbedding(
            DIM,
            initializer=init,
            devices=devices,
            name="movie_embedding",
            kv_creator=saver,
            init_size=FIT_INIT_SIZE,
        )
        self.dense = tf.keras.layers.Dense(5, activation="softmax")

    @tf.function
    def call(self, features: dict[str, tf.Tensor]) -> tf.Tensor:
        user = self.user_embedding(tf.reshape(features["user_id"], (-1, 1)))
        movie = self.movie_embedding(tf.reshape(features["movie_id"], (-1, 1)))
        return self.dense(tf.concat([user, movie], axis=1))


def ratings(context: Any = None) -> tf.data.Dataset:
    rng = np.random.default_rng(5)
    users, movies = rng.integers(0, USERS, 4096), rng.integers(0, MOVIES, 4096)
    labels = tf.one_hot((users * 7 + movies * 13) % 5, 5)
    features = {"user_id": users, "movie_id": movies}
    return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(FIT_BATCH)


def tables(model: DualChannels) -> dict[str, Any]:
    found = {}
    for layer in (model.user_embedding, model.movie_embedding):
        found[layer.name] = table(layer.params)
        for column, companion in layer.params.companions().items():
            found[f"{layer.name}/{column}"] = table(companion)
    return found


def ps_model() -> tuple[Any, DualChannels]:
    strategy = cluster_strategy()
    devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(strategy._num_ps)]
    with strategy.scope():
        model = DualChannels(devices)
        optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(1e-2))
    model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError())
    return strategy, model


class Growths(logging.Handler):
    """The tables the growth hook grew, by name, from its INFO lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.grown: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("grew table "):
            self.grown.append(str(record.args[0]))  # type: ignore[index]


class ReportAtEnd(tf.keras.callbacks.Callback):
    """Writes ``fit``'s report when training ends, then ends the process.

    After its last step, TensorFlow 2.21's ``fit`` releases the chief's per-worker
    dataset iterator, and the removal of that iterator's finalize function
    (``Context.remove_function`` of ``_remote_finalize_func``) waited out a 30 s timeout
    in most runs on these local clusters, with or without prefetching to the workers'
    devices. Nothing the tests read comes after it: the checkpoints were committed at the
    epochs' ends."""

    def __init__(self, out: str, growths: Growths) -> None:
        super().__init__()
        self.out, self.growths = out, growths

    def on_train_end(self, logs: Any = None) -> None:
        report = {
            "loss": self.model.history.history["loss"],  # fit's History, set at epoch end
            "tables": tables(self.model),
            "grown": self.growths.grown,
        }
        with open(self.out, "w") as file:
            json.dump(report, file)
        logging.shutdown()
        os._exit(0)


def fit(out: str, directory: str, steps: int) -> None:
    """TFRA's demo fit; the last thing this process does (see :class:`ReportAtEnd`)."""
    _ps_growth.FIRST_STEP_ROOM = 2 * FIT_BATCH
    growths = Growths()
    logging.getLogger("de_store").addHandler(growths)
    logging.getLogger("de_store").setLevel(logging.INFO)
    _, model = ps_model()
    save = tf.keras.callbacks.ModelCheckpoint(directory + "/ckpt-{epoch}", save_weights_only=True)
    data = tf.keras.utils.experimental.DatasetCreator(ratings)
    callbacks = [save, ReportAtEnd(out, growths)]
    model.fit(data, epochs=2, steps_per_epoch=steps, callbacks=callbacks, verbose=0)


def restore(out: str, directory: str) -> None:
    """The latest checkpoint of ``directory`` into the model on this cluster's PS tasks,
    or in this process when it is no task of a cluster."""
    if "TF_CONFIG" in os.environ:
        _, model = ps_model()
    else:
        model = DualChannels(None)
        optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(1e-2))
        model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError())
    model.load_weights(tf.train.latest_checkpoint(directory)).expect_partial()
    per_task = [int(shard.size()) for shard in model.user_embedding.params.shards]
    with open(out, "w") as file:
        json.dump({"tables": tables(model), "per_task": per_task}, file)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "loop":
        loop(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
    elif mode == "loop+fit":  # one process, one strategy: the loop, then fit
        loop(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
        fit(sys.argv[5], sys.argv[6], int(sys.argv[7]))
    elif mode == "fit":
        fit(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        restore(sys.argv[2], sys.argv[3])
