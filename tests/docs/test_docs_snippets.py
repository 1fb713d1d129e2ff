"""Every ```python block of README.md and docs/*.md runs, and docs/cli.md covers the command.

The blocks must not make TensorFlow warn about retracing a ``tf.function``.

The blocks of one file run in order in one fresh process (one ``import tensorflow`` per
file), each in its own namespace, from a temporary working directory; a block whose first
line is ``# in a new process`` and the blocks after it run in a second process, in the same
directory. Blocks that are not meant to run carry another tag (```bash, ```text, ```py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

_NEW_PROCESS = "# in a new process\n"
_RUNNER = """
import sys
for index, block in enumerate(BLOCKS, FIRST):
    try:
        exec(compile(block, f"{PAGE} block {index + 1}", "exec"), {"__name__": "__main__"})
    except Exception:
        print(f"{PAGE}: block {index + 1} failed:\\n{block}", file=sys.stderr)
        raise
"""


def python_blocks(page: Path) -> list[str]:
    return _BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_snippets_run(page: Path, tmp_path: Path) -> None:
    for first, blocks in processes(python_blocks(page)):
        script = f"PAGE = {page.name!r}\nFIRST = {first}\nBLOCKS = {blocks!r}\n{_RUNNER}"
        result = run_python(script, tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        # TensorFlow logs this through Python's logging whatever TF_CPP_MIN_LOG_LEVEL says
        retraced = [line for line in result.stderr.splitlines() if "triggered tf.function" in line]
        assert retraced == [], retraced


def processes(blocks: list[str]) -> list[tuple[int, list[str]]]:
    """The blocks split where one starts with ``# in a new process``: (index of the
    first block, blocks) for each process."""
    starts = [0] + [i for i, b in enumerate(blocks) if i and b.startswith(_NEW_PROCESS)]
    return [(s, blocks[s:e]) for s, e in zip(starts, [*starts[1:], len(blocks)], strict=True)]


def test_keras_page_restores_in_a_second_process() -> None:
    blocks = python_blocks(ROOT / "docs" / "keras.md")
    assert [first for first, _ in processes(blocks)] == [0, 1]


def test_readme_shard_snippet_reads_the_demo_checkpoint(tmp_path: Path) -> None:
    """Pointed at the demo's checkpoint, as its comment says, it prints the demo's rows."""
    (block,) = [b for b in python_blocks(ROOT / "README.md") if "pyarrow" in b]
    demo = "de_store_demo/de_store/ckpt-2"  # what `de-store demo` writes, at step 2
    assert "sample_checkpoint()" in block and "de_store_demo/de_store/ckpt-200" in block
    script = (
        "from de_store.demo import run\n"
        "assert run('de_store_demo', steps=2, ids=1000, say=lambda line: None)\n"
        "print('--- snippet')\n"
    ) + block.replace("sample_checkpoint()", repr(demo))
    result = run_python(script, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    printed = result.stdout.split("--- snippet\n")[1]
    assert printed.startswith("ctr_weights 1000 key: int64"), printed


def run_python(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter in ``cwd``, TensorFlow's C++ logs off."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", **_python_env()},
    )


def _python_env() -> dict[str, str]:
    import os

    keep = ("HOME", "PATH", "PYTHONPATH", "VIRTUAL_ENV", "PYENV_VERSION")
    return {k: os.environ[k] for k in keep if k in os.environ}


def test_every_command_and_option_is_documented() -> None:
    from de_store.cli import _parser

    doc = (ROOT / "docs" / "cli.md").read_text()
    parser = _parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    for name, command in sub.choices.items():
        assert f"`de-store {name}" in doc, name
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in doc, f"de-store {name} {flag}"


def test_readme_starts_with_the_two_setup_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[3:5] == [
        "python -m pip install -e . && de-store demo",
        'python -m pip install -e ".[test]" && python -m pytest',
    ]
    for link in re.findall(r"\]\((docs/[^)]+)\)", "\n".join(lines)):
        assert (ROOT / link).exists(), link
