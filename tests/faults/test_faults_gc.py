"""Cleanup never loses a checkpoint (issue 17, items 1, 2, 3 and 6).

``de-store gc`` deletes only de_store's abandoned staging, in a folder of checkpoints,
older than its grace period and still abandoned right before the deletion; the cleanup
inside a TF save trusts no absolute path and no user metadata; a TF checkpoint restores
only the KV checkpoint saved with it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from fsspec.implementations.local import LocalFileSystem

import de_store as ds
from de_store.backends import open_backend, open_location
from de_store.checkpoint import _tf_bundle, gc, names
from de_store.checkpoint.barrier import Barrier
from de_store.checkpoint.commit import committed_folder
from de_store.checkpoint.topology import Topology
from de_store.cli import main
from de_store.errors import CheckpointMismatchError, GCRefusedError, SaveInterruptedError
from de_store.saver import core, incremental
from de_store.testing.faults import FaultPlan, FaultyFileSystem
from tests.conftest import StorageLocation

DIM = 4
OLD = time.time() - 7200  # older than the default grace period (1 hour)


def variable(name: str = "emb", saver: ds.FileSystemSaver | None = None) -> ds.Variable:
    return ds.Variable(
        name,
        key_dtype=tf.int64,
        value_dtype=tf.float32,
        dim=DIM,
        kv_creator=ds.HashTableCreator(saver=saver),
    )


def filled(value: float, saver: ds.FileSystemSaver | None = None) -> ds.Variable:
    var = variable(saver=saver)
    var.upsert(tf.range(10, dtype=tf.int64), tf.fill([10, DIM], value))
    return var


def values_of(var: ds.Variable) -> set[float]:
    return set(np.unique(var.export()[1].numpy()).tolist())


def restored_value(url: str, options: dict | None = None) -> set[float]:
    var = variable()
    ds.restore([var], url, storage_options=options or {})
    return values_of(var)


def tf_restored_value(prefix: str, saver: ds.FileSystemSaver | None = None) -> set[float]:
    var = variable(saver=saver or ds.FileSystemSaver())
    tf.train.Checkpoint(emb=var).read(prefix).expect_partial()
    return values_of(var)


def age(path: Path, when: float = OLD) -> None:
    """Set the modification time of every file under ``path`` to ``when``."""
    for file in [path, *path.rglob("*")]:
        os.utime(file, (when, when))


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def gc_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["gc", *argv])
    out, err = capsys.readouterr()
    return code, out, err


class StopAtBarrier(Barrier):
    """Sets ``cancel`` when the ranks meet after writing: the save stops before its commit
    with everything but the commit written (what a crash right before it leaves)."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel

    def wait(self, tag: str, timeout_s: float) -> None:
        self.cancel.set()


def interrupted_save(
    url: str,
    options: dict | None = None,
    job_id: str | None = None,
    *,
    format: str = "parquet",
    slots: tuple[str, ...] = (),
) -> None:
    """A save of ``url`` that wrote its shards and rank manifest, then stopped; the
    variable carries a companion column for each of ``slots``."""
    backend, name = open_location(url, options or {})
    var = filled(9.0)
    for slot in slots:
        var.companion(slot, DIM, tf.float32).upsert(tf.range(10, dtype=tf.int64),
                                                    tf.fill([10, DIM], 2.0))  # fmt: skip
    rows = incremental.snapshots([var], None, url)
    cancel = threading.Event()
    with pytest.raises(SaveInterruptedError):
        core.save_checkpoint(rows, backend, name, Topology(1, 0), core.IOOptions(format=format),
                             barrier=StopAtBarrier(cancel), cancel=cancel,
                             job_id=job_id)  # fmt: skip


# --- item 1: gc deletes only de_store's abandoned staging, where it may work -------------
def tf_run(run: Path, steps: int = 2) -> None:
    """A TF run folder: ``ckpt-N`` TF checkpoints, their KV data in ``de_store/``."""
    for step in range(1, steps + 1):
        tf.train.Checkpoint(emb=filled(float(step), ds.FileSystemSaver())).write(
            str(run / f"ckpt-{step}")
        )


def test_gc_refuses_the_tf_folder_holding_de_store_and_a_users_project(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    project = tmp_path / "myproject"
    run = project / "runs" / "r1"
    tf_run(run)
    for folder in ("src", "data", "runs/r1/notes"):
        (project / folder).mkdir(parents=True, exist_ok=True)
        (project / folder / "file.txt").write_text("user data")
    age(project)
    before = tree(project)
    for url, holder in ((run, run / "de_store"), (project, run / "de_store")):
        code, out, err = gc_cli(capsys, "--yes", "--grace", "0", str(url))
        assert code == 1 and out == ""
        assert err == (
            f"de-store: error: refusing to gc {url}: it holds the committed checkpoint "
            f"{holder}/ckpt-1 below its direct children; gc works on a folder of checkpoints:"
            f" point it at {holder}\n"
        )
    assert tree(project) == before
    assert tf_restored_value(str(run / "ckpt-2")) == {2.0}


def test_gc_refuses_a_committed_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ds.save([filled(1.0)], str(tmp_path / "ckpt-1"), blocking=True)
    age(tmp_path)
    before = tree(tmp_path)
    code, out, err = gc_cli(capsys, "--yes", "--grace", "0", str(tmp_path / "ckpt-1"))
    assert code == 1 and out == ""
    assert err.startswith(f"de-store: error: refusing to gc {tmp_path / 'ckpt-1'}: it is a ")
    assert "checkpoint itself" in err
    assert tree(tmp_path) == before
    assert restored_value(str(tmp_path / "ckpt-1")) == {1.0}


def test_gc_in_a_folder_without_checkpoints_deletes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for folder in ("src", "data", "build.pending", "x.replaced-abc"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "main.py").write_text("print(1)")
    age(tmp_path)
    before = tree(tmp_path)
    code, out, _ = gc_cli(capsys, "--yes", "--grace", "0", str(tmp_path))
    assert (code, out) == (0, f"removed 0 item(s) under {tmp_path}\n")
    assert tree(tmp_path) == before


def test_gc_on_a_missing_path_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = gc_cli(capsys, "--yes", str(tmp_path / "nothing"))
    assert (code, out, err) == (1, "", f"de-store: error: {tmp_path / 'nothing'} does not exist\n")


def test_gc_lists_without_yes_and_deletes_only_de_stores_staging_with_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kv = tmp_path / "run" / "de_store"
    tf_run(tmp_path / "run")
    interrupted_save(str(kv / "ckpt-3"))  # leaves ckpt-3.pending/<token>/ with LOCK, shards
    (kv / "notes").mkdir()
    (kv / "notes" / "todo.txt").write_text("user data")
    (kv / "mine.pending").mkdir()
    (kv / "mine.pending" / "todo.txt").write_text("a user's folder named like staging")
    age(tmp_path)
    before = tree(kv)
    code, out, _ = gc_cli(capsys, str(kv))
    assert code == 0
    assert out == (
        "would remove ckpt-3.pending: staging folder of a save that never committed\n"
        f"would remove 1 item(s) under {kv} (run again with --yes to delete)\n"
    )
    assert tree(kv) == before
    code, out, _ = gc_cli(capsys, "--yes", str(kv))
    assert code == 0
    assert out == (
        "removed ckpt-3.pending: staging folder of a save that never committed\n"
        f"removed 1 item(s) under {kv}\n"
    )
    assert sorted(p.name for p in kv.iterdir()) == ["ckpt-1", "ckpt-2", "mine.pending", "notes"]
    assert tree(kv) == [p for p in before if not p.startswith("ckpt-3.pending/")]
    assert tf_restored_value(str(tmp_path / "run" / "ckpt-1")) == {1.0}


FORMATS_AND_SLOTS = [
    (fmt, slots)
    for fmt in ("parquet", "arrow", "binary")
    for slots in ((), ("adam_m", "adam_v"), ("adagrad_accumulator", "my.slot_2"))
]


@pytest.mark.parametrize(("fmt", "slots"), FORMATS_AND_SLOTS)
def test_gc_removes_the_staging_of_every_format_and_slot_column(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, slots: tuple[str, ...]
) -> None:
    kv = tmp_path / "kv"
    ds.save([filled(1.0)], str(kv / "A"), blocking=True)
    interrupted_save(str(kv / "B"), format=fmt, slots=slots)
    staged = tree(kv / "B.pending")
    for slot in slots if fmt == "binary" else ():  # a file per slot column, written
        assert any(path.endswith(f"-{slot}") for path in staged), staged
    age(kv)
    code, out, _ = gc_cli(capsys, "--yes", str(kv))
    assert code == 0
    assert out.splitlines() == [
        "removed B.pending: staging folder of a save that never committed",
        f"removed 1 item(s) under {kv}",
    ]
    assert sorted(p.name for p in kv.iterdir()) == ["A"]
    assert restored_value(str(kv / "A")) == {1.0}


def test_gc_removes_the_staging_of_a_ps_task_that_died_in_its_bundle_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A parameter server writes each file of its binary shard as a TensorFlow bundle that
    the saving process renames: a task killed midway leaves bundles, complete or under
    TensorFlow's temporary names (tests/distribute/test_ps_killed.py kills one for real,
    with one of those states). Every such name is the save's; another bundle is not."""
    kv = tmp_path / "kv"
    ds.save([filled(1.0)], str(kv / "A"), blocking=True)
    for name, foreign in (("B", False), ("C", True)):
        interrupted_save(str(kv / name), format="binary", slots=("adagrad_accumulator",))
        (folder,) = (kv / f"{name}.pending").glob("*/emb")
        for column in ("keys", "values", "adagrad_accumulator"):
            prefix = names.bundle_prefix(str(folder / f"r00000-s00001-0a1b2c3d-{column}"))
            for file in (_tf_bundle.index_path(prefix), _tf_bundle.data_path(prefix)):
                Path(file).write_bytes(b"written")
                Path(f"{file}{_tf_bundle.TEMP_INFIX}13622185587429183187").write_bytes(b"half")
        if foreign:  # a bundle of two shards: not one a save writes
            Path(f"{prefix}.data-00000-of-00002").write_bytes(b"")
    age(kv)
    code, out, _ = gc_cli(capsys, "--yes", str(kv))
    assert code == 0
    assert out.splitlines() == [
        "removed B.pending: staging folder of a save that never committed",
        f"removed 1 item(s) under {kv}",
    ]
    assert sorted(p.name for p in kv.iterdir()) == ["A", "C.pending"]
    assert restored_value(str(kv / "A")) == {1.0}


def test_gc_removes_the_bundle_indexes_of_a_restore_killed_midway_but_never_the_shards(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A restore into parameter-server tasks reads the shard files through bundle indexes
    and symlinks it writes in ``.restore-*`` of the checkpoint folder; a process killed
    while restoring leaves them. gc removes the folder (its links, not the files they
    point to) and keeps one holding a file of another name."""
    kv = tmp_path / "kv"
    ds.save([filled(1.0)], str(kv / "A"), blocking=True)
    ds.save([filled(2.0)], str(kv / "B"), blocking=True)
    for name, foreign in (("A", False), ("B", True)):
        (shard, *_) = (kv / name).glob("emb/*.parquet")
        scratch = Path(tempfile.mkdtemp(prefix=names.RESTORE_SCRATCH_PREFIX, dir=kv / name))
        for index in range(2):
            prefix = str(scratch / f"{index:06d}-0")
            Path(_tf_bundle.index_path(prefix)).write_bytes(b"index")
            os.symlink(shard, _tf_bundle.data_path(prefix))
        if foreign:
            (scratch / "notes.txt").write_text("a user's file")
    age(kv)
    before = tree(kv)
    (removed,) = (kv / "A").glob(".restore-*")
    code, out, _ = gc_cli(capsys, "--yes", str(kv))
    assert code == 0
    assert out.splitlines() == [
        f"removed A/{removed.name}: bundle indexes of a restore that did not finish",
        f"removed 1 item(s) under {kv}",
    ]
    assert tree(kv) == [p for p in before if not p.startswith(f"A/{removed.name}/")]
    assert restored_value(str(kv / "A")) == {1.0}
    assert restored_value(str(kv / "B")) == {2.0}


@pytest.mark.parametrize(("fmt", "slots"), FORMATS_AND_SLOTS)
def test_gc_on_s3_removes_the_shard_files_of_every_format_and_slot_column(
    s3_location: StorageLocation, fmt: str, slots: tuple[str, ...]
) -> None:
    root, options = s3_location.url, s3_location.storage_options
    ds.save([filled(1.0)], f"{root}/A", blocking=True, storage_options=options)
    backend = open_backend(root, options)
    committed = backend.list("A")
    interrupted_save(f"{root}/A", options, format=fmt, slots=slots)  # an uncommitted rewrite
    interrupted_save(f"{root}/B", options, format=fmt, slots=slots)  # a save never committed
    left = sorted(set(backend.list("A")) - set(committed))
    for slot in slots if fmt == "binary" else ():
        assert any(path.endswith(f"-{slot}") for path in left), left
    removed = gc.collect(backend, grace_s=0)
    shard_files = 2 + len(slots) if fmt == "binary" else 1  # binary: a file per column
    assert sorted(g.kind for g in removed) == ["attempt", *["shard"] * shard_files,
                                               "uncommitted"]  # fmt: skip
    assert backend.list("A") == committed
    assert sorted({p.split("/", 1)[0] for p in backend.list("")}) == ["A"]
    assert restored_value(f"{root}/A", options) == {1.0}


def test_gc_on_s3_deletes_an_uncommitted_folder_and_refuses_a_checkpoint(
    capsys: pytest.CaptureFixture[str], s3_location: StorageLocation
) -> None:
    root, options = s3_location.url, s3_location.storage_options
    ds.save([filled(1.0)], f"{root}/A", blocking=True, storage_options=options)
    interrupted_save(f"{root}/B", options)
    backend = open_backend(root, options)
    assert committed_folder(backend, "B") is None and backend.list("B")
    flags = ["--storage-options", json.dumps(options)]
    code, _, err = gc_cli(capsys, *flags, "--yes", "--grace", "0", f"{root}/A")
    assert code == 1 and "it is a checkpoint itself" in err
    code, out, _ = gc_cli(capsys, *flags, "--yes", "--grace", "0", root)
    assert code == 0 and out.splitlines() == [
        "removed B: no commit record and only files of a save: a save that never committed",
        f"removed 1 item(s) under {root}",
    ]
    assert sorted({p.split("/", 1)[0] for p in backend.list("")}) == ["A"]
    assert restored_value(f"{root}/A", options) == {1.0}


def test_gc_on_s3_deletes_a_failed_rewrites_files_but_not_the_committed_ones(
    s3_location: StorageLocation,
) -> None:
    root, options = s3_location.url, s3_location.storage_options
    ds.save([filled(1.0)], f"{root}/A", blocking=True, storage_options=options)
    backend = open_backend(root, options)
    committed = backend.list("A")
    interrupted_save(f"{root}/A", options)  # a rewrite that never committed
    left = sorted(set(backend.list("A")) - set(committed))
    assert left and all(p.startswith("A/emb/") or p.startswith("A/_ranks/") for p in left)
    removed = gc.collect(backend, grace_s=0)
    assert sorted(g.kind for g in removed) == ["attempt", "shard"]
    assert backend.list("A") == committed
    assert restored_value(f"{root}/A", options) == {1.0}


# --- item 2: a grace period, and a second look right before each deletion --------------
def test_gc_keeps_staging_younger_than_the_grace_period(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ds.save([filled(1.0)], str(tmp_path / "ckpt-1"), blocking=True)
    interrupted_save(str(tmp_path / "ckpt-2"))
    interrupted_save(str(tmp_path / "ckpt-3"))
    age(tmp_path / "ckpt-2.pending")
    age(tmp_path / "ckpt-3.pending", time.time() - 600)  # 10 minutes: a save may still run
    code, out, _ = gc_cli(capsys, "--yes", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "removed ckpt-2.pending: staging folder of a save that never committed"
    assert lines[1].startswith("kept ckpt-3.pending: modified 60")
    assert lines[1].endswith(" s ago, within the grace period of 3600 s")
    assert lines[2:] == [f"removed 1 item(s) under {tmp_path}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "ckpt-3.pending"]
    code, out, _ = gc_cli(capsys, "--yes", "--grace", "300", str(tmp_path))
    assert code == 0 and out.startswith("removed ckpt-3.pending: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]
    code, _, err = gc_cli(capsys, "--grace", "-1", str(tmp_path))
    assert code == 2 and "--grace: must be a number of seconds >= 0, got '-1'" in err


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_save_that_commits_after_gc_planned_keeps_its_data(
    request: pytest.FixtureRequest, store: str
) -> None:
    location: StorageLocation = request.getfixturevalue(f"{store}_location")
    root, options = location.url, location.storage_options
    backend = open_backend(root, options)
    ds.save([filled(1.0)], f"{root}/A", blocking=True, storage_options=options)
    interrupted_save(f"{root}/B", options, job_id="job-7")
    planned = gc.plan(backend, grace_s=0)
    assert [g.folder for g in planned.remove] == ["B.pending" if store == "local" else "B"]
    # the job's retry commits B between gc's decision and its deletion
    ds.save([filled(2.0)], f"{root}/B", blocking=True, storage_options=options, job_id="job-7")
    deleted, kept = gc.delete(backend, planned.remove, grace_s=0)
    assert deleted == [] and [k.reason for k in kept] == ["no longer abandoned"]
    assert restored_value(f"{root}/B", options) == {2.0}
    assert restored_value(f"{root}/A", options) == {1.0}


def test_a_save_that_wrote_after_gc_planned_keeps_its_staging(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    interrupted_save(str(tmp_path / "B"))
    age(tmp_path)
    planned = gc.plan(backend)  # default grace: old enough
    assert [g.folder for g in planned.remove] == ["B.pending"]
    lock = next((tmp_path / "B.pending").glob("*/LOCK"))
    os.utime(lock)  # a save working in it now
    deleted, kept = gc.delete(backend, planned.remove)
    assert deleted == [] and kept[0].reason.startswith("modified 0 s ago, within the grace")
    assert lock.exists()


def test_staging_of_unknown_age_is_kept(tmp_path: Path) -> None:
    """A store that reports no modification times (the ``Backend.modified`` default)."""
    from de_store.backends.base import Backend
    from de_store.backends.local import LocalBackend

    class NoTimes(LocalBackend):
        modified = Backend.modified

    interrupted_save(str(tmp_path / "B"))
    age(tmp_path)
    backend = NoTimes(LocalBackend.from_url(str(tmp_path), {}).fs, str(tmp_path))
    planned = gc.plan(backend)
    assert planned.remove == [] and [(k.folder, k.reason) for k in planned.kept] == [
        ("B.pending", "its age cannot be determined: the store reports no modification time")
    ]
    assert (tmp_path / "B.pending").exists()


# --- item 3: the cleanup inside a TF save --------------------------------------------
def test_a_moved_run_folder_saved_once_more_keeps_its_checkpoints(tmp_path: Path) -> None:
    tf_run(tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "run", moved)
    tf.train.Checkpoint(emb=filled(3.0, ds.FileSystemSaver())).write(str(moved / "ckpt-3"))
    assert sorted(p.name for p in (moved / "de_store").iterdir()) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    for step in (1, 2, 3):
        assert tf_restored_value(str(moved / f"ckpt-{step}")) == {float(step)}


def test_a_relative_prefix_saved_from_another_directory_keeps_its_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tf.train.Checkpoint(emb=filled(1.0, ds.FileSystemSaver())).write("run/ckpt-1")
    monkeypatch.chdir(tmp_path)
    tf.train.Checkpoint(emb=filled(2.0, ds.FileSystemSaver())).write("a/run/ckpt-2")
    kv = tmp_path / "a" / "run" / "de_store"
    assert sorted(p.name for p in kv.iterdir()) == ["ckpt-1", "ckpt-2"]
    age(kv)
    code, out, _ = gc_cli(capsys, "--yes", "--grace", "0", "a/run/de_store")
    assert (code, out) == (0, "removed 0 item(s) under a/run/de_store\n")
    assert tf_restored_value("a/run/ckpt-1") == {1.0}
    manifest = json.loads((kv / "ckpt-1" / "manifest-000001.json").read_text())
    assert manifest["tf_checkpoint"]["path"] == "../../ckpt-1"
    assert manifest["tf_checkpoint"]["relative"] is True
    assert manifest["metadata"] == {} and manifest["format_version"] == 3


def test_user_metadata_tf_prefix_does_not_make_a_checkpoint_an_orphan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kv = tmp_path / "run" / "de_store"
    gone = str(tmp_path / "gone" / "ckpt-1")  # as old manifests kept it, or a user's key
    ds.save([filled(1.0)], str(kv / "ckpt-1"), blocking=True, metadata={"tf_prefix": gone})
    tf.train.Checkpoint(emb=filled(2.0, ds.FileSystemSaver())).write(str(tmp_path / "run" / "c2"))
    assert sorted(p.name for p in kv.iterdir()) == ["c2", "ckpt-1"]
    age(kv)
    assert gc_cli(capsys, "--yes", "--grace", "0", str(kv))[0] == 0
    assert restored_value(str(kv / "ckpt-1")) == {1.0}
    code, out, _ = main(["ls", "--json", str(kv)]), capsys.readouterr().out, None
    assert code == 0
    assert {s["path"]: s["status"] for s in json.loads(out)} == {
        "c2": "committed",
        "ckpt-1": "committed",
    }
    manifest = json.loads((kv / "ckpt-1" / "manifest-000001.json").read_text())
    assert manifest["metadata"] == {"tf_prefix": gone} and "tf_checkpoint" not in manifest


def test_a_deleted_tf_checkpoint_still_makes_its_kv_data_an_orphan(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tf_run(run, steps=2)
    for path in run.glob("ckpt-1.*"):
        path.unlink()  # as CheckpointManager(max_to_keep=...) deletes it
    tf.train.Checkpoint(emb=filled(3.0, ds.FileSystemSaver())).write(str(run / "ckpt-3"))
    assert sorted(p.name for p in (run / "de_store").iterdir()) == ["ckpt-2", "ckpt-3"]
    # a KV folder moved away from its TF checkpoints: nothing there is known to be gone
    shutil.move(run / "de_store", tmp_path / "elsewhere")
    assert gc.collect(open_backend(str(tmp_path / "elsewhere")), grace_s=0) == []


def test_a_checkpoint_saved_again_under_its_name_is_judged_by_its_new_manifest(
    tmp_path: Path,
) -> None:
    """The orphan search keeps the manifests it read; a folder deleted and saved again (the
    same name, the same generation) is read anew, never judged by what it held before."""
    run = tmp_path / "run"
    kv = run / "de_store"
    ds.save([filled(1.0)], str(kv / "ckpt-1"), blocking=True)  # bound to no TF checkpoint
    tf.train.Checkpoint(emb=filled(2.0, ds.FileSystemSaver())).write(str(run / "ckpt-2"))
    backend = open_backend(str(kv))
    assert gc.find_orphans(backend) == []
    # ckpt-1 saved again with its TF checkpoint, which was then deleted: an orphan now
    other = tmp_path / "other"
    tf.train.Checkpoint(emb=filled(3.0, ds.FileSystemSaver())).write(str(other / "ckpt-1"))
    shutil.rmtree(kv / "ckpt-1")
    shutil.copytree(other / "de_store" / "ckpt-1", kv / "ckpt-1")
    assert [g.folder for g in gc.find_orphans(backend)] == ["ckpt-1"]
    assert tf_restored_value(str(run / "ckpt-2")) == {2.0}


def test_the_orphan_search_reads_the_commit_records_side_by_side(tmp_path: Path) -> None:
    """Each save through a tf.train.Checkpoint reads the commit record of every checkpoint in
    its root (a request each on an object store): two of them are read at once, or the
    barrier the reads meet at breaks and the search fails."""
    run = tmp_path / "run"
    tf_run(run, steps=3)
    for path in run.glob("ckpt-1.*"):
        path.unlink()  # as CheckpointManager(max_to_keep=...) deletes it
    backend = open_backend(str(run / "de_store"))
    meet = threading.Barrier(2, timeout=20)
    gated: list[str] = []
    lock = threading.Lock()
    read_bytes = backend.read_bytes

    def meeting_read(path: str) -> bytes:
        with lock:
            wait = names.commit_generation(Path(path).name) is not None and len(gated) < 2
            if wait:
                gated.append(path)
        if wait:
            meet.wait()  # the first two commit records read: both in flight at once
        return read_bytes(path)

    backend.read_bytes = meeting_read  # type: ignore[method-assign]
    assert [g.folder for g in gc.find_orphans(backend)] == ["ckpt-1"]
    assert len(gated) == 2


def test_the_orphan_search_of_a_save_reads_nothing_of_the_checkpoint_it_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save's own manifest is known to the process that committed it: the orphan search
    after a save through tf.train.Checkpoint reads the commit records and manifests of the
    other checkpoints only (on an object store, one request fewer on the save's path), and
    still finds the orphans."""
    run = tmp_path / "run"
    tf_run(run, steps=2)
    for path in run.glob("ckpt-1.*"):
        path.unlink()  # as CheckpointManager(max_to_keep=...) deletes it
    read: list[str] = []

    def reading(real: Any) -> Any:
        def read_folder(backend: Any, folder: str, *args: Any) -> Any:
            read.append(folder)
            return real(backend, folder, *args)

        return read_folder

    monkeypatch.setattr(gc, "recorded_manifest", reading(gc.recorded_manifest))
    monkeypatch.setattr(gc, "checked_manifest", reading(gc.checked_manifest))
    tf.train.Checkpoint(emb=filled(3.0, ds.FileSystemSaver())).write(str(run / "ckpt-3"))
    assert sorted(p.name for p in (run / "de_store").iterdir()) == ["ckpt-2", "ckpt-3"]
    assert "ckpt-1" in read and "ckpt-2" in read and "ckpt-3" not in read
    assert tf_restored_value(str(run / "ckpt-3")) == {3.0}


def test_an_orphan_loses_its_commit_record_before_any_other_file(tmp_path: Path) -> None:
    """A reader that misses a file of a checkpoint gc is removing finds it uncommitted (a
    removed checkpoint, which it retries), never a committed one missing a file (damage)."""
    run = tmp_path / "run"
    tf_run(run, steps=2)
    for path in run.glob("ckpt-1.*"):
        path.unlink()  # as CheckpointManager(max_to_keep=...) deletes it
    (orphan,) = gc.find_orphans(open_backend(str(run / "de_store")))
    assert orphan.folder == "ckpt-1"
    plan = FaultPlan()  # it traces every call of the local backend that opens through it
    backend = open_backend(FaultyFileSystem(LocalFileSystem(), plan), root=str(run / "de_store"))
    gc._remove(backend, orphan)  # what delete and remove_orphans do once it is due
    removed = [path for kind, _, path in plan.trace if kind == "rm"]
    assert removed and Path(removed[0]).name == "COMMIT-000001", removed
    assert sorted(p.name for p in (run / "de_store").iterdir()) == ["ckpt-2"]


# --- item 6: a KV folder is bound to its TF checkpoint -------------------------------
def test_two_runs_sharing_a_save_path_refuse_the_overwritten_checkpoint(tmp_path: Path) -> None:
    shared = str(tmp_path / "shared_kv")
    run1, run2 = str(tmp_path / "run1" / "ckpt-1"), str(tmp_path / "run2" / "ckpt-1")
    tf.train.Checkpoint(emb=filled(1.0, ds.FileSystemSaver(save_path=shared))).write(run1)
    tf.train.Checkpoint(emb=filled(2.0, ds.FileSystemSaver(save_path=shared))).write(run2)
    reader = tf.train.load_checkpoint(run1)
    (id_name,) = [n for n in reader.get_variable_to_shape_map() if "checkpoint_id" in n]
    run1_id = reader.get_tensor(id_name).decode()
    run2_id = tf.train.load_checkpoint(run2).get_tensor(id_name).decode()
    assert run1_id != run2_id and len(run1_id) == 32
    with pytest.raises(CheckpointMismatchError) as raised:
        tf_restored_value(run1, ds.FileSystemSaver(save_path=shared))
    assert str(raised.value) == (
        f"TF checkpoint {run1} (checkpoint id {run1_id}) does not match its KV checkpoint "
        f"{shared}/ckpt-1, which holds the KV data of TF checkpoint id {run2_id}: another "
        "save wrote that folder since (two runs sharing one save_path?); give each run its "
        "own save_path"
    )
    assert tf_restored_value(run2, ds.FileSystemSaver(save_path=shared)) == {2.0}


def test_gc_refusal_is_a_de_store_error(tmp_path: Path) -> None:
    ds.save([filled(1.0)], str(tmp_path / "ckpt-1"), blocking=True)
    with pytest.raises(GCRefusedError, match="it is a checkpoint itself"):
        gc.plan(open_backend(str(tmp_path / "ckpt-1")))
