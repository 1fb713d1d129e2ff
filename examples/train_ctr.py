"""A click-through-rate model on a dynamic embedding: logistic regression over sparse ids.

Synthetic data: every example has ``fields`` categorical ids drawn from a head-heavy
(power-law) distribution over ``id_space`` ids, so the run sees over a million distinct
ids; the click label is drawn from a hidden per-id weight. The model learns one weight per
id (a ``de_store`` Variable with ``dim=1``) plus a dense bias, with the sparse Adagrad.

Run ``python examples/train_ctr.py --steps 200``; it prints the loss every ``--log-every``
steps, then one JSON line with the first and last loss, the distinct ids seen and the
keys/s of lookup+update. ``train`` is importable for demos.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import de_store as ds
from de_store.optimizers import Adagrad


@dataclass(frozen=True)
class CtrConfig:
    """Sizes of the synthetic problem and the training run."""

    steps: int = 200
    batch_size: int = 8192
    fields: int = 8
    id_space: int = 4_000_000
    learning_rate: float = 0.5
    log_every: int = 25
    seed: int = 0


def synthetic_batch(rng: np.random.Generator, config: CtrConfig) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(ids [batch, fields] int64, clicks [batch] float32)``."""
    ids = (config.id_space * rng.random((config.batch_size, config.fields)) ** 6).astype(np.int64)
    logits = true_weights(ids).sum(axis=1) - 0.5
    clicks = (rng.random(config.batch_size) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return ids, clicks


def true_weights(ids: np.ndarray) -> np.ndarray:
    """The hidden weight of each id, in ``[-1, 1]``."""
    return np.sin(ids * 0.6180339887 + 1.3)


def build(name: str = "ctr_weights") -> tuple[ds.Variable, tf.Variable, Adagrad]:
    """The model: a weight per id, a dense bias, and the optimizer."""
    weights = ds.get_variable(name, dim=1, initializer=0.0)
    bias = tf.Variable(0.0, name="bias")
    return weights, bias, Adagrad(learning_rate=CtrConfig.learning_rate)


def train(config: CtrConfig = CtrConfig(), verbose: bool = True) -> dict[str, float]:
    """Train for ``config.steps`` steps; return losses, distinct ids and keys/s."""
    weights, bias, optimizer = build()
    optimizer.learning_rate = config.learning_rate

    @tf.function(reduce_retracing=True)
    def step(ids: tf.Tensor, clicks: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = tf.reduce_sum(ds.embedding_lookup(weights, ids), axis=[1, 2]) + bias
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(clicks, logits))
        variables = [*weights.trainable_variables, bias]
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
        return loss

    rng = np.random.default_rng(config.seed)
    losses, seconds = [], 0.0
    for index in range(config.steps):
        ids, clicks = synthetic_batch(rng, config)
        start = time.perf_counter()
        losses.append(float(step(tf.constant(ids), tf.constant(clicks))))
        seconds += time.perf_counter() - start if index > 0 else 0.0  # skip tracing
        if verbose and (index % config.log_every == 0 or index == config.steps - 1):
            print(f"step {index:5d}  loss {losses[-1]:.4f}  ids {int(weights.size())}")
    window = max(1, min(10, config.steps // 4))
    keys_per_step = config.batch_size * config.fields
    return {
        "first_loss": float(np.mean(losses[:window])),
        "last_loss": float(np.mean(losses[-window:])),
        "distinct_ids": int(weights.size()),
        "keys_per_s": keys_per_step * (config.steps - 1) / seconds if seconds else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = CtrConfig()
    for field in ("steps", "batch_size", "fields", "id_space", "log_every", "seed"):
        parser.add_argument(
            f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field)
        )
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    args = parser.parse_args()
    result = train(CtrConfig(**vars(args)))
    print(json.dumps({"example": "train_ctr", **result}))


if __name__ == "__main__":
    main()
