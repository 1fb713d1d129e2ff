"""DynamicEmbeddingOptimizer wraps any Keras 3 or tf.compat.v1.train optimizer (TFRA 0.8's
meaning): the rows and slots of the looked-up keys get exactly the update the same optimizer
gives a dense variable holding those rows, eagerly and inside tf.function."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store import embedding

IDS = np.array([[3, 7], [3, -2], [7, 3]], np.int64)  # unique ids in order: 3, 7, -2
POSITIONS = [[0, 1], [0, 2], [1, 0]]
START = np.array([[0.5, -0.25], [0.1, 0.2], [-0.3, 0.4]], np.float32)  # rows of 3, 7, -2

KERAS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adam": lambda: keras.optimizers.Adam(0.1),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.1, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.1, weight_decay=0.05),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.05, momentum=0.5, centered=True),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.1),
    "nadam": lambda: keras.optimizers.Nadam(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "lion": lambda: keras.optimizers.Lion(0.01),
}
V1 = {
    "gradient_descent": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
    "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(0.05, momentum=0.5, centered=True),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(0.1),
    "proximal_adagrad": lambda: tf.compat.v1.train.ProximalAdagradOptimizer(0.1),
    "proximal_gd": lambda: tf.compat.v1.train.ProximalGradientDescentOptimizer(
        0.1, l1_regularization_strength=0.01
    ),
    "adadelta": lambda: tf.compat.v1.train.AdadeltaOptimizer(1.0),
}


def loss_of(embedded: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(embedded * embedded * embedded) + tf.reduce_sum(embedded)


def seeded(name: str, **kwargs) -> ds.Variable:  # type: ignore[no-untyped-def]
    var = ds.Variable(name, dim=2, **kwargs)
    var.upsert([3, 7, -2, 100], np.concatenate([START, [[9.0, 9.0]]]))
    return var


def train(var: ds.Variable, optimizer, steps: int, compiled: bool) -> None:  # type: ignore[no-untyped-def]
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            embedded, wrapper = ds.embedding_lookup(var, ids, return_trainable=True)
            loss = loss_of(embedded)
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])

    run = tf.function(step) if compiled else step
    for _ in range(steps):
        run(tf.constant(IDS))


def dense_reference(optimizer, steps: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    table = tf.Variable(START)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_of(tf.gather(table, POSITIONS))
        grad = tf.convert_to_tensor(tape.gradient(loss, table))
        optimizer.apply_gradients([(grad, table)])
    return table.numpy()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("kind", sorted(KERAS))
def test_every_keras_optimizer_updates_the_looked_up_rows_as_on_a_dense_variable(
    kind: str, compiled: bool
) -> None:
    var = seeded(f"keras_{kind}_{compiled}")
    train(var, ds.DynamicEmbeddingOptimizer(KERAS[kind]()), steps=3, compiled=compiled)
    expected = dense_reference(KERAS[kind](), steps=3)
    np.testing.assert_allclose(var.lookup([3, 7, -2]).numpy(), expected, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(var.lookup([100]).numpy(), [[9.0, 9.0]])  # not looked up
    for companion in var.companions().values():  # slots hold the trained keys only
        assert sorted(companion.export()[0].numpy()) == [-2, 3, 7]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("kind", sorted(V1))
def test_every_compat_v1_optimizer_updates_the_looked_up_rows_as_on_a_dense_variable(
    kind: str, compiled: bool
) -> None:
    var = seeded(f"v1_{kind}_{compiled}")
    train(var, ds.DynamicEmbeddingOptimizer(V1[kind]()), steps=3, compiled=compiled)
    expected = dense_reference(V1[kind](), steps=3)
    np.testing.assert_allclose(var.lookup([3, 7, -2]).numpy(), expected, rtol=2e-5, atol=1e-6)


def test_the_optimizer_is_extended_in_place_as_tfra_does() -> None:
    """TFRA programs may go on with the object they passed in: it trains the tables."""
    adam = KERAS["adam"]()
    assert ds.DynamicEmbeddingOptimizer(adam) is adam
    var = seeded("in_place")
    train(var, adam, steps=1, compiled=False)
    assert sorted(var.companions()) == ["adam_m", "adam_v"]


def test_slot_columns_are_named_by_optimizer_and_slot() -> None:
    columns = {}
    for kind in ("adam_amsgrad", "rmsprop_centered", "ftrl", "sgd_momentum"):
        var = seeded(f"columns_{kind}")
        train(var, ds.DynamicEmbeddingOptimizer(KERAS[kind]()), steps=1, compiled=False)
        columns[kind] = sorted(var.companions())
    assert columns == {
        "adam_amsgrad": ["adam_m", "adam_v", "adam_velocity_hat"],
        "rmsprop_centered": ["rmsprop_average_gradient", "rmsprop_momentum", "rmsprop_velocity"],
        "ftrl": ["ftrl_accumulator", "ftrl_linear"],
        "sgd_momentum": ["sgd_momentum"],
    }


def test_slots_restore_with_the_table_and_training_goes_on_as_without_the_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    saving = {"kv_creator": ds.HashTableCreator(saver=ds.FileSystemSaver())}
    var = seeded("resumed", **saving)
    optimizer = ds.DynamicEmbeddingOptimizer(keras.optimizers.RMSprop(0.05, momentum=0.5))
    train(var, optimizer, steps=2, compiled=False)
    path = tf.train.Checkpoint(emb=var, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    train(var, optimizer, steps=2, compiled=False)

    restored = ds.Variable("resumed", dim=2, **saving)
    again = ds.DynamicEmbeddingOptimizer(keras.optimizers.RMSprop(0.05, momentum=0.5))
    tf.train.Checkpoint(emb=restored, optimizer=again).restore(path)
    assert sorted(restored.companions()) == ["rmsprop_momentum", "rmsprop_velocity"]
    train(restored, again, steps=2, compiled=False)
    np.testing.assert_allclose(
        restored.lookup([3, 7, -2]).numpy(), var.lookup([3, 7, -2]).numpy(), rtol=1e-6
    )


def test_minimize_takes_a_callable_loss_and_a_callable_var_list() -> None:
    var = seeded("minimized")
    optimizer = ds.DynamicEmbeddingOptimizer(keras.optimizers.SGD(0.1))
    found = {}

    def loss() -> tf.Tensor:
        embedded, found["wrapper"] = ds.embedding_lookup(var, IDS, return_trainable=True)
        return loss_of(embedded)

    optimizer.minimize(loss, var_list=lambda: [found["wrapper"]])
    expected = dense_reference(keras.optimizers.SGD(0.1), steps=1)
    np.testing.assert_allclose(var.lookup([3, 7, -2]).numpy(), expected, rtol=1e-6)
    assert int(optimizer.iterations) == 1


@pytest.fixture
def rows_as_on_parameter_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups give BatchRows, as for tables on parameter-server tasks, here on local
    tables: the update of rows held as tensors of the step, without a cluster
    (tests/distribute/test_ps_tfra.py runs it on one)."""
    monkeypatch.setattr(embedding, "on_parameter_servers", lambda params: True)


@pytest.mark.parametrize(
    ("kind", "nested"),
    [(kind, False) for kind in sorted(KERAS)] + [(k, True) for k in ("adamw", "nadam")],
    ids=lambda x: {False: "flat", True: "nested tf.function"}.get(x, x),
)
def test_every_keras_optimizer_updates_rows_held_as_tensors_as_on_a_dense_variable(
    kind: str, nested: bool, rows_as_on_parameter_servers: None
) -> None:
    var = seeded(f"tensor_rows_{kind}_{nested}")
    optimizer = ds.DynamicEmbeddingOptimizer(KERAS[kind]())
    wrapper = embedding.trainable_wrapper(var)  # embedding_lookup's, as TFRA returns it
    assert isinstance(wrapper, embedding.BatchRows)

    def lookup(ids: tf.Tensor) -> tf.Tensor:
        return ds.embedding_lookup(var, ids)

    @tf.function
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:  # a nested function: a Keras call in a tf.function
            loss = loss_of((tf.function(lookup) if nested else lookup)(ids))
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])

    for _ in range(3):
        step(tf.constant(IDS))
    expected = dense_reference(KERAS[kind](), steps=3)
    np.testing.assert_allclose(var.lookup([3, 7, -2]).numpy(), expected, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(var.lookup([100]).numpy(), [[9.0, 9.0]])  # not looked up
    assert int(optimizer.iterations) == 3


def test_a_compat_v1_optimizer_refuses_rows_held_as_tensors_naming_the_variable(
    rows_as_on_parameter_servers: None,
) -> None:
    var = seeded("tensor_rows_v1")
    with pytest.raises(ds.errors.VariableError, match="'tensor_rows_v1': its tables live on"):
        train(var, ds.DynamicEmbeddingOptimizer(V1["adam"]()), steps=1, compiled=False)
    np.testing.assert_array_equal(var.lookup([3, 7, -2]).numpy(), START)
