"""embedding_lookup_sparse, safe_embedding_lookup_sparse and embedding_lookup_unique with
TFRA 0.8's signatures: equal to TensorFlow's functions over a dense table holding the same
rows, eagerly and inside tf.function, with gradients reaching the trainable wrapper."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds

KEYS = np.array([5, -3, 12, 40, 0, 7], np.int64)  # row i of DENSE is key KEYS[i]
DENSE = np.arange(12, dtype=np.float32).reshape(6, 2) / 4 - 1


def table(name: str) -> ds.Variable:
    var = ds.Variable(name, dim=2)
    var.upsert(KEYS, DENSE)
    return var


def as_positions(sparse: tf.SparseTensor) -> tf.SparseTensor:
    """The same sparse ids as rows of DENSE."""
    lookup = {int(k): i for i, k in enumerate(KEYS)}
    values = [lookup[int(k)] for k in sparse.values.numpy()]
    return tf.SparseTensor(sparse.indices, tf.constant(values, tf.int64), sparse.dense_shape)


IDS = tf.SparseTensor(
    [[0, 0], [0, 1], [1, 0], [3, 2], [3, 3]], tf.constant([5, -3, 12, 5, 40], tf.int64), [4, 4]
)
WEIGHTS = tf.SparseTensor(IDS.indices, [2.0, 0.5, 1.0, 3.0, -1.0], IDS.dense_shape)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_embedding_lookup_sparse_equals_tf_nn_on_the_same_rows(
    combiner: str, weighted: bool, compiled: bool
) -> None:
    var = table(f"sparse_{combiner}_{weighted}_{compiled}")
    weights = WEIGHTS if weighted else None

    def lookup() -> tf.Tensor:
        return ds.embedding_lookup_sparse(var, IDS, weights, combiner=combiner, max_norm=2.0)

    got = (tf.function(lookup) if compiled else lookup)()
    expected = tf.nn.embedding_lookup_sparse(
        DENSE, as_positions(IDS), weights, combiner=combiner, max_norm=2.0
    )
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)


@pytest.mark.parametrize("default_id", [None, 7])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_safe_lookup_fills_empty_rows_drops_nonpositive_weights_and_keeps_negative_ids(
    combiner: str, default_id: int | None
) -> None:
    var = table(f"safe_{combiner}_{default_id}")
    got = ds.safe_embedding_lookup_sparse(
        var, IDS, WEIGHTS, combiner=combiner, default_id=default_id
    )
    rows = {int(k): DENSE[i] for i, k in enumerate(KEYS)}
    empty = np.zeros(2) if default_id is None else rows[default_id]
    keep_negative = combiner == "sum"  # weights <= 0 dropped for mean and sqrtn
    last = 3 * rows[5] + (-1.0 * rows[40] if keep_negative else 0)
    if combiner == "mean":
        last = last / 3.0
    expected = [
        (2 * rows[5] + 0.5 * rows[-3]) / (2.5 if combiner == "mean" else 1),
        rows[12],
        empty,
        last,
    ]
    np.testing.assert_allclose(got.numpy(), np.array(expected), rtol=1e-6)


def test_safe_lookup_of_rank_3_ids_keeps_the_leading_dimensions() -> None:
    var = table("safe_rank3")
    ids = tf.SparseTensor(
        [[0, 0, 0], [0, 1, 0], [0, 1, 1], [1, 0, 1]],
        tf.constant([5, 12, 40, -3], tf.int64),
        [2, 2, 3],
    )
    got = ds.safe_embedding_lookup_sparse(var, ids, None, combiner="sum")
    rows = {int(k): DENSE[i] for i, k in enumerate(KEYS)}
    expected = [[rows[5], rows[12] + rows[40]], [rows[-3], np.zeros(2)]]
    assert got.shape == (2, 2, 2)
    np.testing.assert_allclose(got.numpy(), np.array(expected, np.float32), rtol=1e-6)


def test_sparse_gradients_reach_the_wrapper_and_train_only_the_looked_up_keys() -> None:
    var = table("sparse_train")
    optimizer = ds.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        out, wrapper = ds.embedding_lookup_sparse(
            var, IDS, None, combiner="sum", return_trainable=True
        )
        loss = tf.reduce_sum(out)
    optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
    counts = {5: 2, -3: 1, 12: 1, 40: 1, 0: 0, 7: 0}  # how often each key is summed
    expected = [DENSE[i] - counts[int(k)] for i, k in enumerate(KEYS)]
    np.testing.assert_allclose(var.lookup(KEYS).numpy(), np.array(expected), rtol=1e-6)


def test_embedding_lookup_unique_has_the_shape_of_the_ids() -> None:
    var = table("unique")
    ids = tf.constant([[5, 5, -3], [40, 5, 0]], tf.int64)
    got, wrapper = ds.embedding_lookup_unique(var, ids, return_trainable=True)
    rows = {int(k): DENSE[i] for i, k in enumerate(KEYS)}
    np.testing.assert_array_equal(got.numpy(), [[rows[int(k)] for k in r] for r in ids.numpy()])
    assert sorted(wrapper.ids.numpy()) == [-3, 0, 5, 40]


def test_bad_combiner_and_dense_ids_are_refused() -> None:
    var = table("refused")
    with pytest.raises(
        ValueError,
        match=r"variable 'refused': combiner must be one of 'mean', 'sqrtn' or 'sum', got 'max'",
    ):
        ds.embedding_lookup_sparse(var, IDS, None, combiner="max")
    with pytest.raises(
        TypeError,
        match=r"variable 'refused': sparse ids must be a tf.SparseTensor, got EagerTensor",
    ):
        ds.safe_embedding_lookup_sparse(var, tf.constant([[1]], tf.int64))
