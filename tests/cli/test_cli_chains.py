"""``de-store ls`` and ``verify`` on a chain of incremental checkpoints: tombstones are
counted apart from rows, and a delta whose chain is broken is listed as broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf
from cli_helpers import run

import de_store as ds


def build_chain(directory: Path) -> None:
    """``ckpt-1`` (full, 1000 keys), ``ckpt-2`` (5 rows upserted, 3 keys removed) and
    ``ckpt-3`` (2 rows upserted) saved on it."""
    variable = ds.Variable("emb", dim=2, devices=["/CPU:0"])
    keys = np.arange(1000, dtype=np.int64)
    variable.upsert(tf.constant(keys), tf.ones([1000, 2]))
    ds.save([variable], str(directory / "ckpt-1"), incremental=True, blocking=True)
    variable.upsert(tf.constant([1, 2, 3, 200, 201], tf.int64), tf.zeros([5, 2]))
    variable.remove(tf.constant([10, 11, 12], tf.int64))
    ds.save([variable], str(directory / "ckpt-2"), incremental=True, blocking=True)
    variable.upsert(tf.constant([4, 300], tf.int64), tf.zeros([2, 2]))
    ds.save([variable], str(directory / "ckpt-3"), incremental=True, blocking=True)


def test_verify_counts_tombstones_apart_from_rows(capsys, tmp_path: Path) -> None:
    build_chain(tmp_path)
    code, out, _ = run(capsys, "verify", str(tmp_path / "ckpt-2"))
    assert code == 0
    assert ", 5 rows and 3 removed keys (tombstones), every checksum matches" in out
    code, out, _ = run(capsys, "verify", str(tmp_path / "ckpt-1"))
    assert code == 0 and ", 1,000 rows, every checksum matches" in out


def test_ls_lists_the_deltas_of_a_broken_chain_as_broken(capsys, tmp_path: Path) -> None:
    build_chain(tmp_path)
    code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
    assert code == 0
    assert {s["path"]: s["status"] for s in json.loads(out)} == {
        "ckpt-1": "committed",
        "ckpt-2": "committed",
        "ckpt-3": "committed",
    }
    shutil.rmtree(tmp_path / "ckpt-1")  # the full checkpoint both deltas are saved on
    code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
    assert code == 0
    assert {s["path"]: s["status"] for s in json.loads(out)} == {
        "ckpt-2": "broken",
        "ckpt-3": "broken",
    }
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["ckpt-2", "broken"],
        ["ckpt-3", "broken"],
    ]
    code, out, _ = run(capsys, "ls", "--json", str(tmp_path / "ckpt-3"))  # the delta itself
    assert [s["status"] for s in json.loads(out)] == ["broken"]


def test_ls_lists_a_delta_on_a_rewritten_checkpoint_as_broken(capsys, tmp_path: Path) -> None:
    build_chain(tmp_path)
    other = ds.Variable("emb", dim=2, devices=["/CPU:0"])
    other.upsert(tf.constant([7], tf.int64), tf.ones([1, 2]))
    ds.save([other], str(tmp_path / "ckpt-2"), blocking=True)  # ckpt-2 replaced: a full one
    code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
    assert code == 0
    assert {s["path"]: (s["status"], s["kind"]) for s in json.loads(out)} == {
        "ckpt-1": ("committed", "full"),
        "ckpt-2": ("committed", "full"),
        "ckpt-3": ("broken", "delta"),
    }
