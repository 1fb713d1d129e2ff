"""Keras 3 layer over a dynamic embedding Variable (TensorFlow backend).

Train it with a de_store optimizer (``de_store.optimizers.Adam`` ...), in ``model.fit`` or a
custom ``tf.GradientTape`` loop: the layer exposes the batch rows of its lookups as a
trainable weight and the optimizer writes their update back to the tables.

Importing this module also lets ``tf.train.Checkpoint`` save Keras models asynchronously
more than once (see :func:`_copy_keras_variable_to_cpu`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.core import Variable as _KerasVariable

from de_store.embedding import embedding_lookup, trainable_wrapper
from de_store.partition import Partitioner, default_partition_fn
from de_store.variable import HashTableCreator, get_variable


class Embedding(keras.layers.Layer):
    """Map ids of any shape to ``ids.shape + [embedding_size]`` rows of a dynamic table.

    Parameters
    ----------
    embedding_size:
        The row width (the Variable's ``dim``).
    key_dtype, value_dtype, initializer, devices, partitioner, init_size, kv_creator,
    restrict_policy, bp_v2:
        Passed to :func:`de_store.get_variable`; the Variable is named after the layer.
    """

    def __init__(
        self,
        embedding_size: int,
        key_dtype: Any = tf.int64,
        value_dtype: Any = tf.float32,
        initializer: Any = None,
        devices: str | Sequence[str] | None = None,
        partitioner: Partitioner = default_partition_fn,
        init_size: int = 0,
        kv_creator: HashTableCreator | None = None,
        restrict_policy: Any = None,
        bp_v2: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.supports_jit = False  # hash table ops do not compile with XLA
        self.embedding_size = embedding_size
        self.params = get_variable(
            self.name,
            key_dtype=key_dtype,
            value_dtype=value_dtype,
            dim=embedding_size,
            devices=devices,
            partitioner=partitioner,
            initializer=initializer,
            trainable=self.trainable,
            init_size=init_size,
            kv_creator=kv_creator,
            restrict_policy=restrict_policy,
            bp_v2=bp_v2,
        )
        self._wrapper = trainable_wrapper(self.params, self.name)
        rows = self._wrapper.rows
        rows.regularizer = None  # Keras reads it on every weight  # type: ignore[attr-defined]
        # A call writes the batch's rows, ids and flags: tracked here, a SavedModel of a
        # model that calls the layer keeps them (it refuses functions using untracked ones)
        self._batch = [rows, self._wrapper.ids, self._wrapper.existed]

    def call(self, ids: Any) -> tf.Tensor:
        return embedding_lookup(self.params, ids, name=self.name)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return (*tuple(input_shape), self.embedding_size)

    @property
    def weights(self) -> list[Any]:
        return [*super().weights, self._wrapper.rows]

    @property
    def variables(self) -> list[Any]:
        return [*super().variables, self._wrapper.rows]


def _copy_keras_variable_to_cpu(self: Any, object_map: dict[Any, Any]) -> None:
    """Map a Keras variable to the host copy TensorFlow made of the variable it wraps.

    ``CheckpointOptions(enable_async=True)`` copies every variable at each save, from the
    second save on inside a ``tf.function``. The method of Keras' TensorFlow-backend
    ``Variable`` creates a new ``tf.Variable`` at every call, which a ``tf.function``
    refuses ("only supports singleton tf.Variables"), so the second async save of any Keras
    model would fail. The copy of the wrapped variable holds the same value and serialises
    the same tensors.
    """
    self.value._copy_trackable_to_cpu(object_map)
    object_map[self] = object_map[self.value]


_KerasVariable._copy_trackable_to_cpu = _copy_keras_variable_to_cpu  # type: ignore[method-assign]
