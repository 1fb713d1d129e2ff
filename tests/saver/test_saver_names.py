"""Two variables of one name saved together are refused, naming both, before any write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import fill, make_variable

import de_store as ds
from de_store.backends import open_backend
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.topology import Topology
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.rows import ShardRows, VariableRows


def rows_named(name: str) -> VariableRows:
    keys = np.arange(4, dtype=np.int64)
    shard = ShardRows(keys, {"value": np.ones((4, 2), np.float32)})
    return VariableRows(name, "int64", "float32", 2, {"value": ColumnSpec("float32", 2)}, [shard])


def test_de_store_save_refuses_two_variables_of_one_name(tmp_path: Path) -> None:
    first, second = make_variable("emb", None), make_variable("emb", None)
    fill(first, 10)
    fill(second, 10, start=500)
    url = str(tmp_path / "step-1")
    both = r"step-1: variables\[0\] and variables\[1\] are both named 'emb'; the variables"
    with pytest.raises(ValueError, match=both + " of one checkpoint need distinct names"):
        ds.save([first, second], url, blocking=True)
    assert list(tmp_path.iterdir()) == []


def test_tf_checkpoint_refuses_two_variables_of_one_name(tmp_path: Path) -> None:
    saver = ds.FileSystemSaver()
    first, second = make_variable("emb", saver), make_variable("emb", saver)
    fill(first, 10)
    fill(second, 10, start=500)
    model = tf.Module()
    model.inner = tf.Module()
    model.inner.user = first
    ckpt = tf.train.Checkpoint(model=model, item=second)
    both = r"de_store/ckpt: item and model/inner/user are both named 'emb'"
    with pytest.raises(ValueError, match=both):
        ckpt.write(str(tmp_path / "ckpt"))
    assert list(tmp_path.iterdir()) == []


def test_save_checkpoint_refuses_rows_of_one_name(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    with pytest.raises(ValueError, match=r"variables\[0\] and variables\[2\] are both named 'a'"):
        save_checkpoint([rows_named("a"), rows_named("b"), rows_named("a")], backend, "B",
                        Topology(1, 0), IOOptions())  # fmt: skip
    assert list(tmp_path.iterdir()) == []
