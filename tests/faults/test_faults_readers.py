"""Readers beside a writer: processes restoring ``tf.train.latest_checkpoint`` while another
saves asynchronously through ``CheckpointManager(max_to_keep=3)`` restore whole checkpoints,
exactly as saved, or fail with the error that says the checkpoint was removed, and retry.

Every checkpoint ``ckpt-N`` holds the keys and values of step ``N``
(``readers_worker.expected``), its key window moved from the step before, and the step in a
TF variable, so a restore of files of two steps (KV data of one, TF bundle of another, or
shards of two) shows. One reader empties its variable before each restore (the streaming
restore), the other restores over the previous checkpoint's rows.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import pytest
import tensorflow as tf

import de_store as ds
from de_store.errors import CheckpointNotFoundError, StorageNotFoundError
from de_store.saver import restore_plan
from de_store.testing import StorageLocation

WORKER = str(Path(__file__).with_name("readers_worker.py"))
#: How long the writer saves, and how often.
SECONDS, INTERVAL_S = 60.0, 0.2
#: The errors a reader retries on, a checkpoint removed under it: class -> what the message
#: says, one of (a reader counts messages with their numbers as N). TensorFlow's name the
#: TF checkpoint whose files are gone, de_store's the KV checkpoint removed during its read.
REMOVED_ERRORS = {
    "de_store.errors.CheckpointNotFoundError": ("ckpt-N was removed while it was being restored",),
    "tensorflow.python.framework.errors_impl.NotFoundError": (
        "Failed to find any matching files for ",
        "No such file or directory",
    ),
}


def start(role: str, config: dict[str, Any], stderr: IO[str]) -> subprocess.Popen[str]:
    command = [sys.executable, WORKER, role, json.dumps(config)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)  # fmt: skip


def tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def next_line(proc: subprocess.Popen[str], log: Path, timeout: float) -> str:
    """The next line ``proc`` prints, within ``timeout`` seconds (its lines come seconds
    apart: the text buffer holds none ahead of the one ``select`` sees)."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no line within {timeout} s: {log.read_text()[-3000:]}")
    line = proc.stdout.readline()
    assert line, f"exited ({proc.wait()}) without a line: {log.read_text()[-3000:]}"
    return line


def counts_of(proc: subprocess.Popen[str], log: Path, timeout: float) -> dict[str, Any]:
    return dict(json.loads(next_line(proc, log, timeout)))


def run_beside_writer(tmp_path: Path, save_path: str | None, options: dict[str, Any]) -> dict:
    """Run the writer and two readers; return the writer's and the readers' counts."""
    config = {"tf_dir": str(tmp_path / "tf"), "save_path": save_path, "options": options,
              "seconds": SECONDS, "interval_s": INTERVAL_S}  # fmt: skip
    roles = [("writer", config), ("reader", {**config, "fresh": True}),
             ("reader", {**config, "fresh": False})]  # fmt: skip
    logs = [tmp_path / f"{role}-{i}.log" for i, (role, _) in enumerate(roles)]
    procs: list[subprocess.Popen[str]] = []
    started = time.monotonic()
    try:
        for (role, role_config), log in zip(roles, logs, strict=True):
            with open(log, "w") as stderr:
                procs.append(start(role, role_config, stderr))
        writer, *readers = procs
        line = next_line(writer, logs[0], 180)
        assert line == "ready\n", line
        phases = [time.monotonic()]  # the first checkpoint committed
        for reader in readers:
            tell(reader, "go")
        saved = counts_of(writer, logs[0], SECONDS + 120)
        phases.append(time.monotonic())
        for reader in readers:
            tell(reader, "stop")
        counts = [counts_of(r, log, 120) for r, log in zip(readers, logs[1:], strict=True)]
        phases.append(time.monotonic())
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(60) == 0, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    saved["seconds_to_first_save"] = round(phases[0] - started, 1)
    saved["seconds_saving"] = round(phases[1] - phases[0], 1)
    saved["seconds_to_last_report"] = round(phases[2] - phases[1], 1)
    return {"writer": saved, "fresh_reader": counts[0], "reusing_reader": counts[1]}


def check_readers(result: dict[str, Any]) -> None:
    for name in ("fresh_reader", "reusing_reader"):
        counts = result[name]
        assert counts["wrong"] == [], counts["wrong"]
        assert counts["final_exact"], counts
        assert counts["exact"] >= 10 and counts["late_restores"] >= 5, counts
        assert counts["retries"] == sum(counts["errors"].values())
        for message in counts["errors"]:
            kind, _, text = message.partition(": ")
            assert any(says in text for says in REMOVED_ERRORS.get(kind, ())), message
            assert "ckpt-N" in text, message  # it names the checkpoint


@pytest.mark.slow
def test_readers_beside_a_writer_on_local_disk_and_on_s3(
    tmp_path: Path, s3_location: StorageLocation
) -> None:
    """The two set-ups side by side (their six processes share the cores). On S3, TF
    writes its checkpoints on local disk (it has no S3 filesystem of its own); the KV data
    goes to the moto server."""
    (tmp_path / "local").mkdir()
    (tmp_path / "s3").mkdir()
    with ThreadPoolExecutor(2) as pool:
        local = pool.submit(run_beside_writer, tmp_path / "local", None, {})
        on_s3 = pool.submit(run_beside_writer, tmp_path / "s3", s3_location.url,
                            s3_location.storage_options)  # fmt: skip
        results = {"local": local.result(), "s3": on_s3.result()}
    print(json.dumps(results, indent=1))
    for result in results.values():
        check_readers(result)


# --- a removal in the middle of one restore, made to happen -------------------------------
def saved_checkpoint(tmp_path: Path) -> str:
    """A TF checkpoint ``ckpt-1`` of keys 0..99 (KV data in ``de_store/ckpt-1`` beside it)."""
    emb = ds.Variable("emb", dim=2, kv_creator=ds.HashTableCreator(ds.FileSystemSaver()))
    emb.upsert(tf.range(100, dtype=tf.int64), tf.ones([100, 2]))
    return str(tf.train.Checkpoint(emb=emb).write(str(tmp_path / "ckpt-1")))


def remove_after_manifest(monkeypatch: pytest.MonkeyPatch, remove: Callable[[], None]) -> None:
    """Run ``remove`` once the restore has read the manifest, before it reads a shard."""
    read_manifest = restore_plan.read_manifest

    def read_then_remove(*args: Any) -> Any:
        found = read_manifest(*args)
        remove()
        return found

    monkeypatch.setattr(restore_plan, "read_manifest", read_then_remove)


def remove_all(prefix: str) -> None:
    """What CheckpointManager and the next save do: the TF files, then the KV folder."""
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        path.unlink()
    shutil.rmtree(Path(prefix).parent / "de_store" / Path(prefix).name)


def rows(emb: ds.Variable) -> dict[int, float]:
    keys, values = emb.export()
    return dict(zip(keys.numpy().tolist(), values.numpy()[:, 0].tolist(), strict=True))


def restore_target(held: bool) -> ds.Variable:
    emb = ds.Variable("emb", dim=2, kv_creator=ds.HashTableCreator(ds.FileSystemSaver()))
    if held:  # a restore over rows read first; else an empty variable streams its rows
        emb.upsert(tf.constant([7, 1000], tf.int64), tf.fill([2, 2], 3.0))
    return emb


@pytest.mark.parametrize("held", [False, True], ids=["empty", "holding rows"])
def test_a_checkpoint_removed_while_restored_says_it_was_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    prefix = saved_checkpoint(tmp_path)
    emb = restore_target(held)
    before = rows(emb)
    remove_after_manifest(monkeypatch, lambda: remove_all(prefix))
    with pytest.raises(CheckpointNotFoundError, match="was removed while it was being restored"):
        tf.train.Checkpoint(emb=emb).restore(prefix)
    assert rows(emb) == before


def test_a_checkpoint_removed_while_restored_by_de_store_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "kv" / "ckpt-1")
    emb = ds.Variable("emb", dim=2)
    emb.upsert(tf.range(100, dtype=tf.int64), tf.ones([100, 2]))
    ds.save([emb], url, blocking=True)
    remove_after_manifest(monkeypatch, lambda: shutil.rmtree(url))
    restored = ds.Variable("emb", dim=2)
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f"{url} was removed while")):
        ds.restore([restored], url)
    assert int(restored.size()) == 0


def test_a_shard_missing_from_a_checkpoint_still_there_is_not_a_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = saved_checkpoint(tmp_path)
    shard = next((tmp_path / "de_store" / "ckpt-1").rglob("*.parquet"))
    remove_after_manifest(monkeypatch, shard.unlink)
    emb = restore_target(held=True)
    with pytest.raises(StorageNotFoundError, match=re.escape(shard.name)) as caught:
        tf.train.Checkpoint(emb=emb).restore(prefix)
    assert not isinstance(caught.value, CheckpointNotFoundError)
