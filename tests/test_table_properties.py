"""Random operation sequences on every table core agree with a plain dict model."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from de_store.tables import HashTable, MutableTable
from de_store.testing.tables import with_unordered_scatters

DIM = 2
KEYS = st.lists(st.integers(0, 40), min_size=0, max_size=24)  # small range: many duplicates


@st.composite
def operations(draw):
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(
            st.sampled_from(["insert", "accum", "accum_existing", "remove", "lookup", "clear"])
        )
        keys = draw(KEYS)
        values = [[draw(st.integers(-8, 8)) for _ in range(DIM)] for _ in keys]
        ops.append((kind, keys, values))
    return ops


def _apply_to_model(model: dict, kind: str, keys: list, values: list) -> None:
    if kind == "insert":
        for key, row in zip(keys, values, strict=True):
            model[key] = list(row)
    elif kind in ("accum", "accum_existing"):
        for key, row in zip(keys, values, strict=True):
            if key in model:
                model[key] = [a + b for a, b in zip(model[key], row, strict=True)]
            elif kind == "accum":
                model[key] = list(row)
    elif kind == "remove":
        for key in keys:
            model.pop(key, None)
    elif kind == "clear":
        model.clear()


def _encode(table, keys):
    if table.key_dtype == tf.string:
        return tf.constant([str(k).encode() for k in keys], tf.string, shape=[len(keys)])
    return tf.constant(keys, table.key_dtype, shape=[len(keys)])


def _run(table, ops) -> None:
    table.clear()
    model: dict = {}
    for kind, keys, values in ops:
        k = _encode(table, keys)
        v = tf.constant(values, table.value_dtype, shape=[len(keys), DIM])
        if kind == "insert":
            table.insert(k, v)
        elif kind == "accum":
            table.accum(k, v)
        elif kind == "accum_existing":
            table.accum(k, v, insert_missing=False)
        elif kind == "remove":
            table.remove(k)
        elif kind == "clear":
            table.clear()
        else:
            got, exists = table.lookup(k, default_value=tf.constant(-99, table.value_dtype))
            expected = [model.get(key, [-99] * DIM) for key in keys]
            np.testing.assert_array_equal(
                got.numpy().reshape(-1, DIM), np.array(expected).reshape(-1, DIM)
            )
            assert exists.numpy().tolist() == [key in model for key in keys]
        _apply_to_model(model, kind, keys, values)
        assert int(table.size()) == len(model)
    exported_keys, exported_values = table.export_all()
    decoded = [int(k) for k in exported_keys.numpy()]
    assert sorted(decoded) == sorted(model)
    as_dict = dict(zip(decoded, exported_values.numpy().tolist(), strict=True))
    assert as_dict == model


TABLES = {
    "hash_int64_f32": lambda: HashTable(tf.int64, tf.float32, DIM, name="prop"),
    "hash_int32_i64": lambda: HashTable(tf.int32, tf.int64, DIM, name="prop", max_load_factor=0.9),
    "hash_int64_f32_unordered": lambda: with_unordered_scatters(
        HashTable(tf.int64, tf.float32, DIM, name="prop")
    ),
    "mutable_string_f32": lambda: MutableTable(tf.string, tf.float32, DIM, name="prop"),
}


@pytest.fixture(scope="module", params=sorted(TABLES))
def table(request):
    return TABLES[request.param]()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations())
def test_random_operations_match_a_dict(table, ops):
    _run(table, ops)


def test_growth_removal_and_reinsertion_from_tiny_capacity():
    table = HashTable(tf.int64, tf.float32, DIM, name="grow")
    start = table.capacity()
    model: dict = {}
    rng = np.random.default_rng(1)
    for round_ in range(6):
        keys = rng.integers(0, 3000, 700)
        values = rng.integers(-5, 5, (700, DIM)).astype(np.float32)
        table.insert(tf.constant(keys), tf.constant(values))
        for key, row in zip(keys.tolist(), values.tolist(), strict=True):
            model[key] = row
        gone = rng.choice(keys, 300)
        table.remove(tf.constant(gone))
        for key in gone.tolist():
            model.pop(key, None)
        assert int(table.size()) == len(model), round_
    assert table.capacity() > start
    keys, values = table.export_all()
    assert dict(zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)) == model
