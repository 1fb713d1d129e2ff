"""Key partitioning: which shard of a ``de_store.Variable`` holds a key.

A partitioner is any callable ``partitioner(keys, shard_num) -> int32 shard ids``. The
helpers here split a key batch by shard and stitch per-shard results back into the
original order; the saver reuses them to look companion columns up shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

Partitioner = Callable[[tf.Tensor, int], tf.Tensor]


def default_partition_fn(keys: tf.Tensor, shard_num: int) -> tf.Tensor:
    """Return the shard id (``int32``) of every key.

    Integer keys go to ``keys mod shard_num`` (a floor modulo, so negative keys land in
    ``[0, shard_num)`` too); string keys go to a fast string hash modulo ``shard_num``.

    Parameters
    ----------
    keys:
        A 1-D tensor of ``int32``, ``int64`` or ``string`` keys.
    shard_num:
        The number of shards, ``>= 1``.
    """
    keys = tf.convert_to_tensor(keys)
    if keys.dtype == tf.string:
        return tf.cast(tf.strings.to_hash_bucket_fast(keys, shard_num), tf.int32)
    return tf.cast(tf.math.floormod(keys, tf.cast(shard_num, keys.dtype)), tf.int32)


def split_by_shard(
    keys: tf.Tensor, shard_ids: tf.Tensor, shard_num: int
) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """Split ``keys`` into ``shard_num`` groups of ``(shard_keys, positions_in_keys)``."""
    positions = tf.range(tf.size(keys, out_type=tf.int32))
    shard_keys = tf.dynamic_partition(keys, shard_ids, shard_num)
    shard_positions = tf.dynamic_partition(positions, shard_ids, shard_num)
    return list(zip(shard_keys, shard_positions, strict=True))


def stitch_shards(positions: Sequence[tf.Tensor], parts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Put per-shard results back into the original key order (inverse of the split)."""
    return tf.dynamic_stitch(list(positions), list(parts))
