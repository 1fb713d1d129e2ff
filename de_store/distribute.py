"""Dynamic embeddings split over the workers of a ``MultiWorkerMirroredStrategy``.

:class:`AllToAllEmbedding` holds this worker's slice of a table: worker ``r`` of ``n``
owns the keys ``k`` with ``k mod n == r``, in a local :class:`~de_store.Variable`. No
worker holds the whole table. A lookup sends each id to its owner and gets its row back,
and an update sends each gradient row to the owner of its id, which applies it: two
collective all-to-all exchanges (``CollectiveAllToAllV2``, which has CPU and GPU kernels)
each way. Every worker must run the same lookups and updates in the same order (one
traced step on every worker), as collectives require.

Each worker saves its own slice: :func:`de_store.save` or ``tf.train.Checkpoint`` with
the saver's multi-process path (a ``TF_CONFIG`` cluster is detected, and a
:class:`~de_store.checkpoint.barrier.CoordinationServiceBarrier` meets the workers through
TensorFlow's coordination service). A checkpoint restores into any number of workers:
rank ``r`` of ``n`` restores the keys ``k mod n == r`` (the restore's default partition),
the keys it owns.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import collective_ops, resource_variable_ops

from de_store.variable import Variable

#: Collective group keys of de_store's exchanges, away from the small keys that
#: ``tf.distribute`` strategies hand out.
GROUP_KEY_BASE = 0x5D5700


class AllToAllEmbedding:
    """This worker's slice of a table split over ``num_workers`` workers.

    Parameters
    ----------
    variable
        The local :class:`~de_store.Variable` holding the keys this worker owns.
    num_workers, rank
        The workers of the group and this one's place in it (``TF_CONFIG``'s task order:
        the chief first, then the workers).
    group
        Tells apart the groups of several embeddings (a collective group key).
    """

    def __init__(self, variable: Variable, num_workers: int, rank: int, group: int = 0) -> None:
        if not 0 <= rank < num_workers:
            raise ValueError(
                f"AllToAllEmbedding {variable.name!r}: rank must be in [0, {num_workers}), "
                f"got {rank}"
            )
        self.variable = variable
        self.num_workers, self.rank = num_workers, rank
        self._group_key = GROUP_KEY_BASE + group
        # Collective instance keys, one per exchange: an all-to-all instance keeps the
        # shape of its first run, and each batch pads to a width of its own. Every worker
        # runs the same exchanges in the same order, so their counters agree.
        with tf.init_scope():
            self._exchanges = resource_variable_ops.ResourceVariable(
                0, dtype=tf.int32, trainable=False, name=f"{variable.name}/exchanges"
            )

    def owner(self, ids: tf.Tensor) -> tf.Tensor:
        """The rank that owns each id."""
        return tf.cast(tf.math.floormod(ids, self.num_workers), tf.int32)

    def lookup(self, ids: Any) -> tf.Tensor:
        """The rows of ``ids`` (shape ``ids.shape + [dim]``), each from its owner."""
        ids = tf.convert_to_tensor(ids, self.variable.key_dtype)
        flat = tf.reshape(ids, [-1])
        plan = self._plan(flat)
        asked = self._exchange(plan.send(flat, -1))
        received = tf.boolean_mask(asked, plan.received_mask)
        rows = self.variable.lookup(received)
        replies = plan.scatter_received(rows, self.variable.dim)
        back = self._exchange(replies)
        found = plan.gather_back(back)
        return tf.reshape(found, tf.concat([tf.shape(ids), [self.variable.dim]], 0))

    def apply_gradients(self, optimizer: Any, ids: Any, grads: Any) -> None:
        """Send the gradient rows of ``ids`` to their owners, which apply them with
        ``optimizer.apply_row_gradients`` (SGD, Adagrad, Adam)."""
        ids = tf.convert_to_tensor(ids, self.variable.key_dtype)
        flat = tf.reshape(ids, [-1])
        grads = tf.reshape(tf.convert_to_tensor(grads), [-1, self.variable.dim])
        plan = self._plan(flat)
        received_ids = tf.boolean_mask(self._exchange(plan.send(flat, -1)), plan.received_mask)
        sent_grads = plan.send(grads, 0)
        received = tf.boolean_mask(self._exchange(sent_grads), plan.received_mask)
        optimizer.apply_row_gradients([(received, received_ids, self.variable)])

    # -- the exchange ----------------------------------------------------------------
    def _plan(self, flat: tf.Tensor) -> _Plan:
        owners = self.owner(flat)
        counts = tf.math.bincount(owners, minlength=self.num_workers, maxlength=self.num_workers)
        width = self._max(tf.reduce_max(counts))
        received_counts = tf.reshape(self._exchange(tf.reshape(counts, [-1, 1])), [-1])
        return _Plan(owners, counts, width, received_counts, self.num_workers)

    def _max(self, value: tf.Tensor) -> tf.Tensor:
        return collective_ops.all_reduce_v2(
            tf.cast(value, tf.float32), self.num_workers, self._group_key,
            self._instance_key(), merge_op="Max", final_op="Id",
        )  # fmt: skip

    def _exchange(self, tensor: tf.Tensor) -> tf.Tensor:
        """``tensor[i]`` goes to rank ``i``; ``result[i]`` came from rank ``i``."""
        return collective_ops.all_to_all_v2(
            tensor, self.num_workers, self._group_key, self._instance_key()
        )

    def _instance_key(self) -> tf.Tensor:
        return tf.math.floormod(self._exchanges.assign_add(1), 1 << 30) + 1


class _Plan:
    """Where a batch's ids go: sorted by owner, padded to the widest send of the group."""

    def __init__(self, owners, counts, width, received_counts, group):  # type: ignore[no-untyped-def]
        self.order = tf.argsort(owners, stable=True)
        self.counts, self.group = counts, group
        self.width = tf.cast(width, tf.int32)
        starts = tf.cumsum(counts, exclusive=True)
        sorted_owners = tf.gather(owners, self.order)
        slot = tf.range(tf.size(owners)) - tf.gather(starts, sorted_owners)
        self.at = tf.stack([sorted_owners, slot], 1)  # [n, 2] place of each sorted id
        self.received_mask = tf.sequence_mask(received_counts, self.width)

    def send(self, values: tf.Tensor, fill: Any) -> tf.Tensor:
        """``values`` (one per id) laid out ``[group, width, ...]`` by owner."""
        shape = tf.concat([[self.group, self.width], tf.shape(values)[1:]], 0)
        padded = tf.fill(shape, tf.cast(fill, values.dtype))
        return tf.tensor_scatter_nd_update(padded, self.at, tf.gather(values, self.order))

    def scatter_received(self, rows: tf.Tensor, dim: int) -> tf.Tensor:
        """The rows of the received ids, back in the ``[group, width, dim]`` layout."""
        where = tf.cast(tf.where(self.received_mask), tf.int32)
        return tf.scatter_nd(where, rows, tf.stack([self.group, self.width, dim]))

    def gather_back(self, back: tf.Tensor) -> tf.Tensor:
        """The reply rows, in the batch's own order."""
        rows = tf.gather_nd(back, self.at)
        return tf.scatter_nd(self.order[:, None], rows, tf.shape(rows, out_type=tf.int32))
