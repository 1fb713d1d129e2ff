"""Shared helpers of the saver tests: variables with a saver and known content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import de_store as ds

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]


def make_variable(
    name: str,
    saver: ds.FileSystemSaver | None,
    *,
    dim: int = 4,
    shards: int = 1,
    key_dtype: tf.DType = tf.int64,
    value_dtype: tf.DType = tf.float32,
    **kwargs: Any,
) -> ds.Variable:
    """A fresh (unregistered) Variable with ``shards`` table shards on logical CPUs."""
    return ds.Variable(
        name,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        dim=dim,
        devices=CPUS[:shards],
        kv_creator=ds.HashTableCreator(saver=saver),
        **kwargs,
    )


def fill(
    var: ds.Variable, n: int, seed: int = 0, start: int = -1000
) -> tuple[np.ndarray, np.ndarray]:
    """Upsert ``n`` keys (negatives included) with random rows and an ``adam_m`` companion."""
    rng = np.random.default_rng(seed)
    keys = np.arange(start, start + n, dtype=var.key_dtype.as_numpy_dtype)
    values = rng.standard_normal((n, var.dim)).astype(var.value_dtype.as_numpy_dtype)
    var.upsert(keys, values)
    var.companion("adam_m", var.dim, var.value_dtype).upsert(keys, values * 2)
    return keys, values


def content(var: ds.Variable) -> dict[Any, tuple[float, ...]]:
    """The variable's content as a dict key -> row, for exact comparisons."""
    keys, values = var.export()
    return {
        k: tuple(v) for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)
    }


def companion_content(var: ds.Variable, column: str) -> dict[Any, tuple[float, ...]]:
    return content(var.companions()[column])


def failing_async_checkpoint(tmp_path: Path) -> tf.train.Checkpoint:
    """A checkpoint whose KV root is a file (every save fails in the background), with one
    async save started."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the KV root should be")
    var = make_variable("emb", ds.FileSystemSaver(save_path=str(blocker / "kv")))
    fill(var, 10)
    ckpt = tf.train.Checkpoint(emb=var)
    ckpt.save(str(tmp_path / "ckpt"), options=tf.train.CheckpointOptions(enable_async=True))
    return ckpt
