"""``de-store demo``: the README's first command, run as a user runs it (smaller sizes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_trains_saves_async_reshards_and_checks(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    result = subprocess.run(
        ["de-store", "demo", str(folder), "--steps", "20", "--ids", "20000"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "saved 2 shards asynchronously" in out and "restored into 3 shards" in out
    assert re.search(r"^OK: 20,000 keys", out, re.M), out
    (checkpoint,) = re.findall(r"de-store verify (\S+)", out)
    assert checkpoint == str(folder / "de_store" / "ckpt-20")
    verify = subprocess.run(["de-store", "verify", checkpoint], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    snippet = re.findall(r"^      (import pyarrow.*?|table = .*?|print\(.*?)$", out, re.M)
    assert len(snippet) == 3
    exec("\n".join(snippet), {})  # the printed pyarrow snippet opens the shard
