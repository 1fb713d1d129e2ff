"""One rank of a multi-process save or restore, run as a real process by the tests.

    python mp_worker.py save URL PROC_SIZE RANK KEYS_PER_RANK SHARDS OPTIONS_JSON
    python mp_worker.py tfsave PREFIX SAVE_PATH PROC_SIZE RANK KEYS_PER_RANK OPTIONS_JSON
    python mp_worker.py restore URL PROC_SIZE RANK SHARDS OPTIONS_JSON OUT_NPZ

Rank r saves the keys ``r, r + P, r + 2P, ...`` (shifted to include negatives) with rows
``expected_rows(keys)``, so any restore can be checked without moving arrays around.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

DIM = 4
OFFSET = 1000


def expected_rows(keys: np.ndarray) -> np.ndarray:
    return (keys[:, None].astype(np.float32) * np.arange(1, DIM + 1, dtype=np.float32)) / 7


def rank_keys(proc_size: int, rank: int, count: int) -> np.ndarray:
    return np.arange(rank, count * proc_size, proc_size, dtype=np.int64) - OFFSET * proc_size


def make_variable(shards: int, saver: object | None) -> object:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    import de_store as ds

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:shards]
    return ds.Variable("emb", dim=DIM, devices=devices, kv_creator=ds.HashTableCreator(saver))


def main(argv: list[str]) -> None:
    import de_store as ds

    mode = argv[0]
    if mode == "save":
        url, size, rank, count, shards, options = argv[1:7]
        var = make_variable(int(shards), None)
        keys = rank_keys(int(size), int(rank), int(count))
        var.upsert(keys, expected_rows(keys))
        ds.save(
            [var], url, proc_size=int(size), proc_rank=int(rank),
            storage_options=json.loads(options), barrier_timeout_s=120, blocking=True,
        )  # fmt: skip
    elif mode == "tfsave":
        prefix, save_path, size, rank, count, options = argv[1:7]
        saver = ds.FileSystemSaver(
            proc_size=int(size), proc_rank=int(rank), save_path=save_path,
            storage_options=json.loads(options), barrier_timeout_s=120,
        )  # fmt: skip
        var = make_variable(2, saver)
        keys = rank_keys(int(size), int(rank), int(count))
        var.upsert(keys, expected_rows(keys))
        tf.train.Checkpoint(emb=var).write(prefix)
    elif mode == "restore":
        url, size, rank, shards, options, out = argv[1:7]
        var = make_variable(int(shards), None)
        ds.restore(
            [var], url, proc_size=int(size), proc_rank=int(rank),
            storage_options=json.loads(options),
        )  # fmt: skip
        keys, values = var.export()
        np.savez(out, keys=keys.numpy(), values=values.numpy())
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
