"""Training: embedding_lookup gradients, sparse SGD/Adagrad/Adam, bp_v2, the CTR example."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store import optimizers

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]  # 4, see conftest.py

IDS = np.array([[3, 7], [3, -2], [7, 3]], np.int64)  # 3 appears three times, 7 twice


def _loss(embedded: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(embedded * embedded) + tf.reduce_sum(embedded)


def _train(var: ds.Variable, optimizer, steps: int, compiled: bool) -> None:  # type: ignore[no-untyped-def]
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = _loss(ds.embedding_lookup(var, ids))
        variables = var.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

    run = tf.function(step) if compiled else step
    for _ in range(steps):
        run(tf.constant(IDS))


def _dense_reference(keras_optimizer, initial: np.ndarray, steps: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The same training on a dense table of the unique ids [3, 7, -2] with Keras."""
    table = tf.Variable(initial)
    positions = tf.constant([[0, 1], [0, 2], [1, 0]])
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = _loss(tf.gather(table, positions))
        dense_grad = tf.convert_to_tensor(tape.gradient(loss, table))  # sums duplicates
        keras_optimizer.apply_gradients([(dense_grad, table)])
    return table.numpy()


@pytest.mark.parametrize(
    ("make", "slots", "compiled"),
    [
        (lambda: keras.optimizers.SGD(0.1), [], False),
        (lambda: keras.optimizers.Adagrad(0.1), ["adagrad_accumulator"], False),
        (lambda: keras.optimizers.Adam(0.1), ["adam_m", "adam_v"], False),
        (lambda: keras.optimizers.Adam(0.1), ["adam_m", "adam_v"], True),
    ],
    ids=["sgd-eager", "adagrad-eager", "adam-eager", "adam-tf_function"],
)
def test_sparse_optimizer_matches_keras_on_dense_rows(make, slots, compiled) -> None:  # type: ignore[no-untyped-def]
    devices = CPUS[:2]
    var = ds.Variable("train_match", dim=2, devices=devices, initializer=np.array([0.5, -0.5]))
    var.upsert([100], [[9.0, 9.0]])  # an untouched key
    _train(var, ds.optimizers.DynamicEmbeddingOptimizer(make()), steps=3, compiled=compiled)
    expected = _dense_reference(make(), np.tile([[0.5, -0.5]], (3, 1)).astype(np.float32), 3)
    np.testing.assert_allclose(var.lookup([3, 7, -2]).numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(var.lookup([100]).numpy(), [[9.0, 9.0]])
    assert sorted(var.companions()) == slots
    for companion in var.companions().values():  # slots only for trained keys, same shards
        assert sorted(companion.export()[0].numpy()) == [-2, 3, 7]
        for main_shard, slot_shard in zip(var.shards, companion.shards, strict=True):
            trained = set(main_shard.export_all()[0].numpy().tolist()) - {100}
            assert set(slot_shard.export_all()[0].numpy().tolist()) == trained


def test_duplicate_ids_aggregate_their_gradients() -> None:
    var = ds.Variable("dup_grads", dim=1)
    with tf.GradientTape() as tape:
        embedded, wrapper = ds.embedding_lookup(var, [[3, 3], [3, 5]], return_trainable=True)
        loss = tf.reduce_sum(embedded)
    grad = tape.gradient(loss, wrapper.rows)
    assert isinstance(grad, tf.IndexedSlices)
    optimizers.SGD(1.0).apply_gradients([(grad, wrapper.rows)])
    np.testing.assert_array_equal(var.lookup([3, 5]).numpy(), [[-3.0], [-1.0]])


def test_one_optimizer_trains_dense_and_dynamic_variables() -> None:
    var = ds.Variable("mixed", dim=1)
    dense = tf.Variable([1.0])
    optimizer = optimizers.SGD(0.5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ds.embedding_lookup(var, [1]) * dense)
    variables = [*var.trainable_variables, dense]
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    np.testing.assert_array_equal(var.lookup([1]).numpy(), [[-0.5]])
    np.testing.assert_array_equal(dense.numpy(), [1.0])  # d/d dense = embedding = 0
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize(("bp_v2", "lands"), [(False, "one"), (True, "both")])
def test_concurrent_updates_of_the_same_keys(bp_v2: bool, lands: str) -> None:
    """Two workers read the same keys, then both apply: bp_v2 adds both deltas."""
    var = ds.Variable("concurrent", dim=1, initializer=1.0, bp_v2=bp_v2)
    var.upsert([1, 2], [[1.0], [1.0]])
    barrier = threading.Barrier(2)

    def worker(scale: float) -> None:
        optimizer = optimizers.SGD(1.0)
        with tf.GradientTape() as tape:
            embedded, wrapper = ds.embedding_lookup(
                var, [1, 2], name=f"worker{scale}", return_trainable=True
            )
            loss = scale * tf.reduce_sum(embedded)
        grad = tape.gradient(loss, wrapper.rows)
        barrier.wait()  # both have read the rows before either writes
        optimizer.apply_gradients([(grad, wrapper.rows)])

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    values = var.lookup([1, 2]).numpy()[:, 0]
    if lands == "both":
        np.testing.assert_array_equal(values, [1.0 - 3.0, 1.0 - 3.0])
    else:
        assert values.tolist() in ([0.0, 0.0], [-1.0, -1.0])


def test_bp_v2_starts_new_keys_from_their_initial_row() -> None:
    var = ds.Variable("bp_v2_new", dim=1, initializer=4.0, bp_v2=True)
    with tf.GradientTape() as tape:
        embedded, wrapper = ds.embedding_lookup(var, [8], return_trainable=True)
    optimizers.SGD(1.0).apply_gradients([(tape.gradient(embedded, wrapper.rows), wrapper.rows)])
    np.testing.assert_array_equal(var.lookup([8]).numpy(), [[3.0]])


def test_what_is_not_an_optimizer_is_refused_by_type() -> None:
    with pytest.raises(
        ds.errors.VariableError,
        match=r"expected a Keras optimizer or a tf.compat.v1.train.Optimizer, got dict",
    ):
        optimizers.DynamicEmbeddingOptimizer({"learning_rate": 0.1})


def test_ctr_example_loss_falls() -> None:
    from examples.train_ctr import CtrConfig, train

    result = train(CtrConfig(steps=8, batch_size=8192, fields=8), verbose=False)
    assert result["distinct_ids"] > 200_000
    assert result["last_loss"] < result["first_loss"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.Adam(0.1),
    ],
    ids=["sgd", "sgd-momentum", "sgd-nesterov", "adagrad", "adam"],
)
def test_row_gradients_match_keras_on_dense_rows(make) -> None:  # type: ignore[no-untyped-def]
    """apply_row_gradients (the update of ParameterServerStrategy steps, no batch
    variables) trains as the Keras optimizer does on a dense table of the same rows."""
    var = ds.Variable("row_grads", dim=2, devices=CPUS[:2], initializer=np.array([0.5, -0.5]))
    optimizer = optimizers.DynamicEmbeddingOptimizer(make())

    @tf.function
    def step(ids: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            rows = var.lookup(ids)
            tape.watch(rows)
            loss = _loss(rows)
        optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, var)])

    for _ in range(3):
        step(tf.constant(IDS))
    expected = _dense_reference(make(), np.array([[0.5, -0.5]] * 3, np.float32), 3)
    values = var.lookup(tf.constant([3, 7, -2], tf.int64)).numpy()
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations) == 3


def test_row_gradients_refuse_an_optimizer_without_a_row_rule() -> None:
    var = ds.Variable("row_grads_rms", dim=2)
    optimizer = optimizers.DynamicEmbeddingOptimizer(keras.optimizers.RMSprop(0.1))
    with pytest.raises(
        ds.errors.VariableError, match="expected an SGD, Adagrad or Adam optimizer, got RMSprop"
    ):
        optimizer.apply_row_gradients([(tf.ones([1, 2]), tf.constant([1], tf.int64), var)])
