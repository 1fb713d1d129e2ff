"""Docs and docstrings say what the code does and why; history lives in commit messages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Phrases that narrate history: a figure before and after, a session, a commit hash, an
#: experiment taken out again.
HISTORY = re.compile(
    r"went from [0-9]|[Ss]ession [0-9]|tried and taken out|taken out again|"
    r"\bcommit [0-9a-f]{7,40}\b|\b(was|were) [0-9.]+ ?m?s (before|earlier)"
)
#: docs/benchmarks.md keeps measured figures, each with the command that measures them.
SKIPPED = {ROOT / "docs" / "benchmarks.md"}


def narrated_files() -> list[Path]:
    """The package's modules, the benchmarks and every doc page (but benchmarks.md)."""
    paths = [ROOT / "README.md"]
    for folder in ("de_store", "backends", "formats", "docs", "benchmarks"):
        paths += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md"))
    return [path for path in paths if path not in SKIPPED]


def narrating_lines() -> list[str]:
    found = []
    for path in narrated_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_no_doc_or_docstring_narrates_history() -> None:
    assert narrating_lines() == []
