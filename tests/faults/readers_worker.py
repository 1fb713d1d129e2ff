"""One process of the readers-beside-a-writer test, run as a real process by the test.

    python readers_worker.py writer CONFIG_JSON
    python readers_worker.py reader CONFIG_JSON

CONFIG keys: ``tf_dir`` (the TF checkpoint folder), ``save_path`` (the KV checkpoints'
root URL, or null: beside the TF checkpoints), ``options`` (storage options of
``save_path``), ``seconds`` (how long the writer saves), ``interval_s`` (between two
saves), ``fresh`` (a reader empties its variable before each restore, so that its restores
take the streaming path; else each restore replaces the previous one's rows).

The writer saves checkpoint ``ckpt-N`` holding :func:`expected` of step ``N`` through an
async ``CheckpointManager(max_to_keep=3)`` every ``interval_s`` for ``seconds``; it prints
``ready`` once the first is committed and its counts as JSON when done. A reader waits for
``go`` on stdin, then restores ``tf.train.latest_checkpoint`` in a loop until ``stop``
comes (every third restore late, see ``LATE_EVERY``), restores the last checkpoint once
more, and prints its counts as JSON: ``restores`` and ``late_restores``, how many of each
held exactly what their step saved (``exact``, ``late_exact``), ``retries`` (failed
restores) with ``errors`` (message, numbers as N -> count), ``latest_none`` (times
``latest_checkpoint`` returned None), ``wrong`` (mixed or partial restores: must stay
empty), ``final_exact`` and ``distinct_steps`` restored.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

DIM = 4
#: Keys of step ``n``: ``WIDTH`` keys from ``n * SHIFT`` on, every ``STRIDE``-th.
WIDTH, SHIFT, STRIDE = 50000, 5000, 3
#: Every ``LATE_EVERY``-th restore is late, as a slow reader's: it restores the checkpoint
#: that was the latest once 2 or 3 (in turn, ``LATE_BY``) newer ones are committed, while
#: CheckpointManager removes its TF files (after the third) and the next save its KV data.
LATE_EVERY, LATE_BY = 3, (2, 3)


def expected(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted keys and their values that checkpoint ``ckpt-{step}`` holds: the key window
    moves by ``SHIFT`` a step (keys added and removed) and every value names its step."""
    keys = np.arange(step * SHIFT, step * SHIFT + WIDTH * STRIDE, STRIDE, dtype=np.int64)
    values = keys[:, None].astype(np.float32) * np.arange(1, DIM + 1, dtype=np.float32) / 7
    return keys, values + np.float32(step) * 1000


def make_objects(config: dict[str, Any]) -> tuple[Any, tf.Variable, tf.train.Checkpoint]:
    """The embedding (two table shards, saved by a FileSystemSaver), the step variable and
    the checkpoint holding both."""
    import de_store as ds

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    saver = ds.FileSystemSaver(save_path=config["save_path"], storage_options=config["options"])
    emb = ds.Variable("emb", dim=DIM, devices=devices, kv_creator=ds.HashTableCreator(saver))
    step = tf.Variable(0, dtype=tf.int64)
    return emb, step, tf.train.Checkpoint(emb=emb, step=step)


def content(emb: Any) -> tuple[np.ndarray, np.ndarray]:
    """The variable's keys, sorted, and their values."""
    keys, values = (t.numpy() for t in emb.export())
    order = np.argsort(keys)
    return keys[order], values[order]


def writer(config: dict[str, Any]) -> None:
    emb, step, ckpt = make_objects(config)
    manager = tf.train.CheckpointManager(ckpt, config["tf_dir"], max_to_keep=3)
    options = tf.train.CheckpointOptions(enable_async=True)
    held = np.empty(0, np.int64)
    saves, started = 0, None
    while started is None or time.monotonic() - started < config["seconds"]:
        n = saves + 1
        keys, values = expected(n)
        emb.remove(tf.constant(np.setdiff1d(held, keys)))  # the keys that left the window
        emb.upsert(tf.constant(keys), tf.constant(values))
        held = keys
        step.assign(n)
        manager.save(checkpoint_number=n, options=options)
        saves += 1
        if started is None:
            ckpt.sync()  # committed: the readers may start
            started = time.monotonic()
            print("ready", flush=True)
        time.sleep(max(0.0, started + saves * config["interval_s"] - time.monotonic()))
    ckpt.sync()
    print(json.dumps({"saves": saves}), flush=True)


def stdin_says_stop() -> bool:
    """Whether the test wrote ``stop`` or closed stdin (read unbuffered: a ``select`` on a
    buffered ``sys.stdin`` misses what its buffer already holds)."""
    return bool(select.select([0], [], [], 0)[0])


def wait_for_go() -> None:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            raise SystemExit("stdin closed before go")
        line += chunk
    if line.strip() != b"go":
        raise SystemExit(f"expected go on stdin, got {line!r}")


def fresh_counts() -> dict[str, Any]:
    return {"restores": 0, "exact": 0, "late_restores": 0, "late_exact": 0, "retries": 0,
            "latest_none": 0, "errors": {}, "wrong": [], "steps": []}  # fmt: skip


def step_of(path: str) -> int:
    return int(path.rsplit("-", 1)[1])


def latest(tf_dir: str, counts: dict[str, Any]) -> str:
    """``tf.train.latest_checkpoint``, read again while it returns None.

    It does while CheckpointManager replaces the ``checkpoint`` file with a shorter one
    (after its sweep): TensorFlow's ``FileIO.read`` reads the file opened before for as
    many bytes as the path's new size, and the truncated text does not parse (a warning
    "Checkpoint ignored"). Each such miss is counted."""
    while (path := tf.train.latest_checkpoint(tf_dir)) is None:
        counts["latest_none"] += 1
    return str(path)


def wait_for_step(tf_dir: str, target: int, counts: dict[str, Any]) -> bool:
    """Wait until the latest checkpoint is ``ckpt-{target}`` or later (False: the test said
    stop first). Polls the ``checkpoint`` file that CheckpointManager rewrites."""
    while step_of(latest(tf_dir, counts)) < target:
        if stdin_says_stop():
            return False
        time.sleep(0.005)
    return True


def reader(config: dict[str, Any]) -> None:
    emb, step, ckpt = make_objects(config)
    # Made now: else the first restore to get this far makes it, and a failed restore
    # before leaves its checkpoint's value pending, read then: a removed checkpoint's.
    ckpt.save_counter  # noqa: B018
    counts = fresh_counts()
    wait_for_go()
    for i in itertools.count():
        if stdin_says_stop():
            break
        path = latest(config["tf_dir"], counts)
        late = i % LATE_EVERY == LATE_EVERY - 1
        lag = LATE_BY[i // LATE_EVERY % len(LATE_BY)]
        if late and not wait_for_step(config["tf_dir"], step_of(path) + lag, counts):
            break
        restore(config, (emb, step, ckpt), path, counts, "late_" if late else "")
    final = fresh_counts()  # the last checkpoint, with nothing saving beside it
    restore(config, (emb, step, ckpt), latest(config["tf_dir"], counts), final)
    counts["final_exact"] = final["exact"] == 1
    counts["wrong"] += final["wrong"]
    steps = counts.pop("steps")
    counts["distinct_steps"] = len(set(steps))
    print(json.dumps(counts), flush=True)


def restore(
    config: dict[str, Any], objects: tuple[Any, tf.Variable, Any], path: str,
    counts: dict[str, Any], kind: str = "",
) -> None:  # fmt: skip
    """Restore checkpoint ``path``; count it (``kind``: "" or "late_") exact, wrong, or
    retried with its error. A restore that fails must leave the variable as it was (empty
    when ``fresh``)."""
    emb, step, ckpt = objects
    if config["fresh"]:
        emb.clear()
    before = content(emb)
    counts[f"{kind}restores"] += 1
    try:
        ckpt.restore(path).expect_partial()
    except Exception as err:
        counts["retries"] += 1
        if _note_error(counts["errors"], err):
            traceback.print_exc()  # the first of each message, into the test's log
        after = content(emb)
        if not all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)):
            counts["wrong"].append(f"{path}: failed restore changed the variable ({err!r})")
        return
    problem = wrong_content(emb, step, step_of(path))
    if problem:
        counts["wrong"].append(f"{path}: {problem}")
    else:
        counts[f"{kind}exact"] += 1
        counts["steps"].append(step_of(path))


def wrong_content(emb: Any, step: tf.Variable, n: int) -> str | None:
    """What is wrong with the restored content, expected of step ``n``; None: exact."""
    keys, values = content(emb)
    want_keys, want_values = expected(n)
    if int(step.numpy()) != n:
        return f"TF step {int(step.numpy())}, expected {n}"
    if not np.array_equal(keys, want_keys):
        return f"{len(keys)} keys, not those of step {n}"
    if not np.array_equal(values, want_values):
        return f"the keys of step {n}, not all its values"
    return None


def _note_error(errors: dict[str, int], err: BaseException) -> bool:
    """Count ``err`` by ``"Class: message"``, numbers in the message as ``N`` (its cause's
    class too, when it has one); whether it is the first of its message."""
    cause = err.__cause__
    text = f"{type(err).__module__}.{type(err).__name__}: {str(err).strip()}"
    if cause is not None:
        text += f" [from {type(cause).__module__}.{type(cause).__name__}]"
    text = re.sub(r"\d+", "N", text)
    errors[text] = errors.get(text, 0) + 1
    return errors[text] == 1


if __name__ == "__main__":
    {"writer": writer, "reader": reader}[sys.argv[1]](json.loads(sys.argv[2]))
