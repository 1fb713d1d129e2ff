"""A job retried with the same job id after its rank 0 died (as a Slurm requeue does): the
retry never merges the rank manifests or files the dead attempt's ranks left behind."""

from __future__ import annotations

from typing import Any

import pytest
from faults_helpers import expected_content, restored, start_worker
from test_faults_kill import location_config

from de_store.backends import open_backend
from de_store.checkpoint.commit import committed_folder, read_manifest
from de_store.testing import StorageLocation

TIMEOUT_S = 2.0  # how long a rank waits for one that never comes
PATIENT_S = 60.0  # for ranks started together, however long their imports take
RESULTS: list[dict[str, Any]] = []


def run_attempt(base: dict[str, Any], per_rank: dict[int, dict[str, Any]]) -> list[tuple[int, str]]:
    """Start one worker per rank in ``per_rank`` (with its own config); their exit codes and
    stderr, in rank order."""
    procs = [start_worker({**base, "rank": rank, **extra}) for rank, extra in per_rank.items()]
    outcomes = []
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        outcomes.append((proc.returncode, err))
    return outcomes


@pytest.mark.parametrize(
    ("store", "kill_at"),
    [
        ("local", ["any", 1]),  # rank 0 dies before it begins: rank 1 alone goes on
        ("s3", ["any", 1]),
        ("s3", ["rm", 1]),  # rank 0 dies after both ranks wrote everything, before the commit
    ],
)
def test_a_retry_with_the_same_job_id_never_merges_a_dead_attempts_files(
    request: pytest.FixtureRequest, store: str, kill_at: list[Any]
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    config, url = location_config(location, f"retry-{kill_at[0]}")
    base = {**config, "name": "B", "proc_size": 2, "job_id": "job-9",
            "barrier_timeout_s": TIMEOUT_S}  # fmt: skip
    backend = open_backend(url, location.storage_options)

    (code0, _), (code1, _) = run_attempt(base, {0: {"kill_at": kill_at}, 1: {}})
    assert code0 == -9 and code1 != 0  # rank 1 gave up waiting for the dead rank 0
    assert committed_folder(backend, "B") is None

    # the retry's rank 1 has not started yet: rank 0 must not take the dead rank 1's files
    [(code, err)] = run_attempt(base, {0: {"version": 3}})
    assert code != 0 and "rank(s) [1] of 2 did not arrive" in err, err[-3000:]
    assert committed_folder(backend, "B") is None

    # both ranks start together; they wait for each other as long as a real job would
    patient = {"version": 4, "barrier_timeout_s": PATIENT_S}
    outcomes = run_attempt(base, {0: patient, 1: patient})
    assert [code for code, _ in outcomes] == [0, 0], [err[-3000:] for _, err in outcomes]
    assert restored(f"{url}/B", location.storage_options) == expected_content(4, proc_size=2)
    _, manifest = read_manifest(backend, "B")
    assert sorted(s.rank for s in manifest.variables["emb"].shards) == [0, 0, 1, 1]
    RESULTS.append({"case": f"retry after rank 0 killed at {kill_at} ({store})", "wrong": 0})
