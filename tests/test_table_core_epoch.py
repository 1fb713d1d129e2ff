"""The change epoch methods every table core gets from :class:`TableCore`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import tensorflow as tf

from de_store.tables import HashTable, MutableTable, TableCore


class WithoutEpoch(TableCore):
    """A core that keeps no change epoch: its rows live in a MutableTable."""

    def __init__(self) -> None:
        super().__init__(name="plain")
        self.key_dtype, self.value_dtype, self.dim = tf.int64, tf.float32, 2
        self.rows = MutableTable(tf.int64, tf.float32, 2, name="rows", track_changes=False)

    def lookup(
        self, keys: tf.Tensor, default_value: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        return self.rows.lookup(keys, default_value)

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> None:
        self.rows.insert(keys, values)

    def accum(self, keys: tf.Tensor, deltas: tf.Tensor, insert_missing: bool = True) -> None:
        self.rows.accum(keys, deltas, insert_missing)

    def remove(self, keys: tf.Tensor) -> None:
        self.rows.remove(keys)

    def size(self) -> tf.Tensor:
        return self.rows.size()

    def clear(self) -> None:
        self.rows.clear()

    def export(self, batch_size: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        return self.rows.export(batch_size)


@pytest.mark.parametrize("core", [HashTable, MutableTable])
def test_both_cores_keep_their_epoch_through_the_contract_methods(core: type[TableCore]) -> None:
    assert (core.change_epoch, core.set_change_epoch) == (
        TableCore.change_epoch,
        TableCore.set_change_epoch,
    )
    table: Any = core(tf.int64, tf.float32, 2, name="emb/epochs")  # type: ignore[call-arg]
    assert table.change_epoch() == 1
    table.set_change_epoch(7)
    assert (table.change_epoch(), int(table.epoch.numpy())) == (7, 7)


def test_a_core_without_an_epoch_says_it_tracks_no_changes() -> None:
    table = WithoutEpoch()
    message = "table 'plain' (WithoutEpoch) does not track changes"
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        table.change_epoch()
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        table.set_change_epoch(2)
