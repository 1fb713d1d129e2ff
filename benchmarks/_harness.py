"""What the benchmark scripts share: timing, cold reads, and figures passed between phases.

A script that runs phases in fresh processes prints each phase's figures as one line
``RESULT {json}`` (:func:`emit`) and reads them back with :func:`result_of`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

RESULT_TAG = "RESULT "


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def drop_cache(root: str) -> None:
    """Evict a file, or every file under a folder, from the page cache (fsynced first), so
    that the next read is cold."""
    paths = [root] if os.path.isfile(root) else []
    for folder, _, files in os.walk(root):
        paths += [os.path.join(folder, f) for f in files]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def emit(result: dict[str, Any]) -> None:
    """Print a phase's figures for the parent process."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_phase(script: str, phase: str, options: list[str]) -> dict[str, Any]:
    """Run ``script --phase phase *options`` in a fresh Python process; return the figures
    it printed (its output and an error if it failed)."""
    command = [sys.executable, os.path.abspath(script), "--phase", phase, *options]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return _result_of(done, phase)


def _result_of(done: subprocess.CompletedProcess[str], phase: str) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"phase {phase!r} failed with exit status {done.returncode}")
    return dict(json.loads(lines[-1][len(RESULT_TAG) :]))
