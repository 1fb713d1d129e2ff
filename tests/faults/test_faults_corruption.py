"""Flipped bytes, truncation and deletion of every kind of checkpoint file, in every shard
format: restore fails with an error naming the file, and the table is left unchanged."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults_helpers import content, make_variable

from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.topology import Topology
from de_store.errors import DeStoreError
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.restore_flow import restore_checkpoint
from de_store.saver.rows import ShardRows, VariableRows
from de_store.testing import StorageLocation

SINGLE = Topology(1, 0)
HANG_S = 30.0
RESULTS: list[dict[str, Any]] = []


def rows() -> VariableRows:
    keys = np.arange(-500, 2500, dtype=np.int64)
    values = (keys[:, None] * np.arange(1, 5)).astype(np.float32)
    shards = [ShardRows(keys[i::2], {"value": values[i::2]}) for i in range(2)]
    return VariableRows("emb", "int64", "float32", 4, {"value": ColumnSpec("float32", 4)}, shards)


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x5A]) + data[middle + 1 :])
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        os.unlink(path)


def files_to_corrupt(folder: Path) -> dict[str, list[Path]]:
    manifest = json.loads((folder / "manifest-000001.json").read_text())
    shard = manifest["variables"]["emb"]["shards"][0]["info"]
    return {
        "shard": [folder / f["path"] for f in shard["files"]],
        "manifest": [folder / "manifest-000001.json"],
        "commit marker": [folder / "COMMIT-000001"],
    }


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "binary"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_corruption_is_detected_naming_the_file(
    local_location: StorageLocation, fmt: str, how: str
) -> None:
    backend = local_location.open()
    options = IOOptions(format=fmt, buffer_size=400)
    cases = [("shard", 0), ("shard", 1), ("manifest", 0), ("commit marker", 0)]
    for case, (kind, index) in enumerate(cases):
        name = f"ckpt-{case}"
        save_checkpoint([rows()], backend, name, SINGLE, options)
        targets = files_to_corrupt(Path(local_location.url) / name)[kind]
        if index >= len(targets):
            continue  # one file per shard: parquet and arrow
        target = targets[index]
        corrupt(target, how)
        var = make_variable()
        var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
        before = content(var)
        with pytest.raises(DeStoreError) as info:
            restore_within(
                HANG_S, functools.partial(restore_checkpoint, [var], backend, name, SINGLE, options)
            )
        named = "COMMIT-" if kind == "commit marker" and how == "delete" else target.name
        assert named in str(info.value), (kind, str(info.value))
        assert content(var) == before
        RESULTS.append({"format": fmt, "how": how, "kind": kind, "detected": True})


def restore_within(seconds: float, restore: Callable[[], Any]) -> None:
    """Run ``restore`` in a thread; raise its error, or fail if it hangs (a reader thread
    waiting for a turn that never comes, as a binary pair's did before ``read_together``)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            restore()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"restore of a corrupt shard still running after {seconds} s: a hang")
    if errors:
        raise errors[0]
