"""A rank that dies (SIGKILL) or hangs in a multi-process save: the others time out
naming it, nothing is committed, and the previous checkpoint restores exactly."""

from __future__ import annotations

from typing import Any

import pytest
from faults_helpers import expected_content, restored, start_worker
from test_faults_kill import location_config

from de_store.backends import open_backend
from de_store.checkpoint import gc
from de_store.checkpoint.commit import committed_folder
from de_store.testing import StorageLocation

TIMEOUT_S = 2.0
RESULTS: list[dict[str, Any]] = []


def run_two_ranks(config: dict[str, Any], rank1: dict[str, Any]) -> list[tuple[int, str]]:
    base = {**config, "first": "A", "name": "B", "proc_size": 2, "job_id": "job-7",
            "barrier_timeout_s": TIMEOUT_S}  # fmt: skip
    procs = [start_worker({**base, "rank": 0}), start_worker({**base, "rank": 1, **rank1})]
    _, err0 = procs[0].communicate(timeout=60)
    if rank1.get("hang"):
        procs[1].kill()  # rank 0 has given up on it
    _, err1 = procs[1].communicate(timeout=60)
    return [(procs[0].returncode, err0), (procs[1].returncode, err1)]


def check_nothing_committed(url: str, options: dict[str, Any], case: str) -> None:
    backend = open_backend(url, options)
    assert committed_folder(backend, "B") is None
    assert restored(f"{url}/A", options) == expected_content(1, proc_size=2)
    gc.collect(backend, grace_s=0)
    assert sorted({p.split("/", 1)[0] for p in backend.list("")}) == ["A"]
    RESULTS.append({"case": case, "lost": 0, "wrong": 0})


@pytest.mark.parametrize("store", ["local", "s3"])
def test_killed_rank_makes_rank_0_time_out_naming_it(
    request: pytest.FixtureRequest, store: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    config, url = location_config(location, "killed")
    (code0, err0), (code1, _) = run_two_ranks(config, {"kill_at": ["write", 1]})
    assert code1 == -9
    assert code0 != 0 and "BarrierTimeoutError" in err0
    assert "rank(s) [1] of 2 did not arrive" in err0
    check_nothing_committed(url, location.storage_options, f"rank 1 killed ({store})")


def test_hung_rank_makes_rank_0_time_out_naming_it(local_location: StorageLocation) -> None:
    config, url = location_config(local_location, "hung")
    procs = run_two_ranks(config, {"hang": True})
    (code0, err0), _ = procs
    assert code0 != 0 and "rank(s) [1] of 2 did not arrive" in err0
    check_nothing_committed(url, {}, "rank 1 hangs (local)")


def test_killed_rank_0_makes_the_others_time_out(local_location: StorageLocation) -> None:
    config, url = location_config(local_location, "chief")
    base = {**config, "first": "A", "name": "B", "proc_size": 2, "job_id": "job-8",
            "barrier_timeout_s": TIMEOUT_S}  # fmt: skip
    proc0 = start_worker({**base, "rank": 0, "kill_at": ["write", 1]})
    proc1 = start_worker({**base, "rank": 1})
    _, _ = proc0.communicate(timeout=60)
    _, err1 = proc1.communicate(timeout=60)
    assert proc0.returncode == -9
    assert proc1.returncode != 0 and "rank 1: rank 0 did not commit" in err1
    check_nothing_committed(url, {}, "rank 0 killed (local)")
