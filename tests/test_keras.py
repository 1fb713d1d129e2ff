"""de_store.keras.Embedding in a Keras 3 model: model.fit and a custom GradientTape loop."""

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
