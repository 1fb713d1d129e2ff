"""The ``de_store`` logger: INFO for each rank's shards written, each commit and each
restore (duration, bytes, rows); a WARNING naming its cause for each retry."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.backends import open_backend
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.retry import RetryPolicy
from de_store.checkpoint.topology import Topology
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.rows import ShardRows, VariableRows
from de_store.testing.faults import FaultPlan, FaultyFileSystem


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and r.name.startswith("de_store")
    ]


def test_save_commit_and_restore_log_info_with_duration_bytes_rows(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    variable = ds.Variable("emb", dim=4, devices=["/CPU:0", "/CPU:1"])
    variable.upsert(tf.range(1000, dtype=tf.int64), tf.ones([1000, 4]))
    url = str(tmp_path / "ckpt-1")
    with caplog.at_level(logging.INFO, logger="de_store"):
        ds.save([variable], url, blocking=True)
        ds.restore([variable], url)
    saved, committed, restored = messages(caplog, logging.INFO)
    size = sum(f.stat().st_size for f in Path(url, "emb").iterdir())
    bytes_ = f"{size:,} bytes" if size < 100_000 else f"{size / 1e6:.1f} MB"
    assert re.fullmatch(
        rf"saved rank 0 of 1 of {url}: 1,000 rows, {bytes_}, 1 variable\(s\) in \d+\.\d\d s",
        saved,
    ), saved
    assert re.fullmatch(
        rf"committed {url} \(full\): 1,000 rows, {bytes_} from 1 process\(es\) in \d+\.\d\d s",
        committed,
    ), committed
    assert re.fullmatch(
        rf"restored 1,000 rows into rank 0 of 1 from {url} \(1 checkpoint\(s\), {bytes_} of "
        r"shards\) in \d+\.\d\d s",
        restored,
    ), restored
    assert messages(caplog, logging.WARNING) == []


def rows(shards: int, count: int) -> VariableRows:
    """``shards`` table shards of ``count`` rows each."""
    out = []
    for shard in range(shards):
        keys = np.arange(count, dtype=np.int64) * shards + shard
        out.append(ShardRows(keys, {"value": np.ones((count, 2), np.float32)}))
    return VariableRows("emb", "int64", "float32", 2, {"value": ColumnSpec("float32", 2)}, out)


def test_each_retry_logs_a_warning_naming_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    plan = FaultPlan(fail={"write": 0.3}, seed=3)  # 8 shards: some writes fail
    memory = fsspec.filesystem("memory")
    backend = open_backend(FaultyFileSystem(memory, plan), root=f"/events-{uuid.uuid4().hex}")
    options = IOOptions(buffer_size=10, retry=RetryPolicy(attempts=20, initial_backoff_s=0.0))
    with caplog.at_level(logging.INFO, logger="de_store"):
        save_checkpoint([rows(8, 100)], backend, "A", Topology(1, 0), options)
    warnings = messages(caplog, logging.WARNING)
    assert plan.injected > 0 and len(warnings) == plan.injected
    for warning in warnings:
        assert re.fullmatch(
            r"storage step failed \(try \d+ of 20\), retrying in 0\.00 s: \w+: .*injected fault: "
            r"\w+ .*",
            warning,
        ), warning
    assert messages(caplog, logging.INFO)[-1].startswith("committed memory://")
