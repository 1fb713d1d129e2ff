"""de_store.keras.layers under Keras 2 (tf_keras), as TFRA 0.8 programs use them: compile,
fit, evaluate, predict (also with a ``tf.function`` call), the weights files and SavedModels
of tf_keras, its checkpoint callbacks, and TFRA's export for serving without de_store."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
import de_store.keras

keras = tf.keras

SERVE = """
import json, sys
sys.modules["de_store"] = None  # importing de_store now fails
import tensorflow as tf
served = tf.saved_model.load(sys.argv[1])
out = served.signatures["serving_default"](tf.constant(json.loads(sys.argv[2]), tf.int64))
print(json.dumps([v.numpy().tolist() for v in out.values()][0]))
"""


def test_the_layers_are_tf_keras_layers_and_keras_3_is_not_imported() -> None:
    assert keras.__name__.startswith("tf_keras")
    assert "keras" not in sys.modules  # de_store.keras imported no Keras 3
    for layer_class in (de_store.keras.Embedding, de_store.keras.layers.SquashedEmbedding):
        assert issubclass(layer_class, keras.layers.Layer)
    assert de_store.keras.layers.BasicEmbedding is de_store.keras.Embedding


def test_a_program_that_imported_from_tensorflow_keras_first_gets_tf_keras_layers() -> None:
    """After ``from tensorflow.keras.optimizers import Adam`` (TFRA's demos start so),
    ``tf.keras`` is a module named ``tensorflow.keras``: the layers still find tf_keras."""
    program = (
        "from tensorflow.keras.optimizers import Adam\n"
        "import de_store as de\n"
        "layer = de.keras.layers.SquashedEmbedding(4, name='after_import')\n"
        "bases = [c.__module__ for c in type(layer).__mro__]\n"
        "print(next(b for b in bases if 'keras.' in b and 'de_store' not in b))\n"
    )
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("tf_keras.src.engine."), done.stdout


def test_a_functional_model_fills_new_ids_from_a_tf_keras_constant_initializer() -> None:
    """tf_keras's Constant needs a static shape; a model's batch has none."""
    ids = keras.Input(shape=(2,), dtype="int64")
    init = keras.initializers.Constant(0.1)
    rows = de_store.keras.layers.Embedding(3, initializer=init, name="constant_rows")(ids)
    model = keras.Model(ids, rows)
    np.testing.assert_allclose(model.predict(IDS[:, :2], verbose=0), np.full([3, 2, 3], 0.1))


@keras.saving.register_keras_serializable(package="tests")
def fields(ids: tf.Tensor) -> tf.Tensor:
    """The field of each id (its parity): registered, so a loaded layer finds it."""
    return ids % 2


def three_layer_model(prefix: str) -> Any:
    """ids -> Embedding, SquashedEmbedding, FieldWiseEmbedding -> one score."""
    ids = keras.Input(shape=(3,), dtype="int64")
    init = tf.random_normal_initializer(stddev=0.1, seed=1)
    rows = de_store.keras.layers.Embedding(4, initializer=init, name=f"{prefix}_rows")(ids)
    pooled = de_store.keras.layers.SquashedEmbedding(4, combiner="mean", name=f"{prefix}_sq")(ids)
    by_field = de_store.keras.layers.FieldWiseEmbedding(
        4, 2, slot_map_fn=fields, combiner="sum", name=f"{prefix}_fw"
    )(ids)
    flat = [keras.layers.Flatten()(x) for x in (rows, pooled, by_field)]
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()(flat)))


def fill(model: Any) -> dict[str, Any]:
    """Give every de_store layer of ``model`` rows and Adam slots; what each holds."""
    keys = np.arange(0, 60, dtype=np.int64)
    held = {}
    for index, layer in enumerate(de_store_layers(model)):
        values = (keys[:, None] * np.arange(1, 5) / 7 + index).astype(np.float32)
        layer.params.upsert(keys, values)
        layer.params.companion("adam_m", 4, tf.float32).upsert(keys[::2], values[::2] * 3)
        held[layer.name] = tables(layer)
    return held


def de_store_layers(model: Any) -> list[Any]:
    return [layer for layer in model.layers if isinstance(layer, de_store.keras.Embedding)]


def tables(layer: Any) -> dict[str, dict[int, tuple[float, ...]]]:
    """The rows of a layer's Variable and of each companion, by key."""
    out = {}
    for column, variable in [("", layer.params), *sorted(layer.params.companions().items())]:
        keys, values = (t.numpy() for t in variable.export())
        out[column] = {
            int(k): tuple(v) for k, v in zip(keys.tolist(), values.tolist(), strict=True)
        }
    return out


def clear(model: Any) -> None:
    for layer in de_store_layers(model):
        for companion in layer.params.companions().values():
            companion.clear()
        layer.params.clear()


IDS = np.array([[1, 2, 3], [4, 50, 61], [7, 7, 8]], np.int64)  # 61: not in the tables


@pytest.mark.parametrize("form", ["tf checkpoint", ".weights.h5", ".keras", "SavedModel"])
def test_weights_files_and_saved_models_carry_tables_and_slots_exactly(
    tmp_path: Path, form: str
) -> None:
    model = three_layer_model(f"files_{form.strip('.').replace(' ', '_')}")
    held = fill(model)
    expected = model.predict(IDS, verbose=0)
    path = str(tmp_path / {"tf checkpoint": "w/ckpt", "SavedModel": "saved"}.get(form, "m" + form))
    if form in ("tf checkpoint", ".weights.h5"):
        model.save_weights(path)
        clear(model)
        model.load_weights(path)
        loaded = model
    else:
        model.save(path)
        clear(model)
        loaded = keras.models.load_model(path)  # its layers get the same Variables back
        assert [type(x) for x in loaded.layers] == [type(x) for x in model.layers]
    for layer in de_store_layers(loaded):
        assert tables(layer) == held[layer.name]
    np.testing.assert_array_equal(loaded.predict(IDS, verbose=0), expected)


def test_legacy_h5_files_are_refused_naming_the_layer_and_the_tables_stay(tmp_path: Path) -> None:
    """Keras 2's legacy .h5 holds fixed-shape weights by position: no table fits in it."""
    model = three_layer_model("legacy_h5")
    held = fill(model)
    message = "layer 'legacy_h5_(rows|sq|fw)': " + re.escape("Keras 2's legacy HDF5 format")
    with pytest.raises(ds.errors.FormatError, match=message):
        model.save_weights(str(tmp_path / "w.h5"))
    with pytest.raises(ds.errors.FormatError, match=message):
        model.save(str(tmp_path / "m.h5"))
    with pytest.raises(ds.errors.FormatError, match=message):
        model.load_weights(str(tmp_path / "w.h5"))  # written by h5py up to the refusal
    for layer in de_store_layers(model):
        assert tables(layer) == held[layer.name]


@pytest.mark.parametrize("legacy", [False, True], ids=["Adam", "legacy Adam"])
def test_a_trained_model_saved_as_saved_model_loads_and_predicts_the_same(
    tmp_path: Path, legacy: bool
) -> None:
    """The batch rows' slots are not saved: both loads revive the model."""
    ids = keras.Input(shape=(3,), dtype="int64")
    rows = de_store.keras.layers.Embedding(4, name=f"trained_{legacy}")(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
    adam = (keras.optimizers.legacy.Adam if legacy else keras.optimizers.Adam)(0.05)
    model.compile(optimizer=ds.DynamicEmbeddingOptimizer(adam), loss="binary_crossentropy")
    model.fit(*clicks(), epochs=1, batch_size=64, verbose=0)
    held = {layer.name: tables(layer) for layer in de_store_layers(model)}
    assert all(sorted(t) == ["", "adam_m", "adam_v"] for t in held.values())
    ids = clicks()[0][:8]  # ids the tables hold: inference mode adds no rows
    expected = model.predict(ids, verbose=0)
    model.save(str(tmp_path / "saved"))
    ds.enable_inference_mode()
    try:
        tf.saved_model.save(model, str(tmp_path / "export"))
    finally:
        ds.enable_train_mode()
    served = tf.saved_model.load(str(tmp_path / "export"))
    out = served.signatures["serving_default"](tf.constant(ids))
    assert_served_as_predicted(next(iter(out.values())), expected)
    clear(model)
    loaded = keras.models.load_model(str(tmp_path / "saved"))
    assert {layer.name: tables(layer) for layer in de_store_layers(loaded)} == held
    np.testing.assert_array_equal(loaded.predict(ids, verbose=0), expected)


class Ranker(keras.Model):
    """A model as TFRA's Keras 2 demos write one: layers in ``__init__``, a ``tf.function``
    call. The embedding is not trained here: the dense layer is, by a plain tf_keras Adam."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.emb = de_store.keras.layers.SquashedEmbedding(4, name=name, trainable=False)
        self.score = keras.layers.Dense(1, activation="sigmoid")

    @tf.function
    def call(self, ids: tf.Tensor) -> tf.Tensor:
        return self.score(self.emb(ids))


def clicks() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(2).integers(0, 60, size=(256, 3)).astype(np.int64)
    return ids, (ids[:, 0] % 2).astype(np.float32)


class StopAfter(keras.callbacks.Callback):
    """Fails the fit at the end of epoch ``epoch``, as a killed job would end."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch:
            raise RuntimeError(f"stopped after epoch {epoch}")


class Watch(keras.callbacks.Callback):
    """What the de_store layer holds when training starts, and the epochs run."""

    def on_train_begin(self, logs: Any = None) -> None:
        self.tables, self.epochs = tables(self.model.emb), []

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(epoch)


def test_fit_evaluate_predict_and_the_checkpoint_callbacks(tmp_path: Path) -> None:
    model = Ranker("fit_emb")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy")
    model.predict(clicks()[0][:1], verbose=0)  # builds the layers
    held = fill(model)["fit_emb"]
    save_every_epoch = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "mc" / "ckpt-{epoch}"), save_weights_only=True
    )
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped after epoch 1"):
        model.fit(
            *clicks(), epochs=3, batch_size=64, verbose=0,
            callbacks=[save_every_epoch, keras.callbacks.BackupAndRestore(backup), StopAfter(1)],
        )  # fmt: skip
    at_stop = model.predict(clicks()[0][:8], verbose=0)  # what ckpt-2 holds
    clear(model)
    watch = Watch()
    history = model.fit(
        *clicks(), epochs=3, batch_size=64, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup), watch],
    )  # fmt: skip
    assert watch.tables == held and watch.epochs == [2]  # restored, then the last epoch
    assert np.isfinite(history.history["loss"]).all()
    assert np.isfinite(model.evaluate(*clicks(), verbose=0))
    clear(model)
    model.load_weights(str(tmp_path / "mc" / "ckpt-2"))
    assert tables(model.emb) == held
    np.testing.assert_array_equal(model.predict(clicks()[0][:8], verbose=0), at_stop)


def assert_served_as_predicted(served: Any, predicted: np.ndarray) -> None:
    """A served signature's outputs against ``Model.predict``'s: the rows looked up are
    the same, but the exported graph and Keras' predict function run the dense layers as
    different TensorFlow graphs, whose CPU kernels can sum the products in another order.
    The difference is that of float32 sums whose terms are about as large as the outputs:
    a few ulps of the largest output, absolute (seen: 1.5e-8 at an output of 0.0036, where
    the terms nearly cancel; 1.9e-6, one ulp of 16, at an output of 0.12 among outputs up
    to 16.9). So the tolerance is 1e-5 of the largest output (1e-5 at least). A row looked
    up wrong moves an output far more; the tables themselves are compared exactly in the
    tests that load them."""
    scale = max(1.0, float(np.abs(predicted).max()))
    np.testing.assert_allclose(np.asarray(served), predicted, rtol=1e-6, atol=1e-5 * scale)


def test_tfra_export_serves_without_de_store(tmp_path: Path) -> None:
    """TFRA's export: inference mode, then ``tf.saved_model.save`` of the model."""
    model = three_layer_model("export")
    fill(model)
    ids = clicks()[0][:8]  # ids the tables hold: inference mode adds no rows
    expected = model.predict(ids, verbose=0)
    ds.enable_inference_mode()
    try:
        tf.saved_model.save(model, str(tmp_path / "export"))
    finally:
        ds.enable_train_mode()
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path / "export"), json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert_served_as_predicted(json.loads(served.stdout.splitlines()[-1]), expected)


def test_the_keras_2_example_of_docs_keras_md_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = (Path(__file__).parents[2] / "docs" / "keras.md").read_text()
    blocks = re.findall(r"^```python keras2\n(.*?)^```", page, re.M | re.S)
    assert blocks, "docs/keras.md: expected a ```python keras2 block"
    monkeypatch.chdir(tmp_path)
    for index, block in enumerate(blocks):  # from a file: autograph reads the source
        (tmp_path / f"example_{index}.py").write_text(block)
        runpy.run_path(str(tmp_path / f"example_{index}.py"), run_name="__docs__")
