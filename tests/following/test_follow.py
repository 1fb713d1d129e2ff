"""de_store.follow: a serving process applies each committed checkpoint to its live tables.

The trainer runs as a real process (``follow_trainer.py``) while this process follows;
every checkpoint applied is compared, row for row, with the state the trainer wrote down
before saving it.
"""

from __future__ import annotations

import logging
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.following import AppliedCheckpoint
from de_store.testing import StorageLocation

TRAINER = Path(__file__).with_name("follow_trainer.py")
STEPS = 8


def serving_variable() -> ds.Variable:
    return ds.Variable("emb", dim=4, devices=["/CPU:0", "/CPU:0", "/CPU:0"])


def content(var: ds.Variable) -> tuple[np.ndarray, np.ndarray]:
    keys, values = (t.numpy() for t in var.export())
    order = np.argsort(keys)
    return keys[order], values[order]


def step_of(url: str) -> int:
    match = re.fullmatch(r"ckpt-(\d+)", posixpath.basename(url))
    assert match, url
    return int(match[1])


def follow_a_trainer(
    tmp_path: Path, mode: str, watched: str, lockstep: bool = False
) -> list[tuple[int, str]]:
    """Run the trainer in ``mode`` while following ``watched``; check every applied
    checkpoint against the trainer's state of that step; return (step, kind) applied."""
    states = tmp_path / "states"
    states.mkdir()
    served, checked, problems = serving_variable(), [], []

    def check(applied: AppliedCheckpoint) -> None:  # in the follower's thread, between applies
        step = step_of(applied.url)
        expected = np.load(states / f"state-{step}.npz")
        keys, values = content(served)
        try:
            np.testing.assert_array_equal(keys, expected["keys"])
            np.testing.assert_array_equal(values, expected["values"])
        except AssertionError as err:
            problems.append((step, str(err)))
        checked.append((step, applied.kind))
        (states / f"ack-{step}").touch()

    trainer = subprocess.Popen(
        [sys.executable, str(TRAINER), str(tmp_path / "root"), str(states), str(STEPS), mode,
         *(["lockstep"] if lockstep else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    follower = ds.follow(served, watched, poll_interval_s=0.01, on_apply=check)
    try:
        out, err = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, err[-3000:]
        assert out.strip() == "trainer done"
        last = f"ckpt-{STEPS - 1}"
        assert follower.wait_for(lambda f: (f.applied or "").endswith(last), timeout_s=60)
    finally:
        follower.stop()
    assert not follower.running
    assert problems == []
    assert checked[-1][0] == STEPS - 1
    return checked


def test_every_checkpoint_applied_holds_the_trainers_state_of_its_step(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    checked = follow_a_trainer(tmp_path, "save", str(tmp_path / "root"), lockstep=True)
    # each applied once, in order, on its parent: full saves every third
    assert checked == [(step, "delta" if step % 3 else "full") for step in range(STEPS)]


def test_a_trainer_whose_saves_delete_old_checkpoints_does_not_break_the_follower(
    tmp_path: Path,
) -> None:
    """CheckpointManager(max_to_keep=2): each save removes the KV checkpoints of the TF
    checkpoints the manager dropped (gc's orphans), while the follower reads."""
    (tmp_path / "root").mkdir()
    follow_a_trainer(tmp_path, "manager", str(tmp_path / "root" / "de_store"))
    kept = sorted(p.name for p in (tmp_path / "root" / "de_store").iterdir())
    assert f"ckpt-{STEPS - 1}" in kept and "ckpt-0" not in kept  # gc did delete


# --- in one process: damage, broken chains, what a follower refuses ---------------------
POLICY = ds.IncrementalPolicy(full_every=100, max_chain_ratio=1e9)


def save(var: ds.Variable, url: str, full: bool = False) -> None:
    ds.save([var], url, incremental=False if full else POLICY, blocking=True)


def change(var: ds.Variable, seed: int) -> None:
    rng = np.random.default_rng(seed)
    var.upsert(tf.constant(rng.integers(0, 500, 50)), tf.constant(rng.random((50, 4)), tf.float32))
    var.remove(tf.constant(rng.integers(0, 500, 5)))


def damage(folder: Path) -> Path:
    """Flip one byte in the middle of the checkpoint's (only) shard file of rows."""
    (shard,) = [p for p in (folder / "emb").iterdir() if not p.name.startswith("removed-")]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.fixture
def trained(tmp_path: Path) -> ds.Variable:
    var = ds.Variable("emb", dim=4)
    change(var, 0)
    save(var, str(tmp_path / "ckpt-0"))
    return var


def test_a_damaged_delta_is_skipped_and_the_previous_state_keeps_serving(
    tmp_path: Path, trained: ds.Variable, caplog: pytest.LogCaptureFixture
) -> None:
    served = serving_variable()
    follower = ds.Follower(served, str(tmp_path), start=False)
    assert follower.poll().kind == "full"  # type: ignore[union-attr]
    at_0 = content(trained)
    change(trained, 1)
    save(trained, str(tmp_path / "ckpt-1"))
    shard = damage(tmp_path / "ckpt-1")
    with caplog.at_level(logging.WARNING, logger="de_store.follow"):
        assert follower.poll() is None
        assert follower.poll() is None  # refused once, not read again
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith(
        f"following {tmp_path}: checkpoint {tmp_path}/ckpt-1 not applied, still serving "
        f"{tmp_path}/ckpt-0: "
    )
    assert str(shard) in record.getMessage()
    np.testing.assert_array_equal(content(served)[0], at_0[0])
    np.testing.assert_array_equal(content(served)[1], at_0[1])
    # a delta on the damaged one cannot apply either; the next full checkpoint catches up
    change(trained, 2)
    save(trained, str(tmp_path / "ckpt-2"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="de_store.follow"):
        assert follower.poll() is None
    assert f"checkpoint {tmp_path}/ckpt-2 not applied" in caplog.records[0].getMessage()
    change(trained, 3)
    save(trained, str(tmp_path / "ckpt-3"), full=True)
    applied = follower.poll()
    assert applied is not None and applied.kind == "full"
    assert applied.url == f"{tmp_path}/ckpt-3" and follower.applied == applied.url
    np.testing.assert_array_equal(content(served)[0], content(trained)[0])
    np.testing.assert_array_equal(content(served)[1], content(trained)[1])


def test_a_delta_whose_chain_lost_a_link_waits_for_the_next_full_checkpoint(
    tmp_path: Path, trained: ds.Variable, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower starting late reads a delta's chain from its full link; with a link
    gone it keeps what it holds (here: nothing) and warns."""
    change(trained, 1)
    save(trained, str(tmp_path / "ckpt-1"))
    change(trained, 2)
    save(trained, str(tmp_path / "ckpt-2"))
    for path in sorted((tmp_path / "ckpt-1").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (tmp_path / "ckpt-1").rmdir()
    served = serving_variable()
    follower = ds.Follower(served, str(tmp_path), start=False)
    with caplog.at_level(logging.WARNING, logger="de_store.follow"):
        assert follower.poll() is None
    assert caplog.records[0].getMessage() == (
        f"following {tmp_path}: checkpoint {tmp_path}/ckpt-2 not applied, still serving what "
        f"the tables held: checkpoint {tmp_path}/ckpt-2 depends on {tmp_path}/ckpt-1, which "
        "does not exist: every link of an incremental chain is needed"
    )
    assert int(served.size()) == 0 and follower.applied is None


@pytest.mark.parametrize("full_load", ["staged", "streamed"])
def test_a_full_checkpoint_of_string_keys_replaces_the_content(
    tmp_path: Path, full_load: str
) -> None:
    """String keys come out of the tables as bytes and out of shards as str: the keys a
    full checkpoint no longer holds are still found and removed."""
    trained = ds.Variable("words", dim=2, key_dtype=tf.string)
    trained.upsert(tf.constant(["a", "b", "c"]), tf.constant([[1.0, 1], [2, 2], [3, 3]]))
    save(trained, str(tmp_path / "ckpt-0"), full=True)
    served = ds.Variable("words", dim=2, key_dtype=tf.string, devices=["/CPU:0", "/CPU:0"])
    follower = ds.Follower(served, str(tmp_path), start=False, full_load=full_load)
    assert follower.poll() is not None
    trained.remove(tf.constant(["a"]))
    trained.upsert(tf.constant(["b", "é"]), tf.constant([[5.0, 5], [6, 6]]))
    save(trained, str(tmp_path / "ckpt-1"), full=True)
    applied = follower.poll()
    assert applied is not None and (applied.kind, applied.upserted, applied.removed) == (
        "full",
        2,
        1,
    )
    np.testing.assert_array_equal(content(served)[0], [b"b", b"c", "é".encode()])
    np.testing.assert_array_equal(content(served)[1], [[5, 5], [3, 3], [6, 6]])


@pytest.mark.parametrize("full_load", ["staged", "streamed"])
def test_a_full_checkpoint_replaces_the_content_without_emptying_the_table(
    tmp_path: Path, trained: ds.Variable, full_load: str
) -> None:
    """Keys of both checkpoints keep being found while the full one applies, one step of
    two keys at a time; keys it lacks go at the end."""
    served = serving_variable()
    follower = ds.Follower(served, str(tmp_path), start=False, full_load=full_load, chunk_rows=2)
    follower.poll()
    held = dict(zip(*(x.tolist() for x in content(served)), strict=True))
    before = set(held)
    change(trained, 7)
    trained.remove(tf.constant(sorted(before)[:10], tf.int64))
    save(trained, str(tmp_path / "ckpt-1"), full=True)
    after = set(content(trained)[0].tolist())
    both = tf.constant(sorted(before & after), tf.int64)
    seen = []
    for core in served.shards:  # each write step of the apply, as lookups see it

        def watching_insert(keys, values, insert=core.insert):  # type: ignore[no-untyped-def]
            seen.append(bool(tf.reduce_all(served.lookup(both, return_exists=True)[1])))
            return insert(keys, values)

        core.insert = watching_insert

    applied = follower.poll()
    assert applied is not None and applied.kind == "full"
    assert len(seen) > 10 and all(seen)  # never a key of both checkpoints missing
    assert applied.removed == len(before - after) >= 10
    new_rows = dict(zip(*(x.tolist() for x in content(trained)), strict=True))
    differing = [key for key, row in new_rows.items() if held.get(key) != row]
    assert 0 < applied.upserted == len(differing) < len(new_rows)  # only what differs
    np.testing.assert_array_equal(content(served)[0], content(trained)[0])
    np.testing.assert_array_equal(content(served)[1], content(trained)[1])


def test_what_a_follower_refuses_up_front(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"^full_load must be one of \['staged', 'streamed'\], got 'lazy'$"
    ):
        ds.Follower(serving_variable(), str(tmp_path), full_load="lazy", start=False)
    with pytest.raises(ds.VariableError, match=r"^found no de_store table to follow in dict"):
        ds.Follower({"a": 1}, str(tmp_path), start=False)
    other = ds.Variable("emb", dim=4)
    with pytest.raises(ds.VariableError, match=r"^two followed tables are named 'emb'$"):
        ds.Follower([serving_variable(), other], str(tmp_path), start=False)


def test_a_checkpoint_of_another_dim_is_refused_with_a_warning(
    tmp_path: Path, trained: ds.Variable, caplog: pytest.LogCaptureFixture
) -> None:
    served = ds.Variable("emb", dim=8)
    follower = ds.Follower(served, str(tmp_path), start=False)
    with caplog.at_level(logging.WARNING, logger="de_store.follow"):
        assert follower.poll() is None
    assert (
        caplog.records[0]
        .getMessage()
        .endswith(
            f"variable 'emb': checkpoint {tmp_path}/ckpt-0 holds (key_dtype, value_dtype, dim) = "
            "('int64', 'float32', 4), the followed variable has ('int64', 'float32', 8)"
        )
    )
    assert int(served.size()) == 0


def test_a_follower_follows_deltas_on_every_backend(storage_location: StorageLocation) -> None:
    url, options = storage_location.url, storage_location.storage_options
    trained = ds.Variable("emb", dim=4)
    change(trained, 0)
    ds.save([trained], f"{url}/run/ckpt-0", storage_options=options, incremental=POLICY,
            blocking=True)  # fmt: skip
    served = serving_variable()
    follower = ds.Follower(served, url, storage_options=options, start=False)
    assert follower.poll().kind == "full"  # type: ignore[union-attr]
    change(trained, 1)
    ds.save([trained], f"{url}/run/ckpt-1", storage_options=options, incremental=POLICY,
            blocking=True)  # fmt: skip
    applied = follower.poll()
    assert applied is not None and applied.kind == "delta"
    assert applied.url == follower.applied == f"{url}/run/ckpt-1"
    assert follower.poll() is None  # nothing newer
    np.testing.assert_array_equal(content(served)[0], content(trained)[0])
    np.testing.assert_array_equal(content(served)[1], content(trained)[1])


def test_a_checkpoint_that_fails_while_applied_is_followed_by_a_whole_load(
    tmp_path: Path, trained: ds.Variable, caplog: pytest.LogCaptureFixture
) -> None:
    """Some of its keys may be applied: the next checkpoint is loaded from its full link."""
    served = serving_variable()
    follower = ds.Follower(served, str(tmp_path), start=False, chunk_rows=8)
    follower.poll()
    change(trained, 1)
    save(trained, str(tmp_path / "ckpt-1"))
    core = served.shards[1]
    calls = []

    def failing_insert(keys, values, insert=core.insert):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        if len(calls) == 2:  # the second step on this shard: one step went through
            raise tf.errors.ResourceExhaustedError(None, None, "out of memory")
        return insert(keys, values)

    core.insert = failing_insert
    with caplog.at_level(logging.WARNING, logger="de_store.follow"):
        assert follower.poll() is None
    assert caplog.records[0].getMessage() == (
        f"following {tmp_path}: checkpoint {tmp_path}/ckpt-1 failed while applied; its keys "
        "are partly applied, the next checkpoint is loaded whole: out of memory"
    )
    assert follower.applied == f"{tmp_path}/ckpt-0"
    del core.insert  # the table's own method again
    change(trained, 2)
    save(trained, str(tmp_path / "ckpt-2"))
    applied = follower.poll()
    assert applied is not None and (applied.url, applied.kind) == (f"{tmp_path}/ckpt-2", "full")
    np.testing.assert_array_equal(content(served)[0], content(trained)[0])
    np.testing.assert_array_equal(content(served)[1], content(trained)[1])
