"""The trainable wrapper is a tf.Variable (TFRA's is a ResourceVariable), lookups accept
TFRA's argument order, a list of one Variable and ragged ids, and inference mode writes no
trainable state."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import de_store as ds


def seeded(name: str) -> ds.Variable:
    var = ds.Variable(name, dim=2, initializer=-1.0)
    var.upsert([1, 2, 3], [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
    return var


def test_the_wrapper_is_a_resource_variable_that_tape_gradient_takes() -> None:
    var = seeded("wrapper_gradient")
    with tf.GradientTape() as tape:
        out, tw = ds.embedding_lookup(var, [[2, 1], [2, 9]], None, "batch", None, None, True)
        loss = tf.reduce_sum(out * out)
    assert isinstance(tw, resource_variable_ops.ResourceVariable)
    (grad,) = tape.gradient(loss, [tw])
    np.testing.assert_array_equal(tw.ids.numpy(), [2, 1, 9])
    np.testing.assert_array_equal(tw.existed.numpy(), [True, True, False])
    np.testing.assert_array_equal(
        tf.convert_to_tensor(grad).numpy(), 2 * np.array([[4.0, 5.0], [1.0, 1.5], [-1.0, -1.0]])
    )
    assert var.trainable_variables == (tw,)
    assert ds.embedding_lookup(var, [1], name="batch", return_trainable=True)[1] is tw


def test_a_list_of_one_variable_is_looked_up_and_a_longer_list_refused() -> None:
    var = seeded("wrapper_list")
    np.testing.assert_array_equal(ds.embedding_lookup([var], [3]).numpy(), [[3.0, 3.5]])
    with pytest.raises(ValueError, match=r"expected one de_store Variable .* got a list of 2"):
        ds.embedding_lookup([var, var], [3])
    with pytest.raises(TypeError, match=r"expected a de_store Variable as params, got EagerTensor"):
        ds.embedding_lookup(tf.zeros([2, 2]), [1])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_ragged_ids_give_a_ragged_result_of_the_same_rows(compiled: bool) -> None:
    var = seeded(f"wrapper_ragged_{compiled}")
    ids = tf.ragged.constant([[1, 2, 3], [], [3]], dtype=tf.int64)
    lookup = tf.function(ds.embedding_lookup) if compiled else ds.embedding_lookup
    out = lookup(var, ids)
    assert isinstance(out, tf.RaggedTensor)
    assert out.to_list() == [[[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]], [], [[3.0, 3.5]]]


def test_inference_mode_reads_the_tables_and_writes_no_wrapper() -> None:
    var = seeded("wrapper_inference")
    assert ds.get_model_mode() == ds.ModelMode.TRAIN == "train"
    ds.enable_inference_mode()
    try:
        assert ds.get_model_mode() == ds.ModelMode.INFERENCE == "inference"
        out = tf.function(ds.embedding_lookup)(var, tf.constant([3, 8], tf.int64))
        np.testing.assert_array_equal(out.numpy(), [[3.0, 3.5], [-1.0, -1.0]])
        assert var.trainable_variables == ()  # no wrapper was made or filled
        assert int(var.size()) == 3  # nothing inserted
    finally:
        ds.enable_train_mode()
    assert ds.get_model_mode() == "train"


def test_trainable_wrapper_filter_splits_wrappers_from_other_variables() -> None:
    var = seeded("wrapper_filter")
    _, tw = ds.embedding_lookup(var, [1], return_trainable=True)
    dense = tf.Variable([1.0])
    from de_store.embedding import trainable_wrapper_filter

    assert trainable_wrapper_filter([dense, tw]) == ((dense,), (tw,))
