"""de_store.keras.layers as TFRA's dynamic_embedding.keras.layers: its arguments, the
pooling layers, a .keras file that carries the tables, and model.export serving without
de_store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
import de_store.keras

SERVE = """
import json, sys
sys.modules["de_store"] = None  # importing de_store now fails
import numpy as np, tensorflow as tf
served = tf.saved_model.load(sys.argv[1])
ids = tf.constant(json.loads(sys.argv[2]), tf.int64)
print(json.dumps(served.serve(ids).numpy().tolist()))
"""


def ratings_model(name: str) -> keras.Model:
    """A small version of TFRA's movielens Keras demo: user and movie ids -> a rating."""
    inputs = keras.Input(shape=(2,), dtype="int64")
    rows = de_store.keras.layers.Embedding(
        4,
        initializer=tf.random_normal_initializer(stddev=0.1, seed=1),
        init_capacity=512,
        combiner="mean",
        name=name,
    )(inputs)
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(rows))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def ratings(n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    ids = np.stack([rng.integers(0, 100, n), rng.integers(1000, 1100, n)], 1).astype(np.int64)
    return ids, ((ids[:, 0] % 5) + (ids[:, 1] % 3)).astype(np.float32)


def trained(name: str) -> tuple[keras.Model, np.ndarray]:
    model = ratings_model(name)
    model.compile(optimizer=ds.DynamicEmbeddingOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    ids, labels = ratings()
    history = model.fit(ids, labels, epochs=3, batch_size=64, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    return model, ids


def test_a_keras_file_carries_the_table_and_its_slots(tmp_path: Path) -> None:
    model, ids = trained("keras_file_emb")
    layer = model.layers[1]
    expected = model.predict(ids[:16], verbose=0)
    keys, values = (t.numpy() for t in layer.params.export())
    slot_keys = layer.params.companions()["adam_m"].export()[0].numpy()
    model.save(tmp_path / "ratings.keras")
    layer.params.clear()  # the loaded layer gets this Variable back: empty it first
    for companion in layer.params.companions().values():
        companion.clear()
    loaded = keras.models.load_model(tmp_path / "ratings.keras")
    np.testing.assert_array_equal(loaded.predict(ids[:16], verbose=0), expected)
    got_keys, got_values = (t.numpy() for t in loaded.layers[1].params.export())
    order, got_order = np.argsort(keys), np.argsort(got_keys)
    np.testing.assert_array_equal(got_keys[got_order], keys[order])
    np.testing.assert_array_equal(got_values[got_order], values[order])
    restored_slots = loaded.layers[1].params.companions()["adam_m"].export()[0].numpy()
    assert sorted(restored_slots) == sorted(slot_keys)
    assert loaded.layers[1].get_config()["init_capacity"] == 512


def test_model_export_serves_in_tensorflow_without_de_store(tmp_path: Path) -> None:
    model, ids = trained("exported_emb")
    expected = model.predict(ids[:8], verbose=0)
    model.export(str(tmp_path / "exported"))
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path / "exported"), json.dumps(ids[:8].tolist())],
        capture_output=True,
        text=True,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    np.testing.assert_allclose(json.loads(served.stdout.splitlines()[-1]), expected, rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_squashed_and_field_wise_layers_pool_as_tfras(combiner: str) -> None:
    rows = {k: np.array([k, -k], np.float32) for k in range(1, 7)}
    squashed = de_store.keras.layers.SquashedEmbedding(
        2, combiner=combiner, name=f"squashed_{combiner}"
    )
    fields = de_store.keras.layers.FieldWiseEmbedding(
        2, 2, slot_map_fn=lambda ids: ids % 2, combiner=combiner, name=f"fields_{combiner}"
    )
    for layer in (squashed, fields):
        layer.params.upsert(list(rows), np.stack(list(rows.values())))
    ids = np.array([[1, 2, 3], [4, 6, 5]], np.int64)
    pool = {
        "sum": lambda r: np.sum(r, 0),
        "mean": lambda r: np.mean(r, 0),
        "sqrtn": lambda r: np.sum(r, 0) / np.sqrt(len(r)),
    }[combiner]
    expected_squashed = [pool([rows[k] for k in sample]) for sample in ids]
    np.testing.assert_allclose(squashed(ids).numpy(), expected_squashed, rtol=1e-6)
    expected_fields = [[pool([rows[k] for k in s if k % 2 == f]) for f in (0, 1)] for s in ids]
    np.testing.assert_allclose(fields(ids).numpy(), expected_fields, rtol=1e-6)


def test_tfra_arguments_and_clear_errors() -> None:
    layer = de_store.keras.layers.Embedding(
        3, key_dtype=tf.int64, init_capacity=64, with_unique=True, name="tfra_args"
    )
    assert layer.params.init_size == 64 and layer.params.dim == 3
    assert de_store.keras.layers.BasicEmbedding is de_store.keras.Embedding
    with pytest.raises(ValueError, match=r"layer 'bad': combiner must be one of sum, mean, sqrtn"):
        de_store.keras.layers.Embedding(3, combiner="max", name="bad")
    with pytest.raises(ValueError, match=r"layer 'no_fn': slot_map_fn is not callable"):
        de_store.keras.layers.FieldWiseEmbedding(3, 2, name="no_fn")
