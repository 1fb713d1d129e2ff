"""A training step in a ``tf.function``: its first call and its later calls, de_store's
embedding against a dense ``tf.Variable``.

Usage: ``python benchmarks/step_bench.py --ids 4096 --dim 16 --steps 400 --rounds 3``

Each side runs in a fresh process (the sides in turn, ``--rounds`` times): a step looks up
``--ids`` ids drawn from 100,000, sums the squares of the rows and applies a Keras Adam
update to the rows it looked up. de_store's side looks them up in a ``de_store.Variable``
with ``embedding_lookup(..., return_trainable=True)`` and a ``DynamicEmbeddingOptimizer``;
the reference gathers them from a dense ``tf.Variable`` of 100,000 rows. ``first_s`` is
the first call (tracing, Grappler, instantiating the functions, XLA compiles, and the
step itself: on de_store's side the table grows from empty), ``step_ms`` the mean of
``--steps`` later calls over 50 batches of ids, after ten untimed ones. The kernel cache
is left as it is (``DE_STORE_CACHE_DIR``). The figures are each side's medians over the
rounds; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import _harness as harness
import numpy as np

ID_RANGE = 100_000


def _measure(side: str, ids: int, dim: int, steps: int) -> dict[str, float]:
    """One process's first call and mean later step (see the module docstring)."""
    import tensorflow as tf

    import de_store as ds

    optimizer = tf.keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    batches = [tf.constant(rng.integers(0, ID_RANGE, ids), tf.int64) for _ in range(50)]
    if side == "de_store":
        emb = ds.get_variable("step_bench", dim=dim, initializer=0.1)
        optimizer = ds.DynamicEmbeddingOptimizer(optimizer)

        def rows_and_variable(batch: tf.Tensor) -> tuple[tf.Tensor, Any]:
            return ds.embedding_lookup(emb, batch, return_trainable=True)
    else:
        table = tf.Variable(tf.fill([ID_RANGE, dim], 0.1))

        def rows_and_variable(batch: tf.Tensor) -> tuple[tf.Tensor, Any]:
            return tf.gather(table, batch), table

    @tf.function
    def step(batch: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            rows, variable = rows_and_variable(batch)
            loss = tf.reduce_sum(rows * rows)
        optimizer.apply_gradients([(tape.gradient(loss, variable), variable)])
        return loss

    start = time.perf_counter()
    step(batches[0]).numpy()
    first = time.perf_counter() - start
    for batch in batches[:10]:
        step(batch)
    start = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % len(batches)])
    loss.numpy()
    return {"first_s": first, "step_ms": (time.perf_counter() - start) / steps * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        harness.emit(_measure(args.side, args.ids, args.dim, args.steps))
        return
    options = ["--ids", str(args.ids), "--dim", str(args.dim), "--steps", str(args.steps)]
    rounds: dict[str, list[dict[str, float]]] = {"dense": [], "de_store": []}
    for index in range(args.rounds):
        for side, figures in rounds.items():
            got = harness.run_phase(__file__, "step", [*options, "--side", side])
            figures.append(got)
            print(f"round {index + 1} {side:9s} first {got['first_s']:.2f} s, "
                  f"step {got['step_ms']:.2f} ms", flush=True)  # fmt: skip
    result: dict[str, Any] = {"ids": args.ids, "dim": args.dim, "steps": args.steps,
                              "rounds": args.rounds, "id_range": ID_RANGE}  # fmt: skip
    for side, figures in rounds.items():
        for name in ("first_s", "step_ms"):
            result[f"{side}_{name}"] = statistics.median(f[name] for f in figures)
            result[f"{side}_{name}_all"] = [round(f[name], 4) for f in figures]
    print(f"{args.ids} ids x dim {args.dim}, median of {args.rounds} rounds")
    for name, label, unit in (("first_s", "first call", "s"), ("step_ms", "later step", "ms")):
        ratio = result[f"{name.split('_')[0]}_de_store_over_dense"] = round(
            result[f"de_store_{name}"] / result[f"dense_{name}"], 3
        )
        print(f"{label}: de_store {result[f'de_store_{name}']:.2f} {unit}, "
              f"dense {result[f'dense_{name}']:.2f} {unit} ({ratio:.2f}x)")  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
