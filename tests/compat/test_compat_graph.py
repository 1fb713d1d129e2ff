"""tf.compat.v1 graphs and Session.run, as TFRA's tests run every case: table operations,
lookups and a tf.compat.v1.train optimizer's updates give what they give eagerly."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import de_store as ds

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")][:2]  # 4, see conftest.py
KEYS = np.array([5, -3, 12, 40], np.int64)
ROWS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], np.float32)


def test_table_operations_return_ops_that_session_run_runs() -> None:
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        var = ds.get_variable("graph_ops", dim=2, devices=CPUS, initializer=-1.0)
        keys = tf.constant(KEYS)
        upsert, remove = var.upsert(keys, ROWS), var.remove(tf.constant([-3], tf.int64))
        accum = var.accum(tf.constant([5, 99], tf.int64), tf.ones([2, 2]))
        tfra_accum = var.accum(keys[:2], ROWS[:2], ROWS[:2] * 3, tf.constant([True, False]))
        lookup, size, clear = var.lookup(keys), var.size(), var.clear()
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(upsert)
        np.testing.assert_array_equal(session.run(lookup), ROWS)
        session.run(remove)
        session.run(accum)  # 5 gets +1; 99 is inserted as 0 + 1
        assert session.run(size) == 4
        session.run(tfra_accum)  # 5 gets 3 * row - row; -3 (absent) is inserted as 3 * row
        np.testing.assert_array_equal(
            session.run(lookup), [[4.0, 7.0], [9.0, 12.0], ROWS[2], ROWS[3]]
        )
        session.run(clear)
        assert session.run(size) == 0


def test_a_train_step_in_a_graph_equals_the_same_step_run_eagerly() -> None:
    def step(var: ds.Variable) -> tf.Tensor:
        ids = tf.constant([[5, 12], [5, -3]], tf.int64)
        out, wrapper = ds.embedding_lookup(var, ids, name="graph_step", return_trainable=True)
        loss = tf.reduce_sum(out * out)
        optimizer = ds.DynamicEmbeddingOptimizer(tf.compat.v1.train.AdagradOptimizer(0.1))
        return optimizer.minimize(loss, var_list=[wrapper])

    eager = ds.Variable("graph_step_eager", dim=2)
    eager.upsert(KEYS, ROWS)
    optimizer = ds.DynamicEmbeddingOptimizer(tf.compat.v1.train.AdagradOptimizer(0.1))
    for _ in range(2):
        with tf.GradientTape() as tape:
            out, wrapper = ds.embedding_lookup(
                eager, [[5, 12], [5, -3]], name="graph_step", return_trainable=True
            )
            loss = tf.reduce_sum(out * out)
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
    expected = eager.lookup(KEYS).numpy()

    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        var = ds.get_variable("graph_step_var", dim=2)
        seed = var.upsert(tf.constant(KEYS), ROWS)
        train, lookup = step(var), var.lookup(tf.constant(KEYS))
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(seed)
        for _ in range(2):
            session.run(train)
        np.testing.assert_allclose(session.run(lookup), expected, rtol=1e-6)
        slot = var.companions()["adagrad_accumulator"]
        assert sorted(session.run(slot.export()[0])) == [-3, 5, 12]


def test_sparse_lookup_runs_in_a_graph() -> None:
    ids = tf.compat.v1.SparseTensorValue([[0, 0], [0, 1], [1, 0]], [5, 40, -3], [2, 2])
    eager = ds.Variable("graph_sparse_eager", dim=2)
    eager.upsert(KEYS, ROWS)
    sparse = tf.SparseTensor(ids.indices, tf.constant(ids.values, tf.int64), ids.dense_shape)
    expected = ds.embedding_lookup_sparse(eager, sparse, None, combiner="mean").numpy()
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        var = ds.get_variable("graph_sparse", dim=2)
        seed = var.upsert(tf.constant(KEYS), ROWS)
        graph_ids = tf.SparseTensor(ids.indices, tf.constant(ids.values, tf.int64), ids.dense_shape)
        out = ds.embedding_lookup_sparse(var, graph_ids, None, combiner="mean")
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(seed)
        np.testing.assert_array_equal(session.run(out), expected)


def test_string_keys_train_in_a_graph() -> None:
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        var = ds.get_variable("graph_words", key_dtype=tf.string, dim=2)
        words = tf.constant([b"a", b"b", b"c"])
        upsert, remove = var.upsert(words, tf.ones([3, 2])), var.remove(tf.constant([b"b"]))
        out, wrapper = ds.embedding_lookup(var, words, name="lk", return_trainable=True)
        optimizer = ds.DynamicEmbeddingOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = optimizer.minimize(tf.reduce_sum(out), var_list=[wrapper])
        lookup, size = var.lookup(words), var.size()
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(upsert)
        session.run(remove)
        assert session.run(size) == 2
        session.run(train)  # b was missing: it starts from zeros
        np.testing.assert_array_equal(session.run(lookup), [[0.5, 0.5], [-0.5, -0.5], [0.5, 0.5]])
