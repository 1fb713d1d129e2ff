"""Train and inference modes, with TFRA's names (``enable_inference_mode`` ...).

In inference mode :func:`de_store.embedding_lookup` reads the tables directly: it creates no
trainable wrapper, writes no batch rows into one, and inserts nothing. Serving code calls
:func:`enable_inference_mode` before it builds its graphs.
"""

from __future__ import annotations


class ModelMode:
    """The process-wide model mode: ``TRAIN`` (the default) or ``INFERENCE``."""

    TRAIN = "train"
    INFERENCE = "inference"
    CURRENT_SETTING = TRAIN


def enable_train_mode() -> None:
    """Lookups fill trainable wrappers for optimizers again (the default mode)."""
    ModelMode.CURRENT_SETTING = ModelMode.TRAIN


def enable_inference_mode() -> None:
    """Lookups only read the tables: no trainable state is written."""
    ModelMode.CURRENT_SETTING = ModelMode.INFERENCE


def get_model_mode() -> str:
    """The current mode, ``ModelMode.TRAIN`` or ``ModelMode.INFERENCE``."""
    return ModelMode.CURRENT_SETTING
