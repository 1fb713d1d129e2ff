"""Restores read on the devices of the tables (``de_store.saver.device_restore``).

The tasks of a ``ParameterServerStrategy`` read their rows themselves; the cluster test
(``tests/distribute/test_ps_restore.py``) does it across processes. Here the tables live
on this process's logical CPUs, and the restore is told they are another task's
(``_is_remote``): the same ops read, check and load the rows, so routing between table
shard counts, every check and the all-or-nothing rule run in one process.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from saver_helpers import CPUS, companion_content, content, fill, make_variable

import de_store as ds
from de_store.backends import open_location
from de_store.checkpoint.commit import read_manifest
from de_store.errors import CheckpointCorruptError, ChecksumError
from de_store.saver import device_load, device_restore

ROWS = 80_000  # two shards of 40,000 rows: 2 key buckets each
BINARY = {"format": "binary", "bucketed": True}


@pytest.fixture
def on_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restores take this process's CPUs for another task's (as a PS task's)."""
    monkeypatch.setattr(device_restore, "_is_remote", lambda device: True)


def saved(tmp_path: Path, shards: int = 2, **options: object) -> tuple[ds.Variable, str]:
    var = make_variable("emb", None, shards=shards)
    fill(var, ROWS, start=-ROWS // 2)
    url = str(tmp_path / "ckpt-1")
    ds.save([var], url, blocking=True, **(options or BINARY))
    return var, url


def placed(var: ds.Variable) -> bool:
    """Whether every table shard holds only the keys ``floormod(key, shards)`` names."""
    for index, shard in enumerate(var.shards):
        keys = np.asarray(shard.export_all()[0])
        if np.any(np.mod(keys, len(var.shards)) != index):
            return False
    return True


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_rows_restore_exactly_into_any_table_shard_count(
    tmp_path: Path, on_devices: None, caplog: pytest.LogCaptureFixture, shards: int
) -> None:
    source, url = saved(tmp_path)
    target = make_variable("emb", None, shards=shards)
    with caplog.at_level(logging.INFO, logger="de_store"):
        ds.restore([target], url)
    assert content(target) == content(source)
    assert companion_content(target, "adam_m") == companion_content(source, "adam_m")
    assert placed(target)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("read ")]
    moved = line.rsplit(", ", 1)[1]
    # 2 buckets: 1 or 2 table shards read each part on its device, 3 route the rows
    assert (moved == "0 of them sent task to task") == (shards < 3)
    assert not list(Path(url).rglob(".restore-*"))  # the bundle indexes are gone


def test_a_one_process_save_of_one_bucket_spreads_over_the_table_shards(
    tmp_path: Path, on_devices: None
) -> None:
    source, url = saved(tmp_path, shards=1, format="binary")  # not bucketed: one bucket
    target = make_variable("emb", None, shards=3)
    ds.restore([target], url)
    assert content(target) == content(source) and placed(target)


def test_runs_join_contiguous_parts_of_one_table_shard(tmp_path: Path) -> None:
    _, url = saved(tmp_path)
    backend, name = open_location(url)
    folder, manifest = read_manifest(backend, name)
    entry = manifest.variables["emb"]
    assert [(r.num_buckets, r.part_buckets) for r in entry.shards] == [(2, [0]), (2, [1])]
    runs = device_restore.plan_entry(backend.sub(folder), entry, CPUS[:2]).runs
    assert [(r.record, r.first, r.last, r.reader, r.target) for r in runs] == [
        (0, 0, 1, 0, 0),
        (1, 0, 1, 1, 1),
    ]
    # 3 does not divide 2 buckets: each file is read whole, on the device of its shard mod 3
    runs = device_restore.plan_entry(backend.sub(folder), entry, CPUS[:3]).runs
    assert [(r.record, r.reader, r.target) for r in runs] == [(0, 0, None), (1, 1, None)]


def test_a_changed_byte_fails_its_crc32c_and_changes_nothing(
    tmp_path: Path, on_devices: None
) -> None:
    _, url = saved(tmp_path)
    values = sorted(Path(url, "emb").glob("*-values"))[1]
    data = bytearray(values.read_bytes())
    data[len(data) // 2] ^= 1
    values.write_bytes(bytes(data))
    target = make_variable("emb", None, shards=3)
    fill(target, 10)
    before = content(target)
    message = rf"crc32c mismatch in part 0 of .*{values.name}: expected .*\(read on {CPUS[1]}\)"
    with pytest.raises(ChecksumError, match=message):
        ds.restore([target], url)
    assert content(target) == before
    assert not list(Path(url).rglob(".restore-*"))


def planned(url: str, shards: int, change: object) -> device_restore.DevicePlan:
    """The plan of ``url``'s entry for ``shards`` CPUs, its records changed by ``change``."""
    backend, name = open_location(url)
    folder, manifest = read_manifest(backend, name)
    entry = manifest.variables["emb"]
    entry = dataclasses.replace(entry, shards=change(entry.shards))  # type: ignore[operator]
    return device_restore.plan_entry(backend.sub(folder), entry, CPUS[:shards])


def test_a_part_holding_keys_of_another_bucket_is_refused(tmp_path: Path) -> None:
    _, url = saved(tmp_path)

    def relabel(records: list) -> list:
        return [dataclasses.replace(records[0], part_buckets=[1]), records[1]]

    with pytest.raises(CheckpointCorruptError, match=r"part 0 is recorded as key bucket 1 of 2, "
                       r"but holds 40000 key\(s\) of other buckets"):  # fmt: skip
        device_restore.read_on_devices(planned(url, 2, relabel))


@pytest.mark.parametrize("holds_rows", [True, False])
def test_a_key_held_twice_is_refused_and_the_variable_stays_as_it_was(
    tmp_path: Path, holds_rows: bool
) -> None:
    _, url = saved(tmp_path)
    rows = device_restore.read_on_devices(planned(url, 3, lambda records: records + records[:1]))
    target = make_variable("emb", None, shards=3)
    if holds_rows:
        fill(target, 10)
    before = content(target)
    message = r"is damaged: emb/r00000-s00000-\w+: key -?\d+ is held 2 times .*40000 extra copies"
    with pytest.raises(CheckpointCorruptError, match=message):
        device_load.check_repeats(target, rows, url)  # a variable holding rows: checked first
        device_load.load_on_devices(target, rows, url)  # an empty one: found while loading
    assert content(target) == before


@pytest.mark.parametrize(
    ("where", "options", "reason"),
    [
        ("memory", BINARY, r"memory://\S* is not a local path those tasks can read"),
        ("local", {"format": "parquet"}, r"\.parquet is parquet, the tasks read binary only"),
        ("local", {"format": "arrow"}, r"\.arrow is arrow, the tasks read binary only"),
    ],
)
def test_storage_the_tasks_cannot_read_goes_through_this_process_saying_why(
    tmp_path: Path, on_devices: None, caplog: pytest.LogCaptureFixture, where: str,
    options: dict, reason: str,
) -> None:  # fmt: skip
    source = make_variable("emb", None, shards=2)
    fill(source, 1000)
    url = str(tmp_path / "ckpt-1") if where == "local" else f"memory://{tmp_path.name}/ckpt-1"
    ds.save([source], url, blocking=True, **options)
    target = make_variable("emb", None, shards=2)
    with caplog.at_level(logging.INFO, logger="de_store"):
        ds.restore([target], url)
    assert content(target) == content(source)
    (line,) = [r.getMessage() for r in caplog.records if "through this process" in r.getMessage()]
    devices = ", ".join(CPUS[:2])
    assert line.startswith(f"rows for {devices} are read through this process: ")
    assert re.search(reason, line), line


def test_an_io_device_reads_through_this_process(
    tmp_path: Path, on_devices: None, caplog: pytest.LogCaptureFixture
) -> None:
    saver = ds.FileSystemSaver(**BINARY)
    source, target = (make_variable("emb", saver, shards=2) for _ in range(2))
    fill(source, 1000)
    prefix = tf.train.Checkpoint(emb=source).write(str(tmp_path / "tf"))
    options = tf.train.CheckpointOptions(experimental_io_device=CPUS[0])
    with caplog.at_level(logging.INFO, logger="de_store"):
        tf.train.Checkpoint(emb=target).read(prefix, options=options)
    assert content(target) == content(source)
    assert f"experimental_io_device {CPUS[0]!r} is set" in caplog.text
