"""Small checkpoints for the docs' snippets and the command-line tests.

>>> url = sample_checkpoint()            # a committed checkpoint in a new temporary folder
>>> url = sample_checkpoint(tmp, rows=10, format="arrow", slots=False)
"""

from __future__ import annotations

import tempfile

import numpy as np


def sample_checkpoint(
    directory: str | None = None,
    *,
    name: str = "user_emb",
    rows: int = 1000,
    dim: int = 8,
    format: str = "parquet",
    slots: bool = True,
    step: int = 1,
) -> str:
    """Save a Variable ``name`` with ``rows`` keys as ``{directory}/ckpt-{step}``; its URL.

    Keys are ``0 .. rows-1``, row ``k`` holds ``k / 1000`` in every column, and with
    ``slots`` an ``accumulator`` column (an optimizer slot) holds ``1.0``.
    """
    import tensorflow as tf

    import de_store as ds

    directory = directory or tempfile.mkdtemp(prefix="de_store_sample_")
    variable = ds.Variable(name, dim=dim)  # not registered: any number can coexist
    keys = np.arange(rows, dtype=np.int64)
    values = np.repeat((keys / 1000).astype(np.float32)[:, None], dim, axis=1)
    variable.upsert(tf.constant(keys), tf.constant(values))
    if slots:
        variable.companion("accumulator", dim, tf.float32).upsert(
            tf.constant(keys), tf.ones([rows, dim])
        )
    url = f"{directory.rstrip('/')}/ckpt-{step}"
    ds.save([variable], url, format=format, blocking=True)
    return url
