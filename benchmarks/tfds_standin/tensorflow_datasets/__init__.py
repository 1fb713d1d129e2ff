"""A stand-in for ``tensorflow_datasets`` holding two datasets that TFRA's Keras demos load,
with their fields, dtypes and shapes but generated rows (this machine cannot download).

``benchmarks/tfra_programs.py`` puts this folder first on ``PYTHONPATH`` of each demo
process, so ``import tensorflow_datasets as tfds`` in a demo finds it. The rows come from a
fixed seed, so every run, of either library, trains on the same examples, and a rating or
a label depends on the ids (a model can learn it).

- ``movielens/1m-ratings``: ``user_id`` and ``movie_id`` (decimal strings),
  ``user_rating`` (float32, 1 to 5); 6,040 users, 3,706 movies.
- ``amazon_us_reviews/Digital_Video_Games_v1_00``: ``{"data": {...}}`` with the review
  fields the video-games demo encodes (strings, int32 counts) and ``verified_purchase``
  (int64, 0 or 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

ROWS = {"movielens/1m-ratings": 200_000, "amazon_us_reviews/Digital_Video_Games_v1_00": 60_000}
WORDS = np.array(
    [
        "game",
        "play",
        "fun",
        "story",
        "boss",
        "level",
        "great",
        "bad",
        "graphics",
        "controls",
        "music",
        "online",
        "buy",
        "worth",
    ]
)


def load(name: str, split: str = "train", **kwargs: Any) -> tf.data.Dataset:
    """The dataset ``name`` (its ``train`` split; ``as_supervised`` and other options of
    tensorflow_datasets are accepted and change nothing)."""
    if split != "train" or name not in ROWS:
        raise ValueError(
            f"the stand-in holds the train split of {sorted(ROWS)}, not {name}:{split}"
        )
    rng = np.random.default_rng(2024)
    if name.startswith("movielens"):
        return tf.data.Dataset.from_tensor_slices(movielens(rng, ROWS[name]))
    return tf.data.Dataset.from_tensor_slices({"data": video_game_reviews(rng, ROWS[name])})


def movielens(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    users = rng.integers(1, 6041, n)
    movies = rng.integers(1, 3707, n)
    taste = (users * 7 + movies * 13) % 5  # a rating the ids decide, plus noise
    noise = rng.integers(-1, 2, n) * (rng.random(n) < 0.3)
    rating = np.clip(taste + 1 + noise, 1, 5).astype(np.float32)
    return {
        "user_id": users.astype(str).astype(object),
        "movie_id": movies.astype(str).astype(object),
        "user_rating": rating,
    }


def video_game_reviews(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    customers = rng.integers(0, 20_000, n)
    products = rng.integers(0, 3_000, n)
    stars = rng.integers(1, 6, n).astype(np.int32)
    label = ((customers % 3 == 0) | (stars >= 4)).astype(np.int64)

    def ids(prefix: str, values: np.ndarray) -> np.ndarray:
        return np.char.add(prefix, values.astype(str)).astype(object)

    def text(count: int) -> np.ndarray:
        words = WORDS[rng.integers(0, len(WORDS), (n, count))]
        return np.array([" ".join(row) for row in words], dtype=object)

    votes = rng.integers(0, 50, n).astype(np.int32)
    return {
        "customer_id": ids("c", customers),
        "helpful_votes": votes,
        "marketplace": np.full(n, "US", dtype=object),
        "product_category": np.full(n, "Digital_Video_Games", dtype=object),
        "product_id": ids("p", products),
        "product_parent": ids("pp", products // 3),
        "product_title": text(4),
        "review_body": text(8),
        "review_date": np.full(n, "2015-08-31", dtype=object),
        "review_headline": text(3),
        "review_id": ids("r", np.arange(n)),
        "star_rating": stars,
        "total_votes": votes + rng.integers(0, 5, n).astype(np.int32),
        "verified_purchase": label,
    }
