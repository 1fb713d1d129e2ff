"""Incremental checkpoints: manifests that name a parent, chains, and exact restores."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from de_store.backends import open_backend
from de_store.errors import CheckpointError, CheckpointNotFoundError
from de_store.saver import manifest as manifest_module
from de_store.saver.chain import iter_manifests, parent_reference, resolve_chain
from de_store.saver.commit import commit_strategy
from de_store.saver.manifest import (
    ColumnSpec,
    Manifest,
    RankManifest,
    ShardRecord,
    VariableEntry,
    manifest_from_json,
    merge_rank_manifests,
    to_json,
)


# --- manifests and chains, without tables ---------------------------------------------------
def entry(name: str = "emb", *, incremental: bool = False, rows: int = 3) -> VariableEntry:
    record = ShardRecord(0, 0, {"path": f"{name}/f.parquet", "rows": rows, "bytes": 10 * rows},
                         1, [0])  # fmt: skip
    removed = [dataclasses.replace(record, info={**record.info, "rows": 1, "bytes": 7})]
    return VariableEntry(
        name=name, key_dtype="int64", value_dtype="float32", dim=4,
        columns={"value": ColumnSpec("float32", 4)}, format="parquet", shard_count=1,
        shards=[record], incremental=incremental, removed=removed if incremental else [],
    )  # fmt: skip


def rank(rank: int, parent: str | None, *entries: VariableEntry) -> RankManifest:
    created = None if parent is None else 12.5
    return RankManifest(rank, 2, {e.name: e for e in entries}, parent, created)


def test_a_full_manifest_is_written_as_version_1_without_incremental_fields() -> None:
    manifest = merge_rank_manifests([rank(0, None, entry()), rank(1, None, entry())])
    data = json.loads(to_json(manifest))
    assert data["format_version"] == 1 and data["parent"] is None
    assert "parent_created" not in data
    assert set(data["variables"]["emb"]) >= {"shards", "columns"}
    assert not {"incremental", "removed"} & set(data["variables"]["emb"])
    assert manifest_from_json(to_json(manifest), "x") == manifest


def test_an_incremental_manifest_is_version_2_and_older_readers_refuse_it(monkeypatch) -> None:
    manifest = merge_rank_manifests(
        [rank(1, "ckpt-1", entry(incremental=True)), rank(0, "ckpt-1", entry(incremental=True))]
    )
    assert (manifest.format_version, manifest.parent, manifest.parent_created) == (
        2, "ckpt-1", 12.5,
    )  # fmt: skip
    emb = manifest.variables["emb"]
    assert (emb.incremental, emb.rows, emb.removed_rows, emb.bytes) == (True, 6, 2, 74)
    assert manifest_from_json(to_json(manifest), "x") == manifest
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", 1)
    with pytest.raises(CheckpointError, match="format_version 2 is newer than this de_store"):
        manifest_from_json(to_json(manifest), "s3://b/ckpt-2")


def test_merge_names_the_rank_that_disagrees_on_the_parent_or_the_kind() -> None:
    with pytest.raises(CheckpointError, match=r"rank 1 saved on parent checkpoint .*'ckpt-2'"):
        merge_rank_manifests([rank(0, "ckpt-1", entry(incremental=True)),
                              rank(1, "ckpt-2", entry(incremental=True))])  # fmt: skip
    with pytest.raises(CheckpointError, match=r"variable 'emb': rank 1 saved .* True\)"):
        merge_rank_manifests([rank(0, "ckpt-1", entry()),
                              rank(1, "ckpt-1", entry(incremental=True))])  # fmt: skip


def test_parent_reference_is_the_bare_name_of_a_sibling_else_the_url() -> None:
    assert parent_reference("s3://b/run/ckpt-1", "s3://b/run/ckpt-2") == "ckpt-1"
    assert parent_reference("s3://b/other/ckpt-1", "s3://b/run/ckpt-2") == "s3://b/other/ckpt-1"


def commit(backend, name: str, *entries: VariableEntry, parent: str | None = None) -> Manifest:
    created = None
    if parent is not None:
        created = next(iter_manifests(backend, parent))[1].created
    manifest = dataclasses.replace(
        merge_rank_manifests([RankManifest(0, 1, {e.name: e for e in entries})]),
        parent=parent, parent_created=created,
    )  # fmt: skip
    commit_strategy(backend, name).commit(manifest)
    return manifest


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest):
    location = request.getfixturevalue(f"{request.param}_location")
    return open_backend(location.url)


def test_resolve_chain_lists_the_links_oldest_first(backend) -> None:
    commit(backend, "ckpt-1", entry(), entry("other"))
    commit(backend, "ckpt-2", entry(incremental=True), entry("other"), parent="ckpt-1")
    commit(backend, "ckpt-3", entry(incremental=True), entry("other", incremental=True),
           parent="ckpt-2")  # fmt: skip
    chain = resolve_chain(backend, "ckpt-3", "emb")
    assert [folder for folder, _ in chain] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert [e.incremental for _, e in chain] == [False, True, True]
    assert [folder for folder, _ in resolve_chain(backend, "ckpt-3", "other")] == [
        "ckpt-2", "ckpt-3",
    ]  # fmt: skip
    assert [f for f, _ in iter_manifests(backend, "ckpt-3")] == ["ckpt-3", "ckpt-2", "ckpt-1"]


def test_a_missing_link_is_an_error_naming_it_and_its_child(backend) -> None:
    commit(backend, "ckpt-1", entry())
    commit(backend, "ckpt-2", entry(incremental=True), parent="ckpt-1")
    commit(backend, "ckpt-3", entry(incremental=True), parent="ckpt-2")
    backend.delete("ckpt-1", recursive=True)
    root = re.escape(backend.url.rstrip("/"))
    with pytest.raises(
        CheckpointNotFoundError,
        match=f"checkpoint {root}/ckpt-2 depends on {root}/ckpt-1, which does not exist",
    ):
        resolve_chain(backend, "ckpt-3", "emb")


def test_an_uncommitted_link_is_an_error_naming_it(backend) -> None:
    commit(backend, "ckpt-1", entry())
    commit(backend, "ckpt-2", entry(incremental=True), parent="ckpt-1")
    for path in backend.list("ckpt-1"):
        if path.rsplit("/", 1)[-1].startswith("COMMIT-"):
            backend.delete(path)
    root = re.escape(backend.url.rstrip("/"))
    with pytest.raises(CheckpointError, match=f"on {root}/ckpt-1, which is not committed"):
        resolve_chain(backend, "ckpt-2", "emb")


def test_a_rewritten_parent_is_an_error_not_a_mixed_restore(backend) -> None:
    commit(backend, "ckpt-1", entry())
    commit(backend, "ckpt-2", entry(incremental=True), parent="ckpt-1")
    commit(backend, "ckpt-1", entry(rows=5))  # a later save replaced it
    with pytest.raises(CheckpointError, match="ckpt-1, which was rewritten after it was saved"):
        resolve_chain(backend, "ckpt-2", "emb")


def test_a_link_without_the_variable_is_an_error(backend) -> None:
    commit(backend, "ckpt-1", entry("other"))
    commit(backend, "ckpt-2", entry(incremental=True), parent="ckpt-1")
    with pytest.raises(CheckpointError, match=r"as a delta on .*ckpt-1, which has no variable"):
        resolve_chain(backend, "ckpt-2", "emb")
