"""One rank of a multi-process save or restore, run as a real process by the tests.

    python mp_worker.py save URL PROC_SIZE RANK KEYS_PER_RANK SHARDS OPTIONS_JSON
    python mp_worker.py tfsave PREFIX SAVE_PATH PROC_SIZE RANK KEYS_PER_RANK OPTIONS_JSON
    python mp_worker.py restore URL PROC_SIZE RANK SHARDS OPTIONS_JSON OUT_NPZ
    python mp_worker.py incsave URL_FULL URL_DELTA PROC_SIZE RANK KEYS_PER_RANK OPTIONS_JSON

Rank r saves the keys ``r, r + P, r + 2P, ...`` (shifted to include negatives) with rows
``expected_rows(keys)``, so any restore can be checked without moving arrays around.
``incsave`` saves a full checkpoint (a third of the rows still zeros) and then a delta on
it that sets those rows, removes a fifth of the keys and adds new ones: its restore holds
``incremental_keys`` with ``expected_rows``.
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


def incremental_keys(proc_size: int, rank: int, count: int) -> tuple[np.ndarray, ...]:
    """``(first, removed, added)``: rank ``rank``'s keys of the full save, those the delta
    removes, those it adds."""
    first = rank_keys(proc_size, rank, count)
    added = rank_keys(proc_size, rank, count // 4) + count * proc_size + OFFSET * proc_size
    return first, first[1::5], added


def incremental_save(url_full: str, url_delta: str, size: int, rank: int, count: int,
                     options: dict) -> None:  # fmt: skip
    import de_store as ds

    var = make_variable(2, None)
    first, removed, added = incremental_keys(size, rank, count)
    rows = expected_rows(first)
    rows[::3] = 0  # set by the delta
    var.upsert(first, rows)
    kwargs = dict(proc_size=size, proc_rank=rank, storage_options=options,
                  barrier_timeout_s=120, blocking=True, incremental=True)  # fmt: skip
    ds.save([var], url_full, **kwargs)
    var.upsert(first[::3], expected_rows(first[::3]))
    var.remove(removed)
    var.upsert(added, expected_rows(added))
    ds.save([var], url_delta, **kwargs)


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
    elif mode == "incsave":
        url_full, url_delta, size, rank, count, options = argv[1:7]
        incremental_save(url_full, url_delta, int(size), int(rank), int(count),
                         json.loads(options))  # fmt: skip
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
