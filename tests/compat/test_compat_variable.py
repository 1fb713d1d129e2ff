"""Variable and get_variable as in TFRA 0.8: its argument order, accum, size(index), slot
and trainable look-ups, [1] initializers, names kept per graph and by variable scope, and
TensorFlow's InvalidArgumentError for values of the wrong shape."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import de_store as ds


def test_tfras_positional_order_and_its_default_name() -> None:
    var = ds.Variable(tf.int64, tf.float32, 3, ["/CPU:0", "/CPU:1"], initializer=[0.25])
    assert (var.name, var.key_dtype, var.value_dtype, var.dim) == (
        "DynamicEmbedding_Variable",
        tf.int64,
        tf.float32,
        3,
    )
    assert len(var.shards) == 2
    np.testing.assert_array_equal(var.lookup([5]).numpy(), [[0.25] * 3])  # [1] broadcast
    named = ds.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=2, name="kw")
    assert named.name == "kw" and ds.Variable("own", tf.int64, tf.float32, 2).dim == 2


def test_size_of_one_table_and_a_bad_index() -> None:
    var = ds.Variable("sizes", dim=1, devices=["/CPU:0", "/CPU:1"])
    var.upsert(np.arange(5, dtype=np.int64), np.ones([5, 1], np.float32))
    assert [int(var.size(0)), int(var.size(1)), int(var.size())] == [3, 2, 5]  # key mod 2
    with pytest.raises(ds.errors.VariableError, match=r"table index in \[0, 2\), got 2"):
        var.size(2)


def test_tfra_accum_adds_deltas_to_present_keys_and_inserts_the_missing() -> None:
    var = ds.Variable("accum_tfra", dim=1)
    var.upsert([1, 2], [[10.0], [20.0]])
    keys = tf.constant([1, 2, 3], tf.int64)
    old = tf.constant([[1.0], [2.0], [0.0]])
    new = tf.constant([[4.0], [2.5], [7.0]])
    var.remove([2])  # present when read, removed since: TFRA's kernel does not bring it back
    var.accum(keys, old, new, [True, True, False])
    found, exists = var.lookup([1, 2, 3], return_exists=True)
    np.testing.assert_array_equal(found.numpy(), [[13.0], [0.0], [7.0]])
    assert exists.numpy().tolist() == [True, False, True]
    var.accum([1], [[1.0]])  # de_store's accum(keys, deltas) still adds
    np.testing.assert_array_equal(var.lookup([1]).numpy(), [[14.0]])


def test_slot_variables_and_trainables_by_name() -> None:
    var = ds.Variable("slots_by_optimizer", dim=2)
    optimizer = ds.DynamicEmbeddingOptimizer(keras.optimizers.Adam(0.1))
    with tf.GradientTape() as tape:
        out, tw = ds.embedding_lookup(var, [1, 2], name="lk", return_trainable=True)
        loss = tf.reduce_sum(out)
    optimizer.apply_gradients([(tape.gradient(loss, tw), tw)])
    assert var.trainable_store == {"lk": tw} and var.get_trainable_by_name("lk") is tw
    assert var.get_trainable_by_name("other") is None
    slots = var.get_slot_variables(optimizer)
    assert [s.name for s in slots] == ["slots_by_optimizer/adam_m", "slots_by_optimizer/adam_v"]
    assert var.get_slot_variables(keras.optimizers.SGD()) == []


def test_values_of_the_wrong_shape_raise_tensorflows_invalid_argument_error() -> None:
    var = ds.Variable("bad_shape", dim=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"expected values of shape \[n, 3\]"):
        var.upsert([1], [[1.0, 2.0]])
    with pytest.raises(ds.errors.VariableError):  # still de_store's error too
        var.upsert([1], [[1.0, 2.0]])


def test_name_scopes_do_not_name_variables_and_variable_scopes_do() -> None:
    with tf.name_scope("ops"):
        plain = ds.get_variable("scoped_emb")
    with tf.compat.v1.variable_scope("tower"):
        towered = ds.get_variable("scoped_emb")
        short = ds.get_variable("short_emb", short_file_name=True)
    assert (plain.name, towered.name, short.name) == ("scoped_emb", "tower/scoped_emb", "short_emb")


def test_variables_are_kept_per_graph_and_reuse_follows_the_variable_scope() -> None:
    eager = ds.get_variable("per_graph")
    with tf.Graph().as_default():
        first = ds.get_variable("per_graph")
        assert first is not eager
        with pytest.raises(ValueError, match=r"Variable per_graph already exists, disallowed"):
            ds.get_variable("per_graph")
        with tf.compat.v1.variable_scope("", reuse=True):
            assert ds.get_variable("per_graph") is first
    with tf.Graph().as_default():
        assert ds.get_variable("per_graph") is not first
    assert ds.get_variable("per_graph") is eager  # eager code reuses


def test_restoring_a_slash_name_from_its_tfra_import_names_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    saved = ds.Variable("tower_emb", dim=1)
    saved.upsert([1], [[1.0]])
    ds.save([saved], str(tmp_path / "ckpt")).result()
    with pytest.raises(
        ds.errors.CheckpointError,
        match=r"TFRA writes 'tower/emb' as 'tower_emb': import it with `de-store convert "
        r"\.\.\. --name tower/emb`",
    ):
        ds.restore([ds.Variable("tower/emb", dim=1)], str(tmp_path / "ckpt"))


def test_tables_and_tfras_file_system_save_and_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    var = ds.Variable(tf.int64, tf.float32, 2, ["/CPU:0", "/CPU:1"], name="fs/emb")
    keys = np.array([1, 2, 3, 2**31 + 1, -7], np.int64)
    var.upsert(keys, np.stack([keys, -keys], 1).astype(np.float32))
    assert len(var.tables) == 2 and var.tables == var.shards
    written = var.save_to_file_system(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == [
        f"fs_emb_mht_{i}of2_rank0_size1-{part}" for i in (1, 2) for part in ("keys", "values")
    ]
    loaded = ds.Variable("fs/emb", dim=2, devices=["/CPU:0", "/CPU:1", "/CPU:2"])
    loaded.load_from_file_system(str(tmp_path))
    np.testing.assert_array_equal(loaded.lookup(keys).numpy(), var.lookup(keys).numpy())
    assert int(loaded.size()) == 5
