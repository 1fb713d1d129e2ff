"""Keras layers over dynamic embedding Variables, as TFRA's ``dynamic_embedding.keras``:
``de_store.keras.layers.Embedding``, ``SquashedEmbedding``, ``FieldWiseEmbedding``
(``de_store.keras.Embedding`` is the first). They are layers of the Keras ``tf.keras`` is
(:mod:`de_store._keras`): Keras 3 (TensorFlow backend), or Keras 2 (``tf_keras``) when
``TF_USE_LEGACY_KERAS`` is set, as TFRA's programs run.

Train them with a de_store optimizer (``de_store.DynamicEmbeddingOptimizer(...)``), in
``model.fit`` or a custom ``tf.GradientTape`` loop: a layer exposes the batch rows of its
lookups as a trainable weight and the optimizer writes their update back to the tables.

Under Keras 3, importing this module also lets ``tf.train.Checkpoint`` save Keras models
asynchronously more than once (see :func:`_copy_keras_variable_to_cpu`); Keras 2's
variables are ``tf.Variable`` s, which TensorFlow copies itself.
"""

from __future__ import annotations

from typing import Any

from de_store._keras import is_keras_2, keras
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


if not is_keras_2():
    keras.Variable._copy_trackable_to_cpu = _copy_keras_variable_to_cpu
