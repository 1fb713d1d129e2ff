"""Keras 3 layers over dynamic embedding Variables (TensorFlow backend), as TFRA's
``dynamic_embedding.keras``: ``de_store.keras.layers.Embedding``, ``SquashedEmbedding``,
``FieldWiseEmbedding`` (``de_store.keras.Embedding`` is the first).

Train them with a de_store optimizer (``de_store.DynamicEmbeddingOptimizer(...)``), in
``model.fit`` or a custom ``tf.GradientTape`` loop: a layer exposes the batch rows of its
lookups as a trainable weight and the optimizer writes their update back to the tables.

Importing this module also lets ``tf.train.Checkpoint`` save Keras models asynchronously
more than once (see :func:`_copy_keras_variable_to_cpu`).
"""

from __future__ import annotations

from typing import Any

from keras.src.backend.tensorflow.core import Variable as _KerasVariable

from de_store.keras import layers
from de_store.keras.layers import Embedding, FieldWiseEmbedding, SquashedEmbedding

__all__ = ["Embedding", "FieldWiseEmbedding", "SquashedEmbedding", "layers"]


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
