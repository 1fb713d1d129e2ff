"""A tf.Module whose serving function calls embedding_lookup exports with
tf.saved_model.save and serves in stock TensorFlow where de_store is not importable (TFRA's
SavedModels need its custom ops)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

import de_store as ds

SERVE = """
import json, sys
sys.modules["de_store"] = None  # importing de_store now fails
import tensorflow as tf
served = tf.saved_model.load(sys.argv[1])
out = served.signatures["serving_default"](ids=tf.constant([[3, 1], [9, 3]], tf.int64))
print(json.dumps({k: v.numpy().tolist() for k, v in out.items()}))
"""


class Ranker(tf.Module):
    def __init__(self, emb: ds.Variable) -> None:
        super().__init__()
        self.emb = emb
        self.weight = tf.Variable([[2.0], [1.0]])

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    def score(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        rows = ds.embedding_lookup(self.emb, ids, name="serving")
        return {"score": tf.squeeze(tf.reduce_sum(rows, 1) @ self.weight, -1)}


def test_a_module_calling_embedding_lookup_serves_without_de_store(tmp_path: Path) -> None:
    emb = ds.Variable("served_lookup", dim=2, initializer=0.5)
    emb.upsert([1, 3], [[1.0, 2.0], [3.0, 4.0]])
    model = Ranker(emb)
    expected = model.score(tf.constant([[3, 1], [9, 3]], tf.int64))["score"].numpy()
    tf.saved_model.save(
        model, str(tmp_path / "ranker"), signatures={"serving_default": model.score}
    )
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path / "ranker")], capture_output=True, text=True
    )
    assert served.returncode == 0, served.stderr[-3000:]
    got = json.loads(served.stdout.splitlines()[-1])["score"]
    np.testing.assert_array_equal(got, expected)
    # rows of [3, 1] sum to [4, 6]; of [9 (missing: 0.5), 3] to [3.5, 4.5]
    np.testing.assert_array_equal(expected, [4 * 2 + 6 * 1, 3.5 * 2 + 4.5 * 1])
