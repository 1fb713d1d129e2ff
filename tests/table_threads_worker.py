"""Restores a Variable again and again while a thread upserts into it; prints what it held.

Run by ``test_table_threads.py`` in a process of its own: an abort (XLA's size check on a
table shrunk under a running kernel) then fails that test instead of killing pytest.
Usage: ``python table_threads_worker.py FOLDER RESTORES``. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import tensorflow as tf

import de_store as ds

SAVED, BATCH, FIRST_NEW = 50_000, 20_000, 1_000_000  # batches of 20K keys: compiled paths


def main(folder: str, restores: int) -> None:
    var = ds.Variable("restored_while_training", tf.int64, tf.float32, dim=2)
    var.upsert(np.arange(SAVED, dtype=np.int64), np.ones([SAVED, 2], np.float32))
    ds.save([var], f"{folder}/ckpt", blocking=True)
    stop, written, errors = threading.Event(), [0], []

    def train() -> None:
        try:
            while not stop.is_set():
                batch = written[0]
                keys = np.arange(BATCH, dtype=np.int64) + FIRST_NEW + batch * BATCH
                var.upsert(keys, np.full([BATCH, 2], batch, np.float32))
                written[0] = batch + 1
        except Exception as err:  # reported in the JSON line
            errors.append(repr(err))

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    for _ in range(restores):
        ds.restore([var], f"{folder}/ckpt")
    stop.set()
    trainer.join(120)
    keys, values = (t.numpy() for t in var.export())
    summary = _summary(keys, values, written[0])
    summary.update(alive=trainer.is_alive(), errors=errors, size=int(var.size()))
    print(json.dumps(summary))


def _summary(keys: np.ndarray, values: np.ndarray, written: int) -> dict:
    saved = keys < FIRST_NEW
    new_keys, new_values = keys[~saved], values[~saved]
    batches = (new_keys - FIRST_NEW) // BATCH
    return {
        "written": written,
        "exported": len(keys),
        "distinct": len(np.unique(keys)),
        "saved_keys": sorted(set(keys[saved].tolist())) == list(range(SAVED)),
        "saved_values": sorted(set(values[saved].ravel().tolist())),
        "batches": sorted(set(batches.tolist())),
        "batch_sizes": sorted(set(np.bincount(batches).tolist()) - {0}),
        "rows_hold_their_batch": bool(np.all(new_values == batches[:, None])),
    }


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
