"""What TF's registered-saver hook does not pass on: ``experimental_io_device`` is honoured
for the export and the restore's staging, and ``Checkpoint.sync()`` raises a failed
background save's error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf
from saver_helpers import content, failing_async_checkpoint, fill, make_variable

import de_store as ds
from de_store.errors import CheckpointError, DestinationError

ELSEWHERE = "/job:localhost/replica:0/task:0/device:CPU:3"  # conftest makes 4 CPUs
NOWHERE = "/job:localhost/replica:0/task:0/device:CPU:9"


@pytest.fixture
def strict_placement() -> Iterator[None]:
    """A device that does not exist is an error, not silently CPU:0."""
    tf.config.set_soft_device_placement(False)
    yield
    tf.config.set_soft_device_placement(True)


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
def test_io_device_is_where_rows_are_exported_and_restored(
    tmp_path: Path, strict_placement: None, enable_async: bool
) -> None:
    var = make_variable("emb", ds.FileSystemSaver(), shards=2)
    fill(var, 500)
    expected = content(var)
    ckpt = tf.train.Checkpoint(emb=var)
    options = tf.train.CheckpointOptions(
        experimental_io_device=ELSEWHERE, enable_async=enable_async
    )
    path = ckpt.save(str(tmp_path / "ckpt"), options=options)
    ckpt.sync()
    restored = make_variable("emb", ds.FileSystemSaver(), shards=3)
    tf.train.Checkpoint(emb=restored).read(path, options=options)
    assert content(restored) == expected

    bad = tf.train.CheckpointOptions(experimental_io_device=NOWHERE)
    with pytest.raises(CheckpointError, match=r"experimental_io_device '.*CPU:9' cannot be"):
        tf.train.Checkpoint(emb=restored).read(path, options=bad)
    assert content(restored) == expected  # nothing applied


def test_the_export_runs_on_the_io_device(tmp_path: Path, strict_placement: None) -> None:
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 50)
    ckpt = tf.train.Checkpoint(emb=var)
    good = tf.train.CheckpointOptions(experimental_io_device=ELSEWHERE)
    ckpt.write(str(tmp_path / "first"), options=good)
    bad = tf.train.CheckpointOptions(experimental_io_device=NOWHERE)
    with pytest.raises(CheckpointError, match=r"experimental_io_device '.*CPU:9' cannot be"):
        ckpt.write(str(tmp_path / "ckpt"), options=bad)  # each save's own options
    assert sorted(p.name for p in (tmp_path / "de_store").iterdir()) == ["first"]


def test_async_save_failure_is_raised_on_sync_with_its_cause(tmp_path: Path) -> None:
    ckpt = failing_async_checkpoint(tmp_path)
    with pytest.raises(
        DestinationError,
        match=r"not-a-folder is a file, so the folders of .*"
        r"not-a-folder/kv/ckpt-1 cannot be created in it",
    ):
        ckpt.sync()
    ckpt.sync()  # raised once: the error is not kept
    good = make_variable("emb", ds.FileSystemSaver())
    fill(good, 10)
    options = tf.train.CheckpointOptions(enable_async=True)
    tf.train.Checkpoint(emb=good).save(str(tmp_path / "next"), options=options)


def test_async_saves_copy_through_a_function_traced_without_autograph(tmp_path: Path) -> None:
    """TF's async helper traces its copy function at a process's second async save, in the
    training thread; autograph would convert TF's own source first. Both saves hold the
    rows of their moment."""
    from tensorflow.python.checkpoint import async_checkpoint_helper as helper

    copy = helper.AsyncCheckpointHelper.__dict__["_copy_to_cpu"]
    assert isinstance(copy, tf.types.experimental.PolymorphicFunction)
    assert copy._autograph is False
    var = make_variable("emb", ds.FileSystemSaver())
    fill(var, 300)
    checkpoint = tf.train.Checkpoint(emb=var)
    options = tf.train.CheckpointOptions(enable_async=True)
    first = checkpoint.save(str(tmp_path / "ckpt"), options=options)
    expected_first = content(var)
    var.upsert(tf.constant([5000], tf.int64), tf.ones([1, 4]))
    second = checkpoint.save(str(tmp_path / "ckpt"), options=options)
    expected_second = content(var)
    checkpoint.sync()
    for prefix, expected in ((first, expected_first), (second, expected_second)):
        restored = make_variable("emb", ds.FileSystemSaver())
        tf.train.Checkpoint(emb=restored).read(prefix).assert_existing_objects_matched()
        assert content(restored) == expected
