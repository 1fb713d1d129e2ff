"""Ctrl-C (SIGINT) during a blocking save, in a real process: the save stops before its
commit, the previous checkpoint stays, and the process ends with the KeyboardInterrupt."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import de_store as ds

WORKER = str(Path(__file__).with_name("interrupt_worker.py"))
STOPPING = "interrupted (KeyboardInterrupt): stopping it"


def wait_for_file(path: Path, proc: subprocess.Popen[str], lines: list[str]) -> None:
    """Until ``path`` exists; fails (with the worker's output) if the worker ends first."""
    while not path.exists():
        assert proc.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.05)


def read_lines(proc: subprocess.Popen[str], out: queue.Queue[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        out.put(line)


def interrupt_at_the_barrier(mode: str, url: str, gate: Path) -> tuple[int, str]:
    """Run the worker, SIGINT it while its second save is held at the barrier; open the
    gate once it reacted (or, when it never says so, after a minute); its exit code, stderr."""
    proc = subprocess.Popen([sys.executable, WORKER, mode, url, str(gate)],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: queue.Queue[str] = queue.Queue()
    lines: list[str] = []
    reader = threading.Thread(target=read_lines, args=(proc, seen, lines), daemon=True)
    reader.start()
    wait_for_file(gate / "at-barrier", proc, lines)
    proc.send_signal(signal.SIGINT)
    if mode == "save":  # the save runs in a background thread: wait until it was told
        try:
            while STOPPING not in seen.get(timeout=60):
                pass
        except queue.Empty:
            pass  # it never said so: opening the gate shows what it does instead
    (gate / "go").write_text("")
    proc.wait(timeout=120)
    reader.join(30)
    return proc.returncode, "".join(lines)


def restored_rows(url: str) -> np.ndarray:
    var = ds.Variable("emb", dim=4)
    ds.restore([var], url)
    keys, values = (t.numpy() for t in var.export())
    return values[np.argsort(keys)]


@pytest.mark.parametrize("mode", ["save", "tf"])
def test_ctrl_c_during_a_blocking_save_commits_nothing(tmp_path: Path, mode: str) -> None:
    url, gate = str(tmp_path / "kv"), tmp_path / "gate"
    gate.mkdir()
    code, err = interrupt_at_the_barrier(mode, url, gate)
    assert code == -signal.SIGINT, err[-3000:]
    assert "KeyboardInterrupt" in err
    kv = url if mode == "save" else f"{url}/ckpt"
    keys = np.arange(-50, 50, dtype=np.float32)
    np.testing.assert_array_equal(restored_rows(kv), np.repeat(keys[:, None], 4, axis=1) + 1)
    aborts = list(Path(f"{kv}.pending").glob("*/ABORT"))
    assert len(aborts) == 1, sorted(Path(kv).parent.rglob("*"))
    reason = json.loads(aborts[0].read_text())["reason"]
    expected = "SaveInterruptedError" if mode == "save" else "KeyboardInterrupt"
    assert reason.startswith(f"rank 0 failed before commit: {expected}("), reason
