"""The Keras 2 tests (``tests/keras2``) in a pytest process of their own.

TensorFlow decides which Keras ``tf.keras`` is from ``TF_USE_LEGACY_KERAS`` when it first
uses it, so one process cannot test both Kerases: this test starts the Keras 2 run, with
the variable set, and fails with its output when any of its tests fails. The README's test
command (and so CI) runs both Kerases through it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_keras_2_tests_pass_in_their_own_process() -> None:
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1"}
    # one process: this test runs beside the rest of the suite (pytest addopts: -n 2)
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
               "tests/keras2"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    output = result.stdout[-8000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), output
    assert not re.search(r"skipped|xfail|deselected|error", summary), summary
