"""kill -9 inside a save in TFRA's file layout (``Variable.save_to_file_system``,
``de_store.formats.tfra.write_table``): the folder always holds one whole save, never the
keys of one save beside the values of another.

A worker saves version 1 of a two-table variable, then version 2 through a FaultyFileSystem
that SIGKILLs it at the k-th storage call (both versions hold the same keys, so their files
have the same sizes and a mixed pair would load silently). A dry run records every call of
the second save. Killed before the save's commit record is written, the folder must load as
version 1, exactly; killed after it, as version 2, exactly; by ``tfra.read_table``, by
``Variable.load_from_file_system`` and by ``de-store convert``. The next save then
completes and leaves only TFRA's files.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from tfra_save_worker import DIM, KEYS, NAME, values

import de_store as ds
from de_store.cli import main
from de_store.formats import batch_from_numpy, batch_to_numpy, tfra

WORKER = str(Path(__file__).with_name("tfra_save_worker.py"))
Rows = dict[int, tuple[float, ...]]


def run_worker(config: dict[str, Any], *, killed: bool) -> None:
    proc = subprocess.Popen(
        [sys.executable, WORKER, json.dumps(config)], stderr=subprocess.PIPE, text=True
    )
    _, err = proc.communicate(timeout=120)
    if killed:
        assert proc.returncode == -signal.SIGKILL, f"not killed ({proc.returncode}): {err[-3000:]}"
    else:
        assert proc.returncode == 0, f"worker exited {proc.returncode}: {err[-3000:]}"


def version(v: int) -> Rows:
    return {int(k): tuple(r) for k, r in zip(KEYS.tolist(), values(v).tolist(), strict=True)}


def as_rows(keys: np.ndarray, rows: np.ndarray) -> Rows:
    return {int(k): tuple(r) for k, r in zip(keys.tolist(), rows.tolist(), strict=True)}


def read_by_table(folder: Path) -> Rows:
    keys, rows, _ = batch_to_numpy(tfra.read_table(str(folder), NAME, dim=DIM))
    assert len(keys) == len(KEYS)  # a key read twice would hide in the dict
    return as_rows(keys, rows)


def read_by_variable(folder: Path) -> Rows:
    variable = ds.Variable(NAME, dim=DIM)
    variable.load_from_file_system(str(folder))
    return as_rows(*(t.numpy() for t in variable.export()))


def read_by_convert(folder: Path, out: Path) -> Rows:
    assert main(["convert", "-q", str(folder), str(out), "--to", "parquet", "--dim", "4"]) == 0
    variable = ds.Variable(NAME, dim=DIM)
    ds.restore([variable], str(out))
    return as_rows(*(t.numpy() for t in variable.export()))


def dry_run(tmp_path: Path, *, variable: bool = False) -> list[list[str]]:
    trace = tmp_path / "trace.json"
    root = tmp_path / "dry"
    run_worker({"root": str(root), "trace_out": str(trace), "variable": variable}, killed=False)
    assert read_by_table(root) == version(2)
    calls = json.loads(trace.read_text())
    assert commit_call(calls) > 0
    return calls


def commit_call(trace: list[list[str]]) -> int:
    """The call (from 1) that makes the second save visible: the rename of its commit record
    into place (0: none)."""
    for k, (kind, _, path) in enumerate(trace, 1):
        if kind == "rename" and tfra.is_commit_record(path):
            return k
    return 0


def check_kill(tmp_path: Path, trace: list[list[str]], k: int, *, variable: bool = False) -> None:
    root = tmp_path / f"kill-{k}"
    run_worker({"root": str(root), "kill_at": ["any", k], "variable": variable}, killed=True)
    expected = version(1) if k <= commit_call(trace) else version(2)
    label = f"killed at call {k} {trace[k - 1]}"
    assert read_by_table(root) == expected, label
    assert read_by_variable(root) == expected, label
    assert read_by_convert(root, tmp_path / f"converted-{k}") == expected, label
    table = pa.Table.from_batches([batch_from_numpy(KEYS, values(3))])
    tfra.write_table(str(root), NAME, table, num_tables=2)  # the next save
    assert read_by_table(root) == version(3), label
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert names == sorted(
        f"{NAME}_mht_{i}of2_rank0_size1-{part}" for i in (1, 2) for part in ("keys", "values")
    ), label


def after_first_file(trace: list[list[str]]) -> int:
    """The call after the close of the first file written (the file is then in place)."""
    closes = (k for k, (kind, op, _) in enumerate(trace, 1) if (kind, op) == ("write", "close"))
    return next(closes) + 1


def representative(trace: list[list[str]]) -> list[int]:
    """After the first file is written; at the commit record's rename and right after it;
    after the first file is published over the old one; the last call of the save."""
    commit = commit_call(trace)
    publishes = [
        k
        for k, (kind, _, path) in enumerate(trace, 1)
        if kind == "rename" and not tfra.is_commit_record(path)
    ]
    return sorted({after_first_file(trace), commit, commit + 1, publishes[1], len(trace)})


def test_a_save_killed_at_its_main_points_leaves_one_whole_save(tmp_path: Path) -> None:
    trace = dry_run(tmp_path)
    for k in representative(trace):
        check_kill(tmp_path, trace, k)


def test_a_variable_killed_after_its_first_file_keeps_the_previous_save(tmp_path: Path) -> None:
    """A real ``Variable.save_to_file_system`` in a process killed right after the first file
    of its second save was written."""
    trace = dry_run(tmp_path, variable=True)
    check_kill(tmp_path, trace, after_first_file(trace), variable=True)


@pytest.mark.slow
def test_a_save_killed_at_any_call_leaves_one_whole_save(tmp_path: Path) -> None:
    trace = dry_run(tmp_path)
    points = [k for k, (kind, _, _) in enumerate(trace, 1) if kind != "chunk"]
    assert len(points) >= 8
    for k in points:
        check_kill(tmp_path, trace, k)
