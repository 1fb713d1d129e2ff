"""Transient backend faults: 10% of writes and reads fail; saves retry or fail cleanly.

Over many seeds, a save through a ``FaultyFileSystem`` either commits exactly the saved
content or raises and leaves the previous checkpoint as the latest; a restore through it
retries its reads and either returns the exact content or raises with the table unchanged.
"""

from __future__ import annotations

from typing import Any

import fsspec
import pytest
from fault_worker import variable_rows
from faults_helpers import content, expected_content, make_variable

from de_store.backends import Backend, open_backend
from de_store.checkpoint.commit import committed_folder
from de_store.checkpoint.retry import RetryPolicy
from de_store.checkpoint.topology import Topology
from de_store.errors import DeStoreError
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.restore_flow import restore_checkpoint
from de_store.testing import StorageLocation
from de_store.testing.faults import FaultPlan, FaultyFileSystem

SEEDS = 12
RATES = {"write": 0.1, "read": 0.1, "rename": 0.1, "rm": 0.1}
OPTIONS = IOOptions(buffer_size=500, retry=RetryPolicy(attempts=4, initial_backoff_s=0.01))
SINGLE = Topology(1, 0)
RESULTS: list[dict[str, Any]] = []


def faulty_backend(location: StorageLocation, root: str, plan: FaultPlan) -> Backend:
    if location.name == "local":
        inner = fsspec.filesystem("file")
        return open_backend(FaultyFileSystem(inner, plan), root=f"{location.url}/{root}")
    inner = fsspec.filesystem("s3", **location.storage_options)
    path = location.url.removeprefix("s3://")
    return open_backend(FaultyFileSystem(inner, plan), root=f"{path}/{root}")


def restore_content(backend: Backend, name: str) -> dict[int, tuple[float, ...]]:
    var = make_variable()
    restore_checkpoint([var], backend, name, SINGLE, OPTIONS)
    return content(var)


@pytest.mark.parametrize("store", ["local", "s3"])
def test_saves_and_restores_survive_transient_faults(
    request: pytest.FixtureRequest, store: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    outcomes = {"committed": 0, "failed cleanly": 0, "restored": 0, "restore failed": 0}
    injected = 0
    for seed in range(SEEDS):
        plan = FaultPlan(fail=RATES, seed=seed, active=False)
        backend = faulty_backend(location, f"seed-{seed}", plan)
        save_checkpoint([variable_rows(1, 1, 0)], backend, "A", SINGLE, OPTIONS)
        plan.active = True
        try:
            save_checkpoint([variable_rows(2, 1, 0)], backend, "B", SINGLE, OPTIONS)
            outcomes["committed"] += 1
            latest, version = "B", 2
        except DeStoreError:
            outcomes["failed cleanly"] += 1
            latest, version = "A", 1
        plan.active = False
        assert restore_content(backend, "A") == expected_content(1)
        if latest == "B":
            assert restore_content(backend, "B") == expected_content(2)
        else:
            assert committed_folder(backend, "B") is None
        plan.active = True
        var = make_variable()
        var.upsert([7], [[1.0, 2.0, 3.0, 4.0]])
        before = content(var)
        try:
            restore_checkpoint([var], backend, latest, SINGLE, OPTIONS)
            assert content(var) == expected_content(version)
            outcomes["restored"] += 1
        except DeStoreError:
            assert content(var) == before
            outcomes["restore failed"] += 1
        injected += plan.injected
    RESULTS.append({"store": store, "seeds": SEEDS, "injected": injected, **outcomes})
    print(f"\n{store}: {injected} faults injected over {SEEDS} seeds: {outcomes}")
    assert injected > SEEDS  # the faults did happen
    assert outcomes["committed"] > SEEDS // 2  # and retries carried most saves through
    assert outcomes["restored"] > SEEDS // 2


def test_restore_retries_reads(local_location: StorageLocation) -> None:
    # opens and range reads fail, and reads of a chunk within an open file
    plan = FaultPlan(fail={"read": 0.3, "chunk": 0.1}, seed=5, active=False)
    backend = faulty_backend(local_location, "r", plan)
    save_checkpoint([variable_rows(1, 1, 0)], backend, "A", SINGLE, OPTIONS)
    plan.active = True
    many = IOOptions(retry=RetryPolicy(attempts=12, initial_backoff_s=0.001))
    var = make_variable()
    restore_checkpoint([var], backend, "A", SINGLE, many)
    assert content(var) == expected_content(1)
    assert plan.injected > 0


def test_without_retries_a_fault_fails_the_save_cleanly(local_location: StorageLocation) -> None:
    plan = FaultPlan(fail={"write": 1.0}, active=False)
    backend = faulty_backend(local_location, "n", plan)
    save_checkpoint([variable_rows(1, 1, 0)], backend, "A", SINGLE, OPTIONS)
    plan.active = True
    with pytest.raises(DeStoreError, match="injected fault"):
        save_checkpoint([variable_rows(2, 1, 0)], backend, "B", SINGLE, OPTIONS)
    plan.active = False
    assert committed_folder(backend, "B") is None
    assert restore_content(backend, "A") == expected_content(1)


def test_retry_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="retry must be a RetryPolicy"):
        IOOptions(retry=3)  # type: ignore[arg-type]
