"""Hostile numbers in a manifest (edited consistently, its commit record re-signed): every
number a restore sizes, allocates or loops over from is checked against the others and
against the files' real sizes first. Restore raises ``CheckpointCorruptError`` naming the
file (or the manifest) and the field, the variable keeps its rows, and verify reports it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults_helpers import content, make_variable
from test_faults_manifest import MANIFEST, SINGLE, forge

from de_store.backends import Backend, open_backend
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.verify import verify_checkpoint
from de_store.errors import CheckpointCorruptError
from de_store.saver.core import IOOptions, save_checkpoint
from de_store.saver.restore_flow import restore_checkpoint
from de_store.saver.rows import ShardRows, VariableRows

SHARD = ("variables", "emb", "shards", 0)
INFO = (*SHARD, "info")
#: field -> (path in the manifest's JSON, words one of which the error must say)
FIELDS: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "proc_size": (("proc_size",), ("proc_size",)),
    "dim": (("variables", "emb", "dim"), ("dim",)),
    "shard_count": (("variables", "emb", "shard_count"), ("shard_count",)),
    "value dim": (("variables", "emb", "columns", "value", "dim"), ("'value'",)),
    "slot dim": (("variables", "emb", "columns", "accum", "dim"), ("'accum'",)),
    "rank": ((*SHARD, "rank"), ("rank",)),
    "shard": ((*SHARD, "shard"), ("shard",)),
    "num_buckets": ((*SHARD, "num_buckets"), ("num_buckets",)),
    "part_buckets": ((*SHARD, "part_buckets", 1), ("part_buckets",)),
    "rows": ((*INFO, "rows"), ("rows",)),
    "bytes": ((*INFO, "bytes"), ("bytes",)),
    "part rows": ((*INFO, "parts", 1, "rows"), ("rows",)),
    "row_offset": ((*INFO, "parts", 2, "row_offset"), ("row_offset",)),
    "range offset": ((*INFO, "parts", 1, "ranges", 0, "offset"), ("byte range",)),
    "range length": ((*INFO, "parts", 1, "ranges", 0, "length"), ("byte range", "parts[1]")),
    "file bytes": ((*INFO, "files", 0, "bytes"), ("bytes",)),
    "schema dim": ((*INFO, "schema", "dim"), ("schema",)),
}
VALUES = [10**15, 2**63, -1, 0, 1.5, 4.0]  # 4.0: equal to 4, not an integer


def variable_rows(rows: int = 1000) -> VariableRows:
    """Two table shards of ``rows`` keys each, with an ``accum`` slot column."""
    keys = np.arange(2 * rows, dtype=np.int64)
    shards = []
    for index in range(2):
        mine = keys[index::2]
        values = (mine[:, None] * np.arange(1, 5)).astype(np.float32)
        shards.append(ShardRows(mine, {"value": values, "accum": -values}))
    columns = {"value": ColumnSpec("float32", 4), "accum": ColumnSpec("float32", 4)}
    return VariableRows("emb", "int64", "float32", 4, columns, shards)


@pytest.fixture(scope="module", params=["parquet", "arrow", "binary"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed checkpoint ``ckpt`` of the format (3 parts a shard)."""
    root = tmp_path_factory.mktemp(request.param)
    options = IOOptions(format=request.param, buffer_size=400)
    save_checkpoint([variable_rows()], open_backend(str(root)), "ckpt", SINGLE, options)
    return root


def edit(path: tuple[Any, ...], value: Any) -> Any:
    def set_field(manifest: dict[str, Any]) -> None:
        node = manifest
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value

    return set_field


def field_of(folder: Path, path: tuple[Any, ...]) -> Any:
    node = json.loads((folder / MANIFEST).read_text())
    for step in path:
        node = node[step]
    return node


def held(backend: Backend) -> tuple[Any, dict[int, tuple[float, ...]]]:
    """A variable holding one row, restored from ``ckpt``; with what it holds after."""
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    restore_checkpoint([var], backend, "ckpt", SINGLE, IOOptions())
    return var, content(var)


@pytest.mark.parametrize("value", VALUES, ids=repr)
@pytest.mark.parametrize("field", FIELDS)
def test_a_hostile_number_is_refused_before_anything_is_sized(
    saved: Path, tmp_path: Path, field: str, value: Any
) -> None:
    path, words = FIELDS[field]
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    folder = tmp_path / "ckpt"
    backend = open_backend(str(tmp_path))
    original = field_of(folder, path)
    forge(folder, edit(path, value))
    if original == value and type(original) is type(value):  # no change: restores exactly
        _, rows = held(backend)
        assert len(rows) == 2000 and rows[7] == (7.0, 14.0, 21.0, 28.0)
        return
    var = make_variable()
    var.upsert(np.array([123456], np.int64), np.ones([1, 4], np.float32))
    with pytest.raises(CheckpointCorruptError) as info:
        restore_checkpoint([var], backend, "ckpt", SINGLE, IOOptions())
    message = str(info.value)
    assert any(word in message for word in words), message
    assert MANIFEST in message or "emb/r00000-s0000" in message, message
    assert content(var) == {123456: (1.0, 1.0, 1.0, 1.0)}  # as it was
    report = verify_checkpoint(backend, "ckpt")
    said = "\n".join(f"{p.path}: {p.message}" for p in report.problems)
    assert not report.ok and any(word in said for word in words), said


def restore_refused(backend: Backend) -> str:
    var = make_variable()
    with pytest.raises(CheckpointCorruptError) as info:
        restore_checkpoint([var], backend, "ckpt", SINGLE, IOOptions())
    assert content(var) == {}
    assert not verify_checkpoint(backend, "ckpt").ok
    return str(info.value)


@pytest.mark.parametrize("rows", [10**15, 2**63, 401])
def test_row_counts_that_agree_with_each_other_but_not_with_the_bytes_are_refused(
    saved: Path, tmp_path: Path, rows: int
) -> None:
    """The last part claims ``rows`` rows, and the shard's count says so too: the part's
    bytes cannot hold them in its format."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    fmt = field_of(tmp_path / "ckpt", (*INFO, "format"))

    def grow(manifest: dict[str, Any]) -> None:
        info = manifest["variables"]["emb"]["shards"][0]["info"]
        info["rows"] += rows - info["parts"][2]["rows"]
        info["parts"][2]["rows"] = rows

    forge(tmp_path / "ckpt", grow)
    message = restore_refused(open_backend(str(tmp_path)))
    assert f"parts[2].rows: {rows} rows in " in message, message
    assert (f"a {fmt} part of {rows} rows takes" in message) is True, message


def test_byte_counts_that_agree_with_each_other_but_not_with_the_file_are_refused(
    saved: Path, tmp_path: Path
) -> None:
    """The first file, its shard's bytes and the last part's range all say the file is
    1 MB longer than it is: its real size refuses them before anything is read."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    more = 1 << 20

    def stretch(manifest: dict[str, Any]) -> None:
        info = manifest["variables"]["emb"]["shards"][0]["info"]
        info["files"][0]["bytes"] += more
        info["bytes"] += more

    forge(tmp_path / "ckpt", stretch)
    path = field_of(tmp_path / "ckpt", (*INFO, "files", 0, "path"))
    size = (tmp_path / "ckpt" / path).stat().st_size
    message = restore_refused(open_backend(str(tmp_path)))
    assert f"{path}: expected {size + more} bytes, found {size}" in message, message


@pytest.mark.parametrize("field", ["num_buckets", "rows", "part rows", "proc_size"])
def test_compact_and_convert_refuse_a_hostile_number_and_write_nothing(
    saved: Path, tmp_path: Path, field: str
) -> None:
    from de_store.compaction import compact
    from de_store.convert import convert

    src = tmp_path / "src"
    shutil.copytree(saved, src)
    path, words = FIELDS[field]
    forge(src / "ckpt", edit(path, 10**15))
    for run in (
        lambda: compact(str(src / "ckpt"), str(tmp_path / "compacted")),
        lambda: convert(str(src / "ckpt"), str(tmp_path / "converted"), "arrow"),
    ):
        with pytest.raises(CheckpointCorruptError) as info:
            run()
        assert any(word in str(info.value) for word in words), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
