"""A process whose blocking save is interrupted (SIGINT) after its shards are written.

    python interrupt_worker.py MODE URL GATE_DIR

It saves version 1 of a variable into ``URL`` (with ``MODE`` "tf": TF checkpoint
``GATE_DIR/ckpt``, its KV checkpoint ``URL/ckpt``), then version 2 to the same place
through a barrier that writes ``GATE_DIR/at-barrier`` and holds the save there (shards
written, nothing committed) until ``GATE_DIR/go`` exists. ``MODE``: "save"
(``de_store.save(blocking=True)``) or "tf" (``tf.train.Checkpoint.write``).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import de_store as ds
from de_store.checkpoint.barrier import Barrier

# The test interrupts this process with SIGINT: a parent that ignores SIGINT (nohup, a
# background job of a non-interactive shell) passes that on, and Python then installs no
# KeyboardInterrupt handler of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)

KEYS = np.arange(-50, 50, dtype=np.int64)


def rows(version: int) -> np.ndarray:
    return np.repeat(KEYS[:, None].astype(np.float32), 4, axis=1) + np.float32(version)


class GateBarrier(Barrier):
    """Holds the save at the barrier until the test opens the gate."""

    def __init__(self, gate: pathlib.Path) -> None:
        self.gate = gate
        self.armed = False

    def wait(self, tag: str, timeout_s: float) -> None:
        if not self.armed:
            return
        (self.gate / "at-barrier").write_text(tag)
        while not (self.gate / "go").exists():  # the test sends SIGINT, then opens it
            time.sleep(0.01)


def main(mode: str, url: str, gate_dir: str) -> None:
    barrier = GateBarrier(pathlib.Path(gate_dir))
    saver = ds.FileSystemSaver(barrier=barrier, **({"save_path": url} if mode == "tf" else {}))
    var = ds.Variable("emb", dim=4, kv_creator=ds.HashTableCreator(saver=saver))
    ckpt = tf.train.Checkpoint(emb=var)
    for version in (1, 2):
        barrier.armed = version == 2
        var.upsert(KEYS, rows(version))
        if mode == "tf":
            ckpt.write(f"{gate_dir}/ckpt")
        else:
            ds.save([var], url, saver=saver, blocking=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
