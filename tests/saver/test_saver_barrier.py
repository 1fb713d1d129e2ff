"""StorageBarrier.agree: every rank gets rank 0's proposal of this attempt, never a value
or a note that an earlier attempt of the same job left in the folder."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from de_store.backends import Backend, open_backend
from de_store.checkpoint.barrier import StorageBarrier
from de_store.checkpoint.topology import Topology
from de_store.errors import BarrierTimeoutError


def leave_stale_notes(backend: Backend) -> None:
    """What a crashed attempt left: rank 0's answer and rank 1's note, agreed on "old"."""
    folder = "B.pending/job/_barrier/attempt"
    backend.write_bytes(f"{folder}/rank-00000", json.dumps(
        {"value": "old", "nonces": {"1": "n-old", "2": "n-old2"}}).encode())  # fmt: skip
    backend.write_bytes(f"{folder}/rank-00001", json.dumps(
        {"nonce": "n-old", "agreed": "old"}).encode())  # fmt: skip


def barrier(backend: Backend, size: int, rank: int) -> StorageBarrier:
    return StorageBarrier(backend, "B.pending/job", Topology(size, rank))


def test_ranks_take_rank_0s_proposal_not_an_earlier_attempts(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    leave_stale_notes(backend)
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        got[r] = barrier(backend, 3, r).agree("attempt", f"proposal-{r}", 60)

    others = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for thread in others:
        thread.start()
    rank(0)
    for thread in others:
        thread.join(60)
    assert got == {0: "proposal-0", 1: "proposal-0", 2: "proposal-0"}


def test_rank_0_alone_is_not_fooled_by_an_earlier_attempts_note(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    leave_stale_notes(backend)
    missing = r"rank\(s\) \[1\] of 2 did not arrive within 0\.3 s \(this is rank 0\)"
    with pytest.raises(
        BarrierTimeoutError, match=r"barrier 'attempt' at .*B\.pending/job: " + missing
    ):
        barrier(backend, 2, 0).agree("attempt", "new", 0.3)


def test_a_rank_alone_does_not_take_an_earlier_attempts_answer(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    leave_stale_notes(backend)
    unanswered = r"rank 0 did not answer rank 1 of 2 within 0\.3 s \(this is rank 1\)"
    with pytest.raises(BarrierTimeoutError, match=unanswered):
        barrier(backend, 2, 1).agree("attempt", "mine", 0.3)
