"""One process of a crash test: saves through a FaultyFileSystem, may be SIGKILLed in it.

    python fault_worker.py CONFIG_JSON

CONFIG keys: ``store`` ("local" or "s3"), ``root`` (path or bucket/prefix), ``options``
(s3fs storage options), ``first`` (checkpoint saved without faults first, or null),
``name`` (checkpoint saved under the plan), ``kill_at`` ([kind, k] or null), ``fail``
(kind -> share), ``seed``, ``format``, ``proc_size``, ``rank``, ``job_id``,
``barrier_timeout_s`` (of the save under the plan), ``hang`` (never arrive),
``trace_out`` (JSON file of the calls), ``version`` (of the content saved under
``name``, default 2).

TensorFlow is not imported: the rows are numpy arrays handed to ``save_checkpoint``
(int64 keys need no TF), which keeps each process start well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import types

# The saver modules import tensorflow for the paths this worker never takes (string keys,
# Variables); a stub makes any use of it fail loudly instead of costing seconds per process.
_stub = types.ModuleType("tensorflow")


def _no_tf(name: str) -> object:
    raise ImportError(f"tensorflow.{name} used in a worker that runs without TensorFlow")


_stub.__getattr__ = _no_tf  # type: ignore[method-assign]
sys.modules.setdefault("tensorflow", _stub)

import fsspec  # noqa: E402
import numpy as np  # noqa: E402

from de_store.backends import open_backend  # noqa: E402
from de_store.checkpoint.manifest import ColumnSpec  # noqa: E402
from de_store.checkpoint.retry import RetryPolicy  # noqa: E402
from de_store.checkpoint.topology import Topology  # noqa: E402
from de_store.saver.core import IOOptions, save_checkpoint  # noqa: E402
from de_store.saver.rows import ShardRows, VariableRows  # noqa: E402
from de_store.testing.faults import FaultPlan, FaultyFileSystem  # noqa: E402

DIM = 4
ROWS_PER_SHARD = 1500


def expected(keys: np.ndarray, version: int) -> tuple[np.ndarray, np.ndarray]:
    """The value and ``accum`` rows of ``keys`` in checkpoint ``version``."""
    value = keys[:, None].astype(np.float32) * np.arange(1, DIM + 1, dtype=np.float32) / 7
    value += np.float32(version)
    return value, -value


def shard_keys(proc_size: int, rank: int, shard: int) -> np.ndarray:
    base = np.arange(ROWS_PER_SHARD, dtype=np.int64) * 2 * proc_size + shard * proc_size + rank
    return base - 1000


def variable_rows(version: int, proc_size: int, rank: int) -> VariableRows:
    shards = []
    for shard in range(2):
        keys = shard_keys(proc_size, rank, shard)
        value, accum = expected(keys, version)
        shards.append(ShardRows(keys, {"value": value, "accum": accum}))
    columns = {"value": ColumnSpec("float32", DIM), "accum": ColumnSpec("float32", DIM)}
    return VariableRows("emb", "int64", "float32", DIM, columns, shards)


def inner_filesystem(config: dict) -> fsspec.AbstractFileSystem:
    if config["store"] == "local":
        return fsspec.filesystem("file")
    return fsspec.filesystem("s3", **config["options"])


def main(config: dict) -> None:
    plan = FaultPlan(
        fail=config.get("fail", {}),
        seed=config.get("seed", 0),
        kill_at=tuple(config["kill_at"]) if config.get("kill_at") else None,  # type: ignore[arg-type]
        active=False,
    )
    backend = open_backend(FaultyFileSystem(inner_filesystem(config), plan), root=config["root"])
    size, rank = config.get("proc_size", 1), config.get("rank", 0)
    topology = Topology(size, rank)
    options = IOOptions(
        format=config.get("format", "parquet"),
        buffer_size=500,
        barrier_timeout_s=config.get("barrier_timeout_s", 60.0),
        retry=RetryPolicy(attempts=config.get("attempts", 4)),
    )
    job_id = config.get("job_id")
    if config.get("first"):
        # The short barrier timeout is for the save under the plan: processes start a
        # second or more apart on a loaded machine, and the first save must not time out.
        first_options = dataclasses.replace(options, barrier_timeout_s=60.0)
        save_checkpoint([variable_rows(1, size, rank)], backend, config["first"], topology,
                        first_options, job_id=job_id)  # fmt: skip
    if config.get("hang"):
        time.sleep(3600)
    plan.active = True
    try:
        version = config.get("version", 2)
        save_checkpoint([variable_rows(version, size, rank)], backend, config["name"], topology,
                        options, job_id=job_id)  # fmt: skip
    finally:
        if config.get("trace_out"):
            with open(config["trace_out"], "w") as f:
                json.dump(plan.trace, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
