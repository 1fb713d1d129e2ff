"""The package stays lint-clean and typed: ruff and mypy as configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", "de_store", "backends", "formats", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_finds_nothing() -> None:
    result = run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"))
    assert result.returncode == 0, result.stdout[-4000:]
