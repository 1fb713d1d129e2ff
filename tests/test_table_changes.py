"""Change tracking of the table cores: what changed since a mark, exactly (incremental saves)."""

from __future__ import annotations

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import de_store
from de_store.tables import HashTable, MutableTable

CORES = [
    pytest.param(lambda: HashTable(tf.int64, tf.float32, 2, name="emb/changes"), id="hash64"),
    pytest.param(lambda: HashTable(tf.int32, tf.float32, 2, name="emb/changes"), id="hash32"),
    pytest.param(lambda: MutableTable(tf.string, tf.float32, 2, name="emb/changes"), id="string"),
]


def _keys(table, ids):
    if table.key_dtype == tf.string:
        return tf.constant([str(i).encode() for i in ids], tf.string)
    return tf.constant(ids, table.key_dtype)


def _ids(table, keys):
    return sorted(int(k) for k in keys.numpy())  # int() reads b"12" too


def _rows(ids, scale=1.0):
    return tf.constant([[scale * i, -scale * i] for i in ids], tf.float32, shape=[len(ids), 2])


def _mark(table) -> int:
    mark = table.change_epoch()
    table.set_change_epoch(mark + 1)
    return mark


@pytest.mark.parametrize("make", CORES)
def test_changes_since_a_mark_are_the_written_rows_and_the_removed_keys(make):
    table = make()
    table.insert(_keys(table, [1, 2, 3, 4]), _rows([1, 2, 3, 4]))
    mark = _mark(table)
    table.insert(_keys(table, [2, 5]), _rows([2, 5], 10.0))  # update + insert
    table.accum(_keys(table, [3, 3]), _rows([1, 1]))  # accum, duplicated
    table.accum(_keys(table, [9]), _rows([1]), insert_missing=False)  # missing: no change
    table.remove(_keys(table, [4, 8]))  # 8 was never there
    table.remove(_keys(table, [1]))
    table.insert(_keys(table, [1]), _rows([7]))  # removed then back

    keys, values, removed = table.export_changes(mark)
    by_key = {int(k): v.tolist() for k, v in zip(keys.numpy(), values.numpy(), strict=True)}
    assert by_key == {1: [7.0, -7.0], 2: [20.0, -20.0], 3: [5.0, -5.0], 5: [50.0, -50.0]}
    assert _ids(table, removed) == [4]
    # Nothing changed after a new mark; everything since before the first write.
    later = _mark(table)
    assert [len(x) for x in table.export_changes(later)] == [0, 0, 0]
    assert _ids(table, table.export_changes(0)[0]) == [1, 2, 3, 5]


@pytest.mark.parametrize("make", CORES)
def test_forget_removed_drops_old_records_and_clear_drops_history(make):
    table = make()
    table.insert(_keys(table, [1, 2, 3]), _rows([1, 2, 3]))
    table.remove(_keys(table, [1]))
    first = _mark(table)
    table.remove(_keys(table, [2]))
    table.forget_removed(first)
    assert _ids(table, table.export_changes(0)[2]) == [2]
    epoch = table.change_epoch()
    table.clear()
    assert [len(x) for x in table.export_changes(0)] == [0, 0, 0]
    assert table.change_epoch() == epoch


def test_changes_are_tracked_inside_tf_function_and_through_growth():
    table = HashTable(tf.int64, tf.float32, 2, name="emb/changes")
    table.insert(tf.range(100, dtype=tf.int64), tf.zeros([100, 2]))
    mark = _mark(table)

    @tf.function(autograph=False)
    def step(keys, deltas):
        table.accum(keys, deltas)

    step(tf.constant([5, 5000], tf.int64), tf.ones([2, 2]))
    table.insert(tf.range(1000, 3000, dtype=tf.int64), tf.ones([2000, 2]))  # grows the table
    changed = sorted(table.export_changes(mark)[0].numpy().tolist())
    assert changed == [5, *range(1000, 3000), 5000]


def test_a_table_without_tracking_says_so():
    table = HashTable(tf.int64, tf.float32, 2, name="emb/untracked", track_changes=False)
    table.insert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    with pytest.raises(ValueError, match="'emb/untracked' does not track changes"):
        table.export_changes(0)
    variable = de_store.get_variable(
        "changes/untracked", dim=2, kv_creator=de_store.HashTableCreator(track_changes=False)
    )
    with pytest.raises(de_store.errors.VariableError, match="changes/untracked"):
        variable.next_change_epoch()


def test_a_variable_mark_covers_its_shards_and_companions_created_later():
    variable = de_store.get_variable("changes/var", dim=2, devices=["/CPU:0", "/CPU:1", "/CPU:2"])
    variable.upsert(tf.constant([1, 2, 3], tf.int64), tf.ones([3, 2]))
    mark = variable.next_change_epoch()
    assert all(table.change_epoch() == mark + 1 for table in variable.all_tables())
    slot = variable.companion("adam_m", 2, tf.float32)  # created after the mark
    slot.upsert(tf.constant([2], tf.int64), tf.ones([1, 2]))
    changed = [
        sorted(table.export_changes(mark)[0].numpy().tolist()) for table in variable.all_tables()
    ]
    assert [key for keys in changed for key in keys] == [2]
    assert len(variable.all_tables()) == 6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "accum", "remove", "mark"]),
            st.lists(st.integers(0, 40), min_size=1, max_size=12),
        ),
        max_size=12,
    )
)
def test_replaying_changes_on_a_copy_gives_the_same_table(ops):
    """A copy kept in step only through export_changes equals the table at every mark."""
    table = HashTable(tf.int64, tf.float32, 2, name="emb/replay", init_size=4)
    copy: dict[int, list[float]] = {}
    mark = _mark(table)
    for op, ids in [*ops, ("mark", [])]:
        keys = tf.constant(ids, tf.int64)
        if op == "insert":
            table.insert(keys, _rows(ids, float(len(ids))))
        elif op == "accum":
            table.accum(keys, _rows(ids))
        elif op == "remove":
            table.remove(keys)
        else:
            keys_c, values_c, removed = table.export_changes(mark)
            for key in removed.numpy().tolist():
                copy.pop(key, None)
            for key, row in zip(keys_c.numpy().tolist(), values_c.numpy(), strict=True):
                copy[key] = row.tolist()
            mark = _mark(table)
            table.forget_removed(mark)
            all_keys, all_values = table.export_all()
            expected = {
                k: v.tolist()
                for k, v in zip(all_keys.numpy().tolist(), all_values.numpy(), strict=True)
            }
            assert copy == expected
