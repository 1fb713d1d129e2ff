"""The creators of a :class:`~de_store.variable.Variable`'s table cores, one per shard,
which also carry the saver that checkpoints the Variable (TFRA's ``kv_creator``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from de_store._variable_args import INT_KEYS

if TYPE_CHECKING:  # importing de_store.tables creates TF constants, which fixes the devices
    from de_store.tables.base import TableCore


class HashTableCreator:
    """Creates the table core of each shard and carries the checkpoint saver.

    Integer keys get ``de_store.tables.HashTable`` (GPU-capable) when it is available,
    string keys (and int keys without it) get ``de_store.tables.MutableTable``.

    Parameters
    ----------
    saver:
        The saver that checkpoints variables created with this creator, or ``None`` to
        rely on ``tf.train.Checkpoint`` alone. Only stored here.
    track_changes:
        Whether the tables track what changed since the last checkpoint (needed for
        incremental checkpoints; costs 4 bytes a row and one scatter per write).
    """

    def __init__(self, saver: Any = None, track_changes: bool = True) -> None:
        self.saver = saver
        self.track_changes = bool(track_changes)

    def create(
        self, key_dtype: tf.DType, value_dtype: tf.DType, dim: int, *, name: str, init_size: int
    ) -> TableCore:
        """Return a new, empty table core for one shard."""
        import de_store.tables as tables

        core_cls = getattr(tables, "HashTable", None) if key_dtype in INT_KEYS else None
        if core_cls is None:
            core_cls = tables.MutableTable
        return core_cls(
            key_dtype,
            value_dtype,
            dim,
            name=name,
            init_size=init_size,
            track_changes=self.track_changes,
        )


class CuckooHashTableCreator(HashTableCreator):
    """TFRA's creator name, for programs that move over by changing their import: the same
    table as :class:`HashTableCreator`. ``config`` (TFRA's ``CuckooHashTableConfig``) is
    accepted and unused: de_store's table sizes itself as it grows."""

    def __init__(self, config: Any = None, saver: Any = None) -> None:
        del config
        super().__init__(saver=saver)
