"""de_store.keras.Embedding in a Keras 3 model: model.fit, a custom GradientTape loop, async
checkpoints and a SavedModel for serving."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import de_store as ds
import de_store.keras


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(-500, 500, size=(1024, 3)).astype(np.int64)
    return ids, (ids[:, 0] % 2 == 0).astype(np.float32)


def _model(name: str) -> keras.Model:
    inputs = keras.Input(shape=(3,), dtype="int64")
    embedded = de_store.keras.Embedding(
        4, initializer=tf.random_normal_initializer(stddev=0.1, seed=2), name=name
    )(inputs)
    outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(embedded))
    return keras.Model(inputs, outputs)


def test_model_fit_trains_the_dynamic_embedding() -> None:
    model = _model("fit_embedding")
    model.compile(optimizer=ds.optimizers.Adam(0.05), loss="binary_crossentropy")
    history = model.fit(*_data(), epochs=3, batch_size=128, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0]
    layer = model.get_layer("fit_embedding")
    assert int(layer.params.size()) == len(np.unique(_data()[0]))
    assert sorted(layer.params.companions()) == ["adam_m", "adam_v"]


def test_custom_gradient_tape_loop_trains_the_dynamic_embedding() -> None:
    model = _model("loop_embedding")
    optimizer = ds.optimizers.Adam(0.05)
    loss_fn = keras.losses.BinaryCrossentropy()
    ids, labels = _data()

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:, None], model(x, training=True))
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    losses = [
        float(step(ids[i : i + 128], labels[i : i + 128]))
        for _ in range(3)
        for i in range(0, 1024, 128)
    ]
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4])


def test_async_checkpoints_of_a_keras_model_save_every_time(tmp_path) -> None:
    """Each async save holds the weights of its moment, from the second save on too."""
    model = _model("async_embedding")
    optimizer = ds.optimizers.Adam(0.05)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=optimizer), str(tmp_path), max_to_keep=3
    )
    options = tf.train.CheckpointOptions(enable_async=True)
    dense, saved = model.layers[-1], []
    for _ in range(3):
        model.fit(*_data(), epochs=1, batch_size=128, verbose=0)
        saved.append((manager.save(options=options), dense.get_weights()[0].copy()))
    manager.checkpoint.sync()
    for path, kernel in saved:
        fresh = _model("async_embedding_restored")
        tf.train.Checkpoint(model=fresh).restore(path).expect_partial()
        np.testing.assert_array_equal(fresh.layers[-1].get_weights()[0], kernel)


class _Serving(tf.Module):
    def __init__(self, model: keras.Model) -> None:
        super().__init__()
        self.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int64)])
    def serve(self, ids: tf.Tensor) -> tf.Tensor:
        return self.model(ids)


def test_saved_model_of_a_model_calling_the_layer_serves_its_predictions(tmp_path) -> None:
    model = _model("served_embedding")
    model.compile(optimizer=ds.optimizers.Adam(0.05), loss="binary_crossentropy")
    ids, labels = _data()
    model.fit(ids, labels, epochs=1, batch_size=128, verbose=0)
    tf.saved_model.save(_Serving(model), str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    expected = model.predict(ids[:16], verbose=0)
    np.testing.assert_array_equal(served.serve(tf.constant(ids[:16])).numpy(), expected)
