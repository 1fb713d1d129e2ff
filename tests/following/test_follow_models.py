"""de_store.follow on what serving holds: a Keras model with de_store layers, and a
SavedModel exported by de_store and loaded with tf.saved_model.load."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import de_store as ds
import de_store.keras

POLICY = ds.IncrementalPolicy(full_every=100, max_chain_ratio=1e9)


def ranker() -> keras.Model:
    ids = keras.Input([2], dtype="int64")
    rows = de_store.keras.layers.Embedding(4, name="item_emb")(ids)
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))


def test_a_keras_model_follows_the_tables_of_its_layers(tmp_path: Path) -> None:
    trained, served = ranker(), ranker()
    table = trained.get_layer("item_emb").params
    table.upsert(tf.constant([5, 6], tf.int64), tf.constant([[1.0] * 4, [2.0] * 4]))
    ds.save([table], str(tmp_path / "ckpt-0"), incremental=POLICY, blocking=True)
    follower = ds.Follower(served, str(tmp_path), start=False)
    assert list(follower.targets) == ["item_emb"]
    assert follower.poll().kind == "full"  # type: ignore[union-attr]
    table.upsert(tf.constant([7], tf.int64), tf.constant([[3.0] * 4]))
    table.remove(tf.constant([5], tf.int64))
    ds.save([table], str(tmp_path / "ckpt-1"), incremental=POLICY, blocking=True)
    assert follower.poll().kind == "delta"  # type: ignore[union-attr]
    params = served.get_layer("item_emb").params
    keys, exists = params.lookup(tf.constant([5, 6, 7], tf.int64), return_exists=True)
    np.testing.assert_array_equal(exists.numpy(), [False, True, True])
    np.testing.assert_array_equal(keys.numpy()[1:], [[2.0] * 4, [3.0] * 4])


class Ranker(tf.Module):
    def __init__(self, emb: ds.Variable) -> None:
        super().__init__()
        self.emb = emb

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def serve(self, ids: tf.Tensor) -> tf.Tensor:
        return ds.embedding_lookup(self.emb, ids)


def test_a_loaded_saved_model_serves_each_checkpoint_applied(tmp_path: Path) -> None:
    """Its tables are found by their saved names; the follower's writes and the
    SavedModel's lookups share the loaded tables (two shards, routed alike)."""
    emb = ds.Variable("emb", dim=2, initializer=0.5, devices=["/CPU:0", "/CPU:0"])
    emb.upsert(tf.constant([1, 3], tf.int64), tf.constant([[1.0, 2.0], [3.0, 4.0]]))
    tf.saved_model.save(Ranker(emb), str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    ds.save([emb], str(tmp_path / "ckpts" / "ckpt-0"), incremental=POLICY, blocking=True)
    emb.upsert(tf.range(100, 200, dtype=tf.int64), tf.fill([100, 2], 7.0))
    emb.remove(tf.constant([1], tf.int64))
    ds.save([emb], str(tmp_path / "ckpts" / "ckpt-1"), incremental=POLICY, blocking=True)
    follower = ds.Follower(loaded, str(tmp_path / "ckpts"), start=False)
    assert list(follower.targets) == ["emb"]
    applied = follower.poll()
    assert applied is not None and (applied.kind, applied.upserted, applied.removed) == (
        "full",
        100,  # ckpt-0's rows are held already: only ckpt-1's are written
        1,
    )
    ids = tf.constant([1, 3, 9, 150, 199], tf.int64)
    expected = [[0.5, 0.5], [3.0, 4.0], [0.5, 0.5], [7.0, 7.0], [7.0, 7.0]]
    np.testing.assert_array_equal(loaded.serve(ids).numpy(), expected)
    np.testing.assert_array_equal(emb.lookup(ids).numpy(), expected)
