"""The fixed-shape layout of HashTable (tables on parameter servers): every variable keeps
the shape it was created with, the table grows into new variables eagerly, and a traced
step reads the table's current variables."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from de_store.tables import HashTable
from de_store.testing.table_suite import content


def _fixed(name="ps/emb", **kwargs):
    return HashTable(tf.int64, tf.float32, 2, name=name, fixed_shapes=True, **kwargs)


def _rows(keys):
    keys = tf.cast(keys, tf.float32)
    return tf.stack([keys, -keys], 1)


def _shapes(table):
    return [tuple(v.shape) for v in table.variables]


def test_every_variable_has_a_fixed_shape_through_growth():
    table = _fixed()
    for start in range(0, 3000, 1000):
        keys = tf.range(start, start + 1000, dtype=tf.int64)
        table.insert(keys, _rows(keys))
        assert all(v.shape.is_fully_defined() for v in table.variables), _shapes(table)
    table.remove(tf.range(0, 3000, 2, dtype=tf.int64))
    assert all(v.shape.is_fully_defined() for v in table.variables)
    assert content(table) == {k: (float(k), float(-k)) for k in range(1, 3000, 2)}


def test_a_step_traced_before_a_growth_uses_the_grown_table():
    table = _fixed()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def step(keys):
        table.insert(keys, _rows(keys))
        return table.lookup(keys)[0]

    step(tf.constant([1, 2], tf.int64))
    table.reserve(5000)
    assert table.capacity() >= 5000 / table.max_load_factor
    keys = tf.range(100, 4100, dtype=tf.int64)
    np.testing.assert_array_equal(step(keys).numpy(), _rows(keys).numpy())
    assert step.experimental_get_tracing_count() == 1
    assert int(table.size()) == 4002


def test_a_step_without_room_fails_naming_the_table_and_writes_nothing():
    table = _fixed(name="ps/user")
    table.insert(tf.constant([1, 2, 3], tf.int64), _rows([1, 2, 3]))
    insert = tf.function(lambda keys: table.insert(keys, _rows(keys)))
    before = content(table)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"table ps/user on .*no room for the batch"
    ) as err:
        insert(tf.range(10, 1010, dtype=tf.int64))
    assert "call Variable.reserve" in str(err.value)
    assert content(table) == before
    table.reserve(1000)  # between steps: the same step then fits
    insert(tf.range(10, 1010, dtype=tf.int64))
    assert int(table.size()) == 1003


def test_removals_grow_the_removal_log_eagerly_and_export_changes():
    table = _fixed()
    keys = tf.range(0, 100, dtype=tf.int64)
    table.insert(keys, _rows(keys))
    mark = table.change_epoch()
    table.set_change_epoch(mark + 1)
    table.remove(keys[:60])
    changed, _, removed = table.export_changes(mark)
    assert len(changed) == 0
    assert sorted(removed.numpy().tolist()) == list(range(60))


def test_clear_keeps_every_shape():
    table = _fixed()
    keys = tf.range(0, 500, dtype=tf.int64)
    table.insert(keys, _rows(keys))
    shapes = _shapes(table)
    table.clear()
    assert _shapes(table) == shapes
    assert int(table.size()) == 0
    table.insert(keys[:5], _rows(keys[:5]))
    assert content(table) == {k: (float(k), float(-k)) for k in range(5)}


def test_local_tables_grow_in_place_by_default():
    with tf.device("/CPU:0"):
        table = HashTable(tf.int64, tf.float32, 2)
    assert not table.fixed_shapes
    assert table.index.shape.as_list() == [None, 2]


def test_variable_reserve_grows_every_shard_and_companion_between_steps():
    import de_store as ds

    with tf.device("/CPU:0"):
        var = ds.Variable("ps_like", dim=2, devices=["/CPU:0", "/CPU:1"], initializer=0.0)
    for index, shard in enumerate(var.shards):  # the layout of tables on parameter servers
        var.shards[index] = HashTable(tf.int64, tf.float32, 2, name=shard.table_name,
                                      fixed_shapes=True)  # fmt: skip
    slot = var.companion("adagrad_accumulator", 2, tf.float32, 0.1)
    for index, shard in enumerate(slot.shards):
        slot.shards[index] = HashTable(tf.int64, tf.float32, 2, name=shard.table_name,
                                       fixed_shapes=True)  # fmt: skip
    var.reserve(10_000)
    for table in (*var.shards, *slot.shards):
        assert table.capacity() * table.max_load_factor >= 5_000
    with pytest.raises(ds.errors.VariableError, match="'ps_like': reserve grows tables eagerly"):
        tf.function(lambda: var.reserve(1), autograph=False)()


def test_a_full_table_still_takes_batches_of_keys_it_holds():
    table = _fixed(init_size=100)
    keys = tf.range(0, 100, dtype=tf.int64)
    table.insert(keys, _rows(keys))
    shapes = _shapes(table)
    step = tf.function(
        lambda k: (table.insert(k, _rows(k) * 2), table.accum(k, _rows(k))),
        input_signature=[tf.TensorSpec([None], tf.int64)],
    )
    step(keys)  # every key present: no room needed, no growth
    assert _shapes(table) == shapes
    assert content(table) == {k: (3.0 * k, -3.0 * k) for k in range(100)}
