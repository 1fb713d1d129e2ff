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


def test_every_package_folder_ships_in_the_wheel() -> None:
    """pyproject.toml lists the packages a wheel holds: every folder of de_store (and the
    top-level backends, formats and examples it ships as subpackages) with an
    ``__init__.py`` is listed, so an installed de_store imports as an editable one does."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for name, folder in folders.items()
        for init in folder.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert sorted(found) == sorted(config["packages"])
