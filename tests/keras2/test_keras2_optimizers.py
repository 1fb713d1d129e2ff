"""Under Keras 2 (tf_keras), DynamicEmbeddingOptimizer wraps tf.keras.optimizers.* and
tf.keras.optimizers.legacy.*: the rows and slots of the looked-up keys get exactly the update
the same tf_keras optimizer gives a dense variable holding those rows, eagerly, inside
tf.function and in model.fit."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store import embedding

keras = tf.keras  # tf_keras: tests/keras2/conftest.py stops a run where it is not

# Key 3 comes three times in the first batch; -2 joins in the second, 11 in the third. Every
# batch holds the keys of the ones before it: a dense table's rows not in a batch would
# still move with their momentum, a Variable's rows not looked up do not.
BATCHES = [
    np.array([[3, 7, 3], [3, 7, 7]], np.int64),
    np.array([[7, -2, 3], [3, -2, 7]], np.int64),
    np.array([[11, 3, -2], [7, 11, 3]], np.int64),
]
KEYS = [3, 7, -2, 11]  # the dense reference's rows
START = np.array([[0.5, -0.25], [0.1, 0.2], [0.0, 0.0], [0.0, 0.0]], np.float32)

OPTIMIZERS = {
    "sgd_momentum": lambda o: o.SGD(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda o: o.Adagrad(0.1),
    "adam": lambda o: o.Adam(0.1),
    "adam_amsgrad": lambda o: o.Adam(0.1, amsgrad=True),
    "rmsprop_centered": lambda o: o.RMSprop(0.05, momentum=0.5, centered=True),
    "ftrl": lambda o: o.Ftrl(0.1, l1_regularization_strength=0.01),
    "adamax": lambda o: o.Adamax(0.1),
    "nadam": lambda o: o.Nadam(0.1),
    "adadelta": lambda o: o.Adadelta(1.0),
}
CURRENT = {
    **OPTIMIZERS,
    "adamw": lambda o: o.AdamW(0.1, weight_decay=0.05),
    "lion": lambda o: o.Lion(0.01),
}
KINDS = [("current", kind) for kind in sorted(CURRENT)] + [
    ("legacy", kind) for kind in sorted(OPTIMIZERS)
]


def make(family: str, kind: str):  # type: ignore[no-untyped-def]
    """A tf_keras optimizer: ``tf.keras.optimizers`` (current) or its ``legacy`` module."""
    module = keras.optimizers if family == "current" else keras.optimizers.legacy
    return CURRENT[kind](module)


def loss_of(embedded: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(embedded * embedded * embedded) + tf.reduce_sum(embedded)


def seeded(name: str) -> ds.Variable:
    """Keys 3 and 7 with their START rows, 100 untouched; new keys start at zeros."""
    var = ds.Variable(name, dim=2, initializer=0.0)
    var.upsert([3, 7, 100], np.concatenate([START[:2], [[9.0, 9.0]]]))
    return var


def train(var: ds.Variable, optimizer, compiled: bool) -> None:  # type: ignore[no-untyped-def]
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            embedded, wrapper = ds.embedding_lookup(var, ids, return_trainable=True)
            loss = loss_of(embedded)
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])

    run = tf.function(step) if compiled else step
    for ids in BATCHES:
        run(tf.constant(ids))


def dense_reference(optimizer) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The same batches on a dense table of KEYS, through the optimizer's dense update."""
    table = tf.Variable(START)
    for ids in BATCHES:
        positions = np.vectorize(KEYS.index)(ids)
        with tf.GradientTape() as tape:
            loss = loss_of(tf.gather(table, positions))
        optimizer.apply_gradients([(tf.convert_to_tensor(tape.gradient(loss, table)), table)])
    return table.numpy()


# companion columns: those of the Keras 3 slot holding the same state
RMSPROP = ["rmsprop_average_gradient", "rmsprop_momentum", "rmsprop_velocity"]
COLUMNS = {
    ("current", "sgd_momentum"): ["sgd_momentum"],
    ("current", "adam_amsgrad"): ["adam_m", "adam_v", "adam_velocity_hat"],
    ("current", "rmsprop_centered"): RMSPROP,
    ("legacy", "sgd_momentum"): ["sgd_momentum"],
    ("legacy", "adam_amsgrad"): ["adam_m", "adam_v", "adam_velocity_hat"],
    ("legacy", "rmsprop_centered"): RMSPROP,
    ("legacy", "adagrad"): ["adagrad_accumulator"],
    ("legacy", "ftrl"): ["ftrl_accumulator", "ftrl_linear"],
    ("legacy", "adadelta"): ["adadelta_accumulated_delta_var", "adadelta_accumulated_grad"],
}
# every optimizer eagerly; inside tf.function those whose slots differ most in kind (not
# tf_keras's current Nadam: it gives NaN in tf.function on a plain tf.Variable too, its
# update step keeping a Python counter that a traced tf.cond cannot update)
COMPILED = {"adam", "ftrl", "rmsprop_centered"}
CASES = [
    pytest.param(
        family,
        kind,
        compiled,
        id=f"{family}-{kind}-{'tf_function' if compiled else 'eager'}",
    )
    for family, kind in KINDS
    for compiled in (False, True)
    if not compiled or kind in COMPILED
]


@pytest.mark.parametrize(("family", "kind", "compiled"), CASES)
def test_every_tf_keras_optimizer_updates_the_looked_up_rows_as_on_a_dense_variable(
    family: str, kind: str, compiled: bool
) -> None:
    var = seeded(f"keras2_{family}_{kind}_{compiled}")
    optimizer = ds.DynamicEmbeddingOptimizer(make(family, kind))
    assert type(optimizer).__mro__[1:].count(type(make(family, kind))) == 1  # same class
    train(var, optimizer, compiled)
    expected = dense_reference(make(family, kind))
    np.testing.assert_allclose(var.lookup(KEYS).numpy(), expected, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(var.lookup([100]).numpy(), [[9.0, 9.0]])  # not looked up
    assert int(optimizer.iterations) == len(BATCHES)
    for companion in var.companions().values():  # slots hold the trained keys only
        assert sorted(companion.export()[0].numpy()) == sorted(KEYS)
    if (family, kind) in COLUMNS:
        assert sorted(var.companions()) == COLUMNS[family, kind]


@pytest.mark.parametrize(
    ("name", "config"),
    [("SGD", {"momentum": 0.9}), ("Adagrad", {}), ("Adam", {})],
)
def test_de_store_optimizers_are_tf_keras_optimizers_with_row_gradients(
    name: str, config: dict[str, float]
) -> None:
    """ds.optimizers.SGD/Adagrad/Adam are tf_keras optimizers; apply_row_gradients (no
    batch variables) trains as the tf_keras optimizer does on a dense table."""
    optimizer = getattr(ds.optimizers, name)(0.1, **config)
    assert isinstance(optimizer, getattr(keras.optimizers, name))
    var = seeded(f"keras2_rows_{name}")

    @tf.function
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            rows = var.lookup(ids)
            tape.watch(rows)
            loss = loss_of(rows)
        optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, var)])

    for ids in BATCHES:
        step(tf.constant(ids))
    expected = dense_reference(getattr(keras.optimizers, name)(0.1, **config))
    np.testing.assert_allclose(var.lookup(KEYS).numpy(), expected, rtol=2e-5, atol=1e-6)
    assert int(optimizer.iterations) == len(BATCHES)


class DynamicRows(keras.layers.Layer):
    """Rows of the ids from a de_store Variable (a lookup with return_trainable=True)."""

    def __init__(self, var: ds.Variable) -> None:
        super().__init__()
        self.var = var

    def call(self, ids: tf.Tensor) -> tf.Tensor:
        embedded, self.rows = ds.embedding_lookup(self.var, ids, return_trainable=True)
        return embedded


class DenseRows(keras.layers.Layer):
    """The reference: rows of the ids' positions in KEYS from a dense weight."""

    def build(self, input_shape: tf.TensorShape) -> None:
        self.table = self.add_weight(name="table", shape=START.shape, initializer="zeros")
        self.table.assign(START)

    def call(self, ids: tf.Tensor) -> tf.Tensor:
        positions = tf.argmax(tf.cast(ids[..., None] == tf.constant(KEYS, tf.int64), tf.int32), -1)
        return tf.gather(self.table, positions)


def fitted(rows: keras.layers.Layer, optimizer) -> keras.Model:  # type: ignore[no-untyped-def]
    ids = keras.Input(shape=(3,), dtype="int64")
    flat = keras.layers.Flatten()(rows(ids))
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.1))(flat)
    model = keras.Model(ids, out)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.concatenate([BATCHES[2], BATCHES[2][::-1], BATCHES[1], BATCHES[2]])  # 11 in each 4
    y = np.arange(len(x), dtype=np.float32)[:, None] / 4
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("family", ["current", "legacy"])
def test_model_fit_trains_the_table_and_the_dense_layers_as_a_dense_model(family: str) -> None:
    """model.fit of a tf_keras model with a lookup layer, its optimizer wrapped, gives the
    rows and the Dense weights that fit of the same model on a dense table gives."""
    var = seeded(f"keras2_fit_{family}")
    model = fitted(DynamicRows(var), ds.DynamicEmbeddingOptimizer(make(family, "adam")))
    reference = fitted(DenseRows(), make(family, "adam"))
    np.testing.assert_allclose(
        var.lookup(KEYS).numpy(), reference.layers[1].table.numpy(), rtol=2e-5, atol=1e-6
    )
    for got, expected in zip(model.layers[-1].weights, reference.layers[-1].weights, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=2e-5, atol=1e-6)
    assert int(model.optimizer.iterations) == 4  # 2 epochs of 2 batches


@pytest.mark.parametrize("family", ["current", "legacy"])
def test_the_optimizer_is_extended_in_place_as_tfra_does(family: str) -> None:
    """TFRA programs may go on with the object they passed in: it trains the tables."""
    adam = make(family, "adam")
    assert ds.DynamicEmbeddingOptimizer(adam) is adam
    var = seeded(f"in_place_{family}")
    with tf.GradientTape() as tape:
        rows, wrapper = ds.embedding_lookup(var, BATCHES[0], return_trainable=True)
        loss = loss_of(rows)
    adam.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
    assert sorted(var.companions()) == ["adam_m", "adam_v"]
    assert not np.array_equal(var.lookup([3, 7]).numpy(), START[:2])


@pytest.fixture
def rows_as_on_parameter_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups give BatchRows, as for tables on parameter-server tasks, here on local
    tables (tests/distribute/test_ps_tfra.py runs them on a cluster)."""
    monkeypatch.setattr(embedding, "on_parameter_servers", lambda params: True)


TENSOR_CASES = [("current", kind) for kind in sorted(COMPILED)] + [
    ("legacy", kind) for kind in ("adagrad", "adam", "sgd_momentum")
]


@pytest.mark.parametrize(("family", "kind"), TENSOR_CASES)
def test_rows_held_as_tensors_are_updated_as_on_a_dense_variable(
    family: str, kind: str, rows_as_on_parameter_servers: None
) -> None:
    """Current optimizers run their own update step on the tensors; legacy SGD, Adagrad
    and Adam the rules of their fused kernels."""
    var = seeded(f"keras2_tensor_rows_{family}_{kind}")
    optimizer = ds.DynamicEmbeddingOptimizer(make(family, kind))
    train(var, optimizer, compiled=True)
    expected = dense_reference(make(family, kind))
    np.testing.assert_allclose(var.lookup(KEYS).numpy(), expected, rtol=2e-5, atol=1e-6)
    assert int(optimizer.iterations) == len(BATCHES)
    if (family, kind) in COLUMNS:
        assert sorted(var.companions()) == COLUMNS[family, kind]


def test_a_legacy_optimizer_without_a_tensor_rule_refuses_naming_the_variable(
    rows_as_on_parameter_servers: None,
) -> None:
    var = seeded("keras2_tensor_rows_rmsprop")
    with pytest.raises(ds.errors.VariableError, match="'keras2_tensor_rows_rmsprop': its tables"):
        train(var, ds.DynamicEmbeddingOptimizer(make("legacy", "rmsprop_centered")), False)
    np.testing.assert_array_equal(var.lookup(KEYS[:2]).numpy(), START[:2])
