"""Shared helpers of the fault tests: worker processes, expected content, restores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from fault_worker import expected, shard_keys

import de_store as ds

WORKER = str(Path(__file__).with_name("fault_worker.py"))


def start_worker(config: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, json.dumps(config)], stderr=subprocess.PIPE, text=True
    )


def run_worker(config: dict[str, Any], *, killed: bool = False, timeout: float = 60) -> str:
    """Run one worker; return its stderr. ``killed``: it must die of SIGKILL."""
    proc = start_worker(config)
    _, err = proc.communicate(timeout=timeout)
    if killed:
        assert proc.returncode == -signal.SIGKILL, f"not killed ({proc.returncode}): {err[-3000:]}"
    else:
        assert proc.returncode == 0, f"worker exited {proc.returncode}: {err[-3000:]}"
    return err


def expected_content(version: int, proc_size: int = 1) -> dict[int, tuple[float, ...]]:
    """What the worker saved as checkpoint ``version`` (1: first, 2: second), ``value``."""
    keys = np.concatenate([shard_keys(proc_size, r, s) for r in range(proc_size) for s in range(2)])
    value, _ = expected(keys, version)
    return {int(k): tuple(v) for k, v in zip(keys.tolist(), value.tolist(), strict=True)}


def make_variable(dim: int = 4) -> ds.Variable:
    return ds.Variable("emb", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim)


def content(var: Any) -> dict[int, tuple[float, ...]]:
    keys, values = var.export()
    return {
        int(k): tuple(v)
        for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)
    }


def restored(url: str, options: dict[str, Any] | None = None) -> dict[int, tuple[float, ...]]:
    """Restore the worker's variable from ``url``; check its ``accum`` column; its content."""
    var = make_variable()
    ds.restore([var], url, storage_options=options or {})
    got = content(var)
    accum = content(var.companions()["accum"])
    assert accum == {k: tuple(-x for x in v) for k, v in got.items()}
    return got
