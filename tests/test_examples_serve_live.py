"""examples/serve_live.py runs as its docstring says: a trainer process saves checkpoints,
the example's process follows them, prints one line per checkpoint it serves, and ends
serving exactly the trainer's last committed checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import de_store as ds
from examples.serve_live import digest

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(
    r"serving ckpt-(\d+): ([\d,]+) keys, ([\d,]+) rows changed, staleness \d+\.\d\d s"
)
#: Three deltas of 1,024 keys stay under half the full checkpoint's bytes: the default
#: IncrementalPolicy saves them all as deltas.
KEYS, SAVES = 1024, 3
#: Each delta of the example moves 10 rows, adds 4 ids and removes 2: 16 rows changed and
#: 2 keys more.
CHANGED, GROWTH = 16, 2


def test_serve_live_serves_the_trainers_last_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    command = [sys.executable, str(ROOT / "examples" / "serve_live.py"), "--root", str(root),
               "--keys", str(KEYS), "--saves", str(SAVES), "--interval", "0.2",
               "--seconds", "600"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    *serving, trained, served = done.stdout.splitlines()

    parsed = [SERVING.fullmatch(line) for line in serving]
    assert serving and all(parsed), done.stdout
    lines = [[int(g.replace(",", "")) for g in m.groups()] for m in parsed if m]
    steps = [step for step, _, _ in lines]
    assert steps == sorted(set(steps)) and steps[-1] == SAVES, done.stdout
    for i, (step, keys, changed) in enumerate(lines):
        # the first line applies ckpt-0 whole (and the deltas after it, if any came first)
        before = steps[i - 1] if i else 0
        assert changed == CHANGED * (step - before) + (0 if i else KEYS), done.stdout
        # the table is live: a line's count may already hold part of the next delta
        assert KEYS + GROWTH * step - 2 <= keys <= KEYS + GROWTH * SAVES, done.stdout
    assert lines[-1][1] == KEYS + GROWTH * SAVES, done.stdout

    digest_of = re.compile(r"(?:trainer saved|server serves) (ckpt-\d+), digest ([0-9a-f]{16})")
    trainer_side, server_side = digest_of.fullmatch(trained), digest_of.fullmatch(served)
    assert trainer_side and server_side, done.stdout
    assert trainer_side.group(1) == server_side.group(1) == f"ckpt-{SAVES}"
    restored = ds.Variable("embedding", dim=8)
    ds.restore([restored], str(root / f"ckpt-{SAVES}"))
    assert trainer_side.group(2) == server_side.group(2) == digest(restored)
