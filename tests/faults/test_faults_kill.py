"""kill -9 at deterministic points of a save: the previous checkpoint is never lost.

A worker process saves checkpoint A, then checkpoint B through a ``FaultyFileSystem`` that
SIGKILLs it at the k-th storage call. A dry run first records every call of B's save;
the points cover the staging lock, each shard's open, chunks in the middle of each
shard, its close, the rank manifest, the barrier, the manifest merge, the commit record
and the final rename / marker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from faults_helpers import expected_content, restored, run_worker

import de_store as ds
from de_store.backends import open_backend
from de_store.catalog import list_checkpoints
from de_store.checkpoint import gc
from de_store.checkpoint.commit import committed_folder
from de_store.testing import StorageLocation

#: Every storage call of B's save that is not a stream chunk, plus every CHUNK_STEP-th chunk.
CHUNK_STEP = 7
RESULTS: list[dict[str, Any]] = []


def kill_points(trace: list[list[str]]) -> list[int]:
    points, chunks = [], 0
    for k, (kind, _, _) in enumerate(trace, 1):
        if kind == "chunk":
            chunks += 1
            if chunks % CHUNK_STEP:
                continue
        points.append(k)
    return points


def location_config(location: StorageLocation, prefix: str) -> tuple[dict[str, Any], str]:
    """Worker config for a fresh root under ``location``, and that root's URL."""
    if location.name == "local":
        root = f"{location.url}/{prefix}"
        return {"store": "local", "root": root}, root
    root = location.url.removeprefix("s3://") + "/" + prefix
    return {"store": "s3", "root": root, "options": location.storage_options}, "s3://" + root


def check_after_kill(url: str, options: dict[str, Any]) -> dict[str, Any]:
    backend = open_backend(url, options)
    listing = {s.path: s.status for s in list_checkpoints(url, options)}
    committed = sorted(p for p, status in listing.items() if status == "committed")
    assert committed == ["A"], listing  # `de-store ls` too: B (or its staging) is not
    assert committed_folder(backend, "B") is None
    wrong = 0
    with pytest.raises(ds.errors.CheckpointNotFoundError):
        restored(f"{url}/B", options)
    lost = int(restored(f"{url}/A", options) != expected_content(1))
    removed = [g.folder for g in gc.collect(backend, grace_s=0)]
    left = sorted({p.split("/", 1)[0] for p in backend.list("")})
    assert left == ["A"], (left, removed)
    lost += int(restored(f"{url}/A", options) != expected_content(1))
    return {"lost": lost, "wrong": wrong, "garbage": removed}


@pytest.mark.parametrize("store", ["local", "s3"])
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(
    request: pytest.FixtureRequest, tmp_path: Path, store: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    config, url = location_config(location, "dry")
    trace_file = tmp_path / "trace.json"
    run_worker({**config, "first": "A", "name": "B", "trace_out": str(trace_file)})
    trace = json.loads(trace_file.read_text())
    points = kill_points(trace)
    assert len(points) >= 8  # every storage call of the save but most chunks
    for k in points:
        config, url = location_config(location, f"kill-{k}")
        run_worker({**config, "first": "A", "name": "B", "kill_at": ["any", k]}, killed=True)
        outcome = check_after_kill(url, location.storage_options)
        RESULTS.append({"store": store, "k": k, "call": trace[k - 1], **outcome})
        assert outcome["lost"] == 0
    kinds = {tuple(r["call"][:2]) for r in RESULTS if r["store"] == store}
    assert ("write", "open" if store == "local" else "put_object") in kinds
    print(f"\n{store}: killed at {len(points)} points of {len(trace)} calls")
