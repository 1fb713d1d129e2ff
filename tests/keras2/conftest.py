"""Tests of de_store under Keras 2 (``tf_keras``): they run in their own pytest process,
with ``TF_USE_LEGACY_KERAS=1`` set before TensorFlow first uses ``tf.keras``::

    TF_USE_LEGACY_KERAS=1 python -m pytest tests/keras2 -q

A run where ``tf.keras`` is Keras 3 stops here, before any test: the tests would exercise
Keras 3 layers under Keras 2's name. The main run (without the variable) does not collect
this folder (``collect_ignore`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import os

import pytest

from de_store._keras import is_keras_2, keras

if not is_keras_2():
    pytest.exit(
        "tests/keras2 need Keras 2: expected tf.keras to be tf_keras "
        "(TF_USE_LEGACY_KERAS=1 before TensorFlow first uses tf.keras), found "
        f"{keras.__name__} with TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS')!r}",
        returncode=4,
    )
