"""The Keras de_store builds on: the one TensorFlow routes ``tf.keras`` to.

TensorFlow decides which Keras ``tf.keras`` is when it is first used: ``tf_keras`` (Keras 2)
when the environment variable ``TF_USE_LEGACY_KERAS`` is ``1``, ``true`` or ``True`` at
that moment, else Keras 3. de_store's layers and optimizers take their base classes from
``tf.keras`` too, so a TFRA program that runs Keras 2 gets de_store layers and optimizers of
Keras 2, a Keras 3 program sees no change, and de_store never imports the other Keras.
"""

from __future__ import annotations

import importlib
from typing import Any

import tensorflow as tf

#: The package ``tf.keras`` routes to: ``keras`` (3) or ``tf_keras`` (2), as TensorFlow
#: chose. The package, not ``tf.keras`` itself: under Keras 3, ``tf.keras`` is
#: ``keras._tf_keras.keras``, which lacks ``keras.saving``. Found from a class's module:
#: once a program has run ``from tensorflow.keras.x import y``, ``tf.keras`` is a module
#: named ``tensorflow.keras``, whichever Keras it holds.
keras: Any = importlib.import_module(tf.keras.layers.Layer.__module__.partition(".")[0])


def is_keras_2() -> bool:
    """Whether ``tf.keras`` is Keras 2 (``tf_keras``, with ``TF_USE_LEGACY_KERAS``)."""
    return str(keras.__name__) == "tf_keras"
