"""What the CLI tests share besides fixtures: ``run``."""

from __future__ import annotations

import pytest

from de_store.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``de-store ARGV`` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
