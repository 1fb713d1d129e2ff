"""Checkpoints whose manifest was edited consistently (commit record re-signed, so no
checksum catches it) or whose shard was written by another tool: restore and verify refuse
each one alike, naming the file, and the table keeps its content where it can."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from faults_helpers import content, make_variable

import de_store as ds
from de_store.backends import Backend, open_backend
from de_store.catalog import list_checkpoints
from de_store.checkpoint.commit import parse_commit_record
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.topology import Topology
from de_store.checkpoint.verify import verify_checkpoint
from de_store.cli import main
from de_store.errors import CheckpointCorruptError
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.restore_flow import restore_checkpoint
from de_store.saver.rows import ShardRows, VariableRows

SINGLE = Topology(1, 0)
MANIFEST = "manifest-000001.json"


def variable_rows(shard_keys: list[np.ndarray]) -> VariableRows:
    shards = []
    for index, keys in enumerate(shard_keys):
        values = (keys[:, None] * np.arange(1, 5) + 1000 * index).astype(np.float32)
        shards.append(ShardRows(keys.astype(np.int64), {"value": values}))
    return VariableRows("emb", "int64", "float32", 4, {"value": ColumnSpec("float32", 4)}, shards)


def save(tmp_path: Path, shard_keys: list[np.ndarray], **options: Any) -> tuple[Backend, Path]:
    backend = open_backend(str(tmp_path))
    save_checkpoint([variable_rows(shard_keys)], backend, "ckpt", SINGLE, IOOptions(**options))
    return backend, tmp_path / "ckpt"


def two_shards(rows: int = 1000) -> list[np.ndarray]:
    keys = np.arange(rows * 2)
    return [keys[0::2], keys[1::2]]


def forge(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest as a forger would, then re-sign the commit record."""
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest)
    data = json.dumps(manifest).encode()
    (folder / MANIFEST).write_bytes(data)
    record = parse_commit_record((folder / "COMMIT-000001").read_bytes())
    record.update(manifest_bytes=len(data), manifest_crc32c=google_crc32c.value(data))
    signature = google_crc32c.value(json.dumps(record, sort_keys=True).encode())
    (folder / "COMMIT-000001").write_text(json.dumps({**record, "record_crc32c": signature}))


def shards_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return list(manifest["variables"]["emb"]["shards"])


def refused(backend: Backend, *named: str, topology: Topology = SINGLE) -> str:
    """Restore and verify both refuse ``ckpt``; each message names every one of ``named``."""
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    with pytest.raises(CheckpointCorruptError) as info:
        restore_checkpoint([var], backend, "ckpt", topology, IOOptions())
    message = str(info.value)
    report = verify_checkpoint(backend, "ckpt")
    assert not report.ok
    said = "\n".join(f"{p.path}: {p.message}" for p in report.problems)
    for name in named:
        assert name in message, message
        assert name in said, said
    return message


def test_a_rank_whose_shard_records_were_removed_is_refused(tmp_path: Path) -> None:
    backend, folder = save(tmp_path, two_shards())

    def drop_rank_1(manifest: dict[str, Any]) -> None:
        manifest["proc_size"] = 2  # shard 1 was rank 1's; its record is removed
        entry = manifest["variables"]["emb"]
        entry["shards"], entry["shard_count"] = shards_of(manifest)[:1], 1

    forge(folder, drop_rank_1)
    message = refused(backend, MANIFEST, "no shards of rank(s) [1]")
    assert "(proc_size is 2)" in message
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    before = content(var)
    with pytest.raises(CheckpointCorruptError):
        restore_checkpoint([var], backend, "ckpt", SINGLE, IOOptions())
    assert content(var) == before  # refused before anything was read


def test_two_shards_holding_the_same_keys_are_refused(tmp_path: Path) -> None:
    keys = np.arange(100)
    backend, folder = save(tmp_path, [keys, keys[50:]])  # keys 50..99 twice, other values
    files = [s["info"]["path"] for s in shards_of(json.loads((folder / MANIFEST).read_text()))]
    message = refused(backend, "key 50 is held 2 times", *files)
    assert "50 extra copies" in message and "emptied" not in message
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    with pytest.raises(CheckpointCorruptError, match="key 50 is held 2 times"):
        restore_checkpoint([var], backend, "ckpt", SINGLE, IOOptions())
    assert content(var) == {123456: (1.0, 1.0, 1.0, 1.0)}  # found before it was emptied


def test_a_repeat_in_the_second_variable_leaves_the_first_as_it_was(tmp_path: Path) -> None:
    keys = np.arange(100)
    good, bad = variable_rows([keys[:50], keys[50:]]), variable_rows([keys, keys[50:]])
    bad = dataclasses.replace(bad, name="other")
    backend = open_backend(str(tmp_path))
    save_checkpoint([good, bad], backend, "ckpt", SINGLE, IOOptions())
    first, second = make_variable(), ds.Variable("other", dim=4)
    for var in (first, second):
        var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    with pytest.raises(CheckpointCorruptError, match=r"variable 'other'.*key 50 is held 2 times"):
        restore_checkpoint([first, second], backend, "ckpt", SINGLE, IOOptions())
    assert content(first) == content(second) == {123456: (1.0, 1.0, 1.0, 1.0)}


def test_part_buckets_that_do_not_match_the_keys_are_refused(tmp_path: Path) -> None:
    # 40,000 rows a shard: 2 key buckets (even keys, odd keys), one part each
    keys = np.arange(80_000)
    backend, folder = save(
        tmp_path, [keys[:40_000], keys[40_000:]], buffer_size=1 << 16, bucketed=True
    )
    manifest = json.loads((folder / MANIFEST).read_text())
    record = shards_of(manifest)[1]
    assert (record["num_buckets"], record["part_buckets"]) == (2, [0, 1])

    def swap(manifest: dict[str, Any]) -> None:
        shards_of(manifest)[1]["part_buckets"] = [1, 0]

    forge(folder, swap)
    named = (record["info"]["path"], "part 0 is recorded as key bucket 1 of 2")
    refused(backend, *named)
    refused(backend, *named, topology=Topology(2, 1))  # rank 1 reads the part labelled 1


def test_a_null_key_in_a_parquet_shard_written_by_pyarrow_is_refused(tmp_path: Path) -> None:
    backend, folder = save(tmp_path, two_shards(), format="parquet")
    record = shards_of(json.loads((folder / MANIFEST).read_text()))[0]
    path = folder / record["info"]["path"]
    table = pq.read_table(path)
    keys = pa.array([None, *table.column("key").to_pylist()[1:]], pa.int64())
    schema = table.schema.set(0, pa.field("key", pa.int64(), nullable=True))
    table = pa.Table.from_arrays([keys, table.column("value")], schema=schema)
    info = write_parquet_shard(path, table)
    forge(folder, lambda m: shards_of(m)[0].update(info=info, part_buckets=[0], num_buckets=1))
    message = refused(backend, record["info"]["path"], "column 'key' holds 1 null value(s)")
    assert "float64" not in message


def write_parquet_shard(path: Path, table: pa.Table) -> dict[str, Any]:
    """Write ``table`` with plain pyarrow (one row group) at ``path``; its ShardInfo dict,
    as a forger would compute it."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=table.num_rows, compression="NONE")
    data = buffer.getvalue()
    path.write_bytes(data)
    footer = int.from_bytes(data[-8:-4], "little")
    start, end = 4, len(data) - 8 - footer
    crc = google_crc32c.value(data)
    keys = [k for k in table.column("key").to_pylist() if k is not None]
    part = {"rows": table.num_rows, "row_offset": 0, "min_key": min(keys), "max_key": max(keys),
            "ranges": [{"offset": start, "length": end - start,
                        "crc32c": google_crc32c.value(data[start:end])}]}  # fmt: skip
    manifest_info = json.loads((path.parent.parent / MANIFEST).read_text())
    old = next(s["info"] for s in shards_of(manifest_info) if path.name in s["info"]["path"])
    return {**old, "rows": table.num_rows, "bytes": len(data), "crc32c": crc,
            "min_key": part["min_key"], "max_key": part["max_key"], "parts": [part],
            "files": [{"path": old["path"], "bytes": len(data), "crc32c": crc}]}  # fmt: skip


@pytest.mark.parametrize(
    "field, value", [("offset", 10**15), ("length", 10**15), ("offset", -5), ("length", 2**62)]
)
def test_a_huge_byte_range_is_refused_and_verify_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: int
) -> None:
    backend, folder = save(tmp_path, two_shards(), format="binary", buffer_size=400)
    record = shards_of(json.loads((folder / MANIFEST).read_text()))[0]
    file = record["info"]["files"][1]["path"]  # the values file of the binary pair

    def stretch(manifest: dict[str, Any]) -> None:
        shards_of(manifest)[0]["info"]["parts"][1]["ranges"][1][field] = value

    forge(folder, stretch)
    message = refused(backend, file, "part 1's byte range")
    assert f"outside the file's {file_size(record, 1)} bytes" in message
    assert main(["verify", "-q", str(folder)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"BAD {folder}/{file}: part 1's byte range"), out


def file_size(record: dict[str, Any], index: int) -> int:
    return int(record["info"]["files"][index]["bytes"])


def test_ls_shows_a_damaged_commit_record_and_lists_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = open_backend(str(tmp_path))
    for name in ("ckpt-1", "ckpt-2", "ckpt-3"):
        save_checkpoint([variable_rows(two_shards(10))], backend, name, SINGLE, IOOptions())
    (tmp_path / "ckpt-2" / "COMMIT-000001").write_text('{"generation": 1 "committed": 0}')
    found = list_checkpoints(str(tmp_path))
    statuses = [(s.path, s.status, s.step) for s in found]
    assert statuses == [("ckpt-1", "committed", 1), ("ckpt-2", "damaged", 2),
                        ("ckpt-3", "committed", 3)]  # fmt: skip
    assert found[1].problem is not None
    assert "ckpt-2/COMMIT-000001: commit record is not valid (Expecting ','" in found[1].problem
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[1:4]] == [
        ["ckpt-1", "committed"], ["ckpt-2", "damaged"], ["ckpt-3", "committed"]
    ]  # fmt: skip
    assert "damaged ckpt-2: " in out and "commit record is not valid" in out


def test_a_delta_whose_shards_hold_the_same_keys_is_refused_before_any_change(
    tmp_path: Path,
) -> None:
    backend, first = save(tmp_path, two_shards(100))
    keys = np.arange(100)
    save_checkpoint([variable_rows([keys, keys[50:]])], backend, "delta", SINGLE, IOOptions())
    parent = json.loads((first / MANIFEST).read_text())

    def as_delta(manifest: dict[str, Any]) -> None:
        manifest.update(format_version=2, parent="ckpt", parent_created=parent["created"])
        manifest["variables"]["emb"].update(incremental=True, removed=[])

    forge(tmp_path / "delta", as_delta)
    files = [s["info"]["path"] for s in shards_of(json.loads((tmp_path / "delta" / MANIFEST)
                                                             .read_text()))]  # fmt: skip
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    before = content(var)
    with pytest.raises(CheckpointCorruptError, match="key 50 is held 2 times") as info:
        restore_checkpoint([var], backend, "delta", SINGLE, IOOptions())
    message = str(info.value)
    assert f"checkpoint {tmp_path}/delta is damaged: {tmp_path}/delta/{min(files)}" in message
    assert all(file in message for file in files)
    assert content(var) == before  # refused before the full link replaced the content
    report = verify_checkpoint(backend, "delta")
    assert [p.message.split(";")[0] for p in report.problems] == [
        f"key 50 is held 2 times (in {', '.join(sorted(files))})"
    ]
