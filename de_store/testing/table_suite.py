"""The conformance suite of the :class:`~de_store.tables.TableCore` contract.

A table core's test file subclasses :class:`TableCoreTests` and defines
:meth:`~TableCoreTests.make_table`; pytest then runs every test here against that core::

    from de_store.testing.table_suite import TableCoreTests

    class TestMyTable(TableCoreTests):
        def make_table(self, key_dtype, value_dtype, dim, name):
            return MyTable(key_dtype, value_dtype, dim, name=name)

de_store's own cores (``HashTable``, with serial and with unordered scatters, and
``MutableTable``) run it the same way. This module needs pytest (a test dependency);
``import de_store`` does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from de_store.tables import TableCore

#: The name of the table each test makes: error messages must name it.
TABLE_NAME = "emb/user"


def rows(n: int, start: float = 0.0) -> tf.Tensor:
    """``[n, 3]`` float32 rows counting up from ``start``."""
    return tf.reshape(tf.range(start, start + 3 * n, dtype=tf.float32), [n, 3])


def content(table: TableCore) -> dict[Any, tuple[Any, ...]]:
    """A table's keys and rows as a dict."""
    keys, values = table.export_all()
    return dict(zip(keys.numpy().tolist(), map(tuple, values.numpy().tolist()), strict=True))


class TableCoreTests:
    """Behaviour every table core must show. Subclasses define :meth:`make_table`."""

    def make_table(
        self, key_dtype: tf.DType, value_dtype: tf.DType, dim: int, name: str
    ) -> TableCore:
        """A new empty table core of the implementation under test."""
        raise NotImplementedError("a table core test class must define make_table")

    @pytest.fixture
    def table(self) -> TableCore:
        """An empty int64 -> float32 table of dim 3 named :data:`TABLE_NAME`."""
        return self.make_table(tf.int64, tf.float32, 3, TABLE_NAME)

    def test_lookup_defaults_and_exists(self, table: TableCore) -> None:
        table.insert(tf.constant([7, 8], tf.int64), rows(2))
        values, exists = table.lookup(tf.constant([8, 9], tf.int64), default_value=[1.0, 2.0, 3.0])
        np.testing.assert_array_equal(values.numpy(), [[3, 4, 5], [1, 2, 3]])
        assert exists.numpy().tolist() == [True, False]

    def test_insert_keeps_last_and_accum_sums_duplicates(self, table: TableCore) -> None:
        keys = tf.constant([5, 5, 6], tf.int64)
        table.insert(keys, rows(3))
        assert content(table) == {5: (3, 4, 5), 6: (6, 7, 8)}
        table.accum(tf.constant([5, 5, 9], tf.int64), tf.ones([3, 3]))
        table.accum(tf.constant([10], tf.int64), tf.ones([1, 3]), insert_missing=False)
        assert content(table) == {5: (5, 6, 7), 6: (6, 7, 8), 9: (1, 1, 1)}

    def test_export_batches_are_a_snapshot(self, table: TableCore) -> None:
        table.insert(tf.range(10, dtype=tf.int64), rows(10))
        batches = table.export(4)
        table.clear()
        sizes = [int(k.shape[0]) for k, _ in batches]
        assert sizes == [4, 4, 2]
        assert int(table.size()) == 0

    def test_a_snapshot_never_sees_later_writes(self, table: TableCore) -> None:
        """A save reads its snapshot later (in the background): inserts, updates,
        accumulations, removals, a growth and a clear made after it must not show."""
        rng = np.random.default_rng(5)
        start = tf.constant(rng.permutation(21_000).astype(np.int64))
        table.insert(start, tf.constant(rng.standard_normal((21_000, 3), dtype=np.float32)))
        table.remove(start[20_000:])  # tombstones the snapshot's lookups probe past
        expected = content(table)
        snapshot = table.snapshot()
        big = tf.constant(rng.permutation(40_000).astype(np.int64) + 10_000)  # a growth
        table.insert(big, tf.ones([40_000, 3]))
        table.accum(start[:5_000], tf.ones([5_000, 3]))
        table.remove(start[5_000:9_000])
        snapshot_rows = snapshot.read()
        table.clear()
        table.insert(start[:100], tf.zeros([100, 3]))
        for keys, values in (snapshot_rows, snapshot.read()):
            assert snapshot.rows == 20_000 == int(tf.size(keys))
            found = dict(
                zip(keys.numpy().tolist(), map(tuple, values.numpy().tolist()), strict=True)
            )
            assert found == expected
        if snapshot.lookup is not None:  # held keys, removed keys, keys never held
            asked = tf.concat([start[::-1], tf.constant([-5, 10**12], tf.int64)], 0)
            found_rows = snapshot.lookup(asked).numpy().tolist()
            wanted = [expected.get(k, (0.0, 0.0, 0.0)) for k in asked.numpy().tolist()]
            assert list(map(tuple, found_rows)) == wanted

    def test_import_batches_round_trips(self, table: TableCore) -> None:
        table.insert(tf.range(20, dtype=tf.int64), rows(20))
        other = self.make_table(tf.int64, tf.float32, 3, "emb/other")
        other.import_batches(table.export(6))
        assert content(other) == content(table)

    def test_works_inside_tf_function(self, table: TableCore) -> None:
        @tf.function
        def step(keys: tf.Tensor, values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            table.insert(keys, values)
            table.accum(keys, values)
            table.remove(keys[:1])
            return table.lookup(keys)

        keys = tf.constant([1, 2, 3], tf.int64)
        values, exists = step(keys, rows(3))
        assert exists.numpy().tolist() == [False, True, True]
        np.testing.assert_array_equal(values.numpy()[1], [6, 8, 10])

    @pytest.mark.parametrize(
        ("keys", "values", "error", "words"),
        [
            ([1, 2], tf.ones([2, 3], tf.float64), TypeError, ["float32", "float64"]),
            (
                tf.constant([1], tf.int32),
                np.ones([1, 3], np.float32),
                TypeError,
                ["int64", "int32"],
            ),
            ([1, 2], np.ones([2, 4], np.float32), ValueError, ["[n, 3]", "(2, 4)"]),
            ([1, 2], np.ones([3, 3], np.float32), ValueError, ["(2)", "3"]),
        ],
    )
    def test_bad_input_names_the_table_and_leaves_it_unchanged(
        self, table: TableCore, keys: Any, values: Any, error: type, words: list[str]
    ) -> None:
        table.insert(tf.constant([1], tf.int64), rows(1))
        before = content(table)
        with pytest.raises(error) as raised:
            table.insert(tf.constant(keys, tf.int64 if isinstance(keys, list) else None), values)
        for word in [TABLE_NAME, *words]:
            assert word in str(raised.value)
        assert content(table) == before

    def test_load_distinct_gives_what_insert_gives(self, table: TableCore) -> None:
        table.insert(tf.constant([1, 2], tf.int64), rows(2))
        table.remove(tf.constant([2], tf.int64))  # a freed row to reuse
        table.load_distinct(tf.constant([5, 2, 9], tf.int64), rows(3, start=100.0))
        assert content(table) == {
            1: (0.0, 1.0, 2.0),
            5: (100.0, 101.0, 102.0),
            2: (103.0, 104.0, 105.0),
            9: (106.0, 107.0, 108.0),
        }
        assert int(table.size()) == 4
