"""Concurrent saves of one checkpoint: never an interleaved checkpoint, a clear error for
the loser, and no save replaces a checkpoint committed after it began."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fault_worker import variable_rows
from faults_helpers import expected_content, restored, start_worker
from test_faults_kill import location_config

from de_store.backends import Backend, open_backend
from de_store.checkpoint.barrier import Barrier
from de_store.checkpoint.topology import Topology
from de_store.checkpoint.verify import verify_checkpoint
from de_store.errors import AlreadyExistsError
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.testing import StorageLocation

SINGLE = Topology(1, 0)
OPTIONS = IOOptions(buffer_size=500)
RESULTS: list[dict[str, Any]] = []


class PausingBarrier(Barrier):
    """Holds rank 0 at the barrier (shards written, nothing committed) until released."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()

    def wait(self, tag: str, timeout_s: float) -> None:
        self.arrived.set()
        assert self.release.wait(30)


def check_one_whole_checkpoint(url: str, options: dict[str, Any], versions: set[int]) -> int:
    """The committed checkpoint verifies and holds exactly one save's content."""
    backend, _, name = open_backend(url.rsplit("/", 1)[0], options), None, url.rsplit("/", 1)[1]
    report = verify_checkpoint(backend, name)
    assert report.ok, report.problems
    got = restored(url, options)
    matches = [v for v in versions if got == expected_content(v)]
    assert len(matches) == 1
    return matches[0]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_save_never_replaces_a_checkpoint_committed_after_it_began(
    request: pytest.FixtureRequest, store: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    backend: Backend = location.open()
    paused = PausingBarrier()
    errors: list[BaseException] = []

    def slow_save() -> None:
        try:
            save_checkpoint([variable_rows(3, 1, 0)], backend, "B", SINGLE, OPTIONS,
                            barrier=paused)  # fmt: skip
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=slow_save)
    thread.start()
    assert paused.arrived.wait(30)
    save_checkpoint([variable_rows(2, 1, 0)], backend, "B", SINGLE, OPTIONS)  # wins
    paused.release.set()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], AlreadyExistsError), errors
    assert "after this one began" in str(errors[0]) or "first" in str(errors[0])
    assert "B" in str(errors[0])
    url = f"{location.url}/B"
    assert check_one_whole_checkpoint(url, location.storage_options, {2, 3}) == 2
    # a rewrite that began after the commit still replaces it
    save_checkpoint([variable_rows(4, 1, 0)], backend, "B", SINGLE, OPTIONS)
    assert check_one_whole_checkpoint(url, location.storage_options, {2, 3, 4}) == 4
    RESULTS.append({"case": f"late loser ({store})", "lost": 0, "wrong": 0})


@pytest.mark.parametrize("store", ["local", "s3"])
def test_two_jobs_saving_the_same_step_at_once(request: pytest.FixtureRequest, store: str) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    wins = losses = 0
    for attempt in range(3):
        config, url = location_config(location, f"race-{attempt}")
        jobs = [start_worker({**config, "name": "B", "version": v}) for v in (5, 6)]
        outcomes = [(job.communicate(timeout=60)[1], job.returncode) for job in jobs]
        failed = [err for err, code in outcomes if code != 0]
        for err in failed:
            assert "AlreadyExistsError" in err and "cannot commit" in err, err[-2000:]
        assert len(failed) < 2
        wins += 2 - len(failed)
        losses += len(failed)
        check_one_whole_checkpoint(f"{url}/B", location.storage_options, {5, 6})
    RESULTS.append({"case": f"two jobs, same step ({store})", "wins": wins, "losses": losses})
    print(f"\n{store}: {wins} commits, {losses} refused")


def test_a_second_save_into_a_shared_staging_folder_is_refused(
    local_location: StorageLocation,
) -> None:
    from de_store.checkpoint.commit import commit_strategy

    backend = local_location.open()
    commit_strategy(backend, "B").begin()  # a multi-process job without a job id
    with pytest.raises(AlreadyExistsError, match=r"B\.pending/LOCK exists, another save in"):
        commit_strategy(backend, "B").begin()
