"""Incremental checkpoints: manifests that name a parent, chains, and exact restores."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from mp_worker import expected_rows, incremental_keys
from saver_helpers import content, fill, make_variable
from test_saver_multiprocess import run_ranks

import de_store as ds
from de_store.backends import open_backend, open_location
from de_store.checkpoint import manifest as manifest_module
from de_store.checkpoint.chain import iter_manifests, parent_reference, resolve_chain
from de_store.checkpoint.commit import commit_strategy, read_manifest
from de_store.checkpoint.manifest import (
    ColumnSpec,
    Manifest,
    RankManifest,
    ShardRecord,
    VariableEntry,
    manifest_from_json,
    merge_rank_manifests,
    to_json,
)
from de_store.errors import CheckpointError, CheckpointNotFoundError
from de_store.saver.incremental import IncrementalPolicy
from de_store.testing import StorageLocation


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


# --- saves and restores of real variables ----------------------------------------------------
NO_FULL = IncrementalPolicy(full_every=1000, max_chain_ratio=1e9)
COMPANIONS = {"adam_m": (4, tf.float32), "status": (1, tf.int64)}


def make_tracked(name: str = "emb", saver: ds.FileSystemSaver | None = None, shards: int = 2):
    """A variable with an optimizer slot and a restrict status, as training makes them."""
    var = make_variable(name, saver, shards=shards)
    for column, (dim, dtype) in COMPANIONS.items():
        var.companion(column, dim, dtype)
    return var


def state_of(var: ds.Variable) -> dict[str, dict]:
    """What a full save holds: every key's value and companion rows (zeros when absent)."""
    values = content(var)
    out = {"value": values}
    for column, companion in var.companions().items():
        rows = content(companion)
        zeros = (0,) * companion.dim
        out[column] = {k: rows.get(k, zeros) for k in values}
    return out


class Model:
    """The dict the variable must equal, changed by the same random operations."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows: dict[str, dict[int, np.ndarray]] = {"value": {}, "adam_m": {}, "status": {}}

    def keys(self, n: int) -> np.ndarray:
        return self.rng.choice(np.arange(-400, 400, dtype=np.int64), n, replace=False)

    def step(self, var: ds.Variable) -> None:
        keys = self.keys(60)  # inserts, updates and re-inserts of removed keys
        values = self.rng.standard_normal((60, 4)).astype(np.float32)
        var.upsert(keys, values)
        self.rows["value"].update(zip(keys.tolist(), values, strict=True))
        keys = self.keys(30)
        deltas = self.rng.standard_normal((30, 4)).astype(np.float32)
        var.accum(keys, deltas)
        for k, d in zip(keys.tolist(), deltas, strict=True):
            self.rows["value"][k] = self.rows["value"].get(k, np.zeros(4, np.float32)) + d
        present = np.array(sorted(self.rows["value"]), np.int64)
        for column, (dim, dtype) in COMPANIONS.items():
            keys = self.rng.choice(present, 20, replace=False)
            rows = self.rng.integers(-9, 9, (20, dim)).astype(dtype.as_numpy_dtype)
            var.companions()[column].upsert(keys, rows)
            self.rows[column].update(zip(keys.tolist(), rows, strict=True))
        removed = self.keys(40)
        var.remove(removed)
        for rows in self.rows.values():
            for k in removed.tolist():
                rows.pop(k, None)

    def state(self) -> dict[str, dict]:
        values = self.rows["value"]
        out = {"value": {k: tuple(v.tolist()) for k, v in values.items()}}
        for column, (dim, _) in COMPANIONS.items():
            rows = self.rows[column]
            out[column] = {k: tuple(rows[k].tolist()) if k in rows else (0,) * dim
                           for k in values}  # fmt: skip
        return out


def manifest_of(url: str, options: dict | None = None) -> Manifest:
    backend, name = open_location(url, options)
    return read_manifest(backend, name)[1]


@pytest.mark.parametrize(("saved_shards", "restored_shards"), [(1, 3), (2, 1)])
def test_every_checkpoint_of_a_random_chain_restores_exactly(
    tmp_path, saved_shards: int, restored_shards: int
) -> None:
    var, model = make_tracked(shards=saved_shards), Model(seed=saved_shards)
    expected, removed_once = [], set()
    for i in range(6):
        model.step(var)
        assert state_of(var) == model.state()
        expected.append(model.state())
        removed_once |= set(range(-400, 400)) - set(model.rows["value"])
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=NO_FULL, blocking=True)
    manifests = [manifest_of(str(tmp_path / f"ckpt-{i}")) for i in range(6)]
    assert [m.parent for m in manifests] == [None] + [f"ckpt-{i}" for i in range(5)]
    assert [m.variables["emb"].incremental for m in manifests] == [False] + [True] * 5
    assert all(m.variables["emb"].removed_rows > 0 for m in manifests[1:])
    for i in range(6):
        restored = make_tracked(shards=restored_shards)
        restored.upsert(np.array([10_000], np.int64), np.ones([1, 4], np.float32))  # replaced
        ds.restore([restored], str(tmp_path / f"ckpt-{i}"))
        assert state_of(restored) == expected[i], f"ckpt-{i}"
    gone = removed_once - set(expected[-1]["value"])
    assert gone and not gone & set(content(restored))  # removed keys stay removed


def test_each_rank_restores_its_share_of_a_chain(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=7)
    for i in range(3):
        model.step(var)
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=NO_FULL, blocking=True)
    union: dict = {}
    for rank in range(3):
        part = make_tracked(shards=1)
        ds.restore([part], str(tmp_path / "ckpt-2"), proc_size=3, proc_rank=rank)
        got = state_of(part)
        assert all(k % 3 == rank for k in got["value"])
        for column, rows in got.items():
            union.setdefault(column, {}).update(rows)
    assert union == model.state()


def test_the_save_after_a_restore_is_a_delta_on_the_restored_checkpoint(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=3)
    for i in range(3):
        model.step(var)
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=NO_FULL, blocking=True)
    resumed = make_tracked(shards=3)
    ds.restore([resumed], str(tmp_path / "ckpt-1"))
    resumed.remove(np.arange(-400, -300, dtype=np.int64))
    resumed.upsert(np.array([5, 6], np.int64), np.full([2, 4], 0.5, np.float32))
    ds.save([resumed], str(tmp_path / "resumed"), incremental=NO_FULL, blocking=True)
    manifest = manifest_of(str(tmp_path / "resumed"))
    assert manifest.parent == "ckpt-1" and manifest.variables["emb"].incremental
    check = make_tracked(shards=2)
    ds.restore([check], str(tmp_path / "resumed"))
    assert state_of(check) == state_of(resumed)


def kinds(root, count: int, options: dict | None = None) -> str:
    """ "F" (full) or "D" (delta) for each of ``root/ckpt-0 ... ckpt-{count - 1}``."""
    return kinds_of(root, range(count), options)


def kinds_of(root, numbers, options: dict | None = None) -> str:
    return "".join(
        "D" if manifest_of(f"{root}/ckpt-{i}", options).incremental else "F" for i in numbers
    )


def test_full_every_starts_a_new_chain_every_n_saves(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=1)
    for i in range(7):
        model.step(var)
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=IncrementalPolicy(
            full_every=3, max_chain_ratio=1e9), blocking=True)  # fmt: skip
    assert kinds(tmp_path, 7) == "FDDFDDF"
    assert manifest_of(str(tmp_path / "ckpt-4")).parent == "ckpt-3"


def test_max_chain_ratio_saves_full_once_the_deltas_outweigh_it(tmp_path) -> None:
    var = make_variable("emb", None, dim=8)
    keys, _ = fill(var, 4000)
    policy = IncrementalPolicy(full_every=1000, max_chain_ratio=0.5)
    rng = np.random.default_rng(0)
    full_bytes = delta_bytes = 0
    expected = ""
    for i in range(7):
        changed = rng.choice(keys, 1000, replace=False)  # a quarter of the rows
        var.upsert(changed, rng.standard_normal((1000, 8)).astype(np.float32))
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=policy, blocking=True)
        full = i == 0 or delta_bytes > 0.5 * full_bytes  # the rule, on committed bytes
        expected += "F" if full else "D"
        saved = manifest_of(str(tmp_path / f"ckpt-{i}")).variables["emb"].bytes
        full_bytes, delta_bytes = (saved, 0) if full else (full_bytes, delta_bytes + saved)
    assert kinds(tmp_path, 7) == expected
    assert expected.count("F") >= 2 and expected.count("D") >= 3


def test_policy_options_are_checked_and_true_is_the_default_policy() -> None:
    assert ds.FileSystemSaver(incremental=True).incremental == IncrementalPolicy()
    assert ds.FileSystemSaver().incremental is None
    with pytest.raises(ValueError, match="full_every must be an int >= 1, got 0"):
        IncrementalPolicy(full_every=0)
    with pytest.raises(ValueError, match="max_chain_ratio must be a number > 0"):
        IncrementalPolicy(max_chain_ratio=0)
    with pytest.raises(ValueError, match="incremental must be a bool or an IncrementalPolicy"):
        ds.FileSystemSaver(incremental="yes")  # type: ignore[arg-type]


def test_saves_elsewhere_or_into_the_base_itself_are_full(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=2)
    model.step(var)
    ds.save([var], str(tmp_path / "a" / "ckpt-0"), incremental=NO_FULL, blocking=True)
    model.step(var)
    ds.save([var], str(tmp_path / "b" / "ckpt-1"), incremental=NO_FULL, blocking=True)
    model.step(var)
    ds.save([var], str(tmp_path / "b" / "ckpt-1"), incremental=NO_FULL, blocking=True)
    assert not manifest_of(str(tmp_path / "b" / "ckpt-1")).incremental
    model.step(var)
    ds.save([var], str(tmp_path / "b" / "ckpt-2"), incremental=NO_FULL, blocking=True)
    assert manifest_of(str(tmp_path / "b" / "ckpt-2")).parent == "ckpt-1"
    restored = make_tracked()
    ds.restore([restored], str(tmp_path / "b" / "ckpt-2"))
    assert state_of(restored) == model.state()
    model.step(var)  # back beside the first: a delta on it, the last base there
    ds.save([var], str(tmp_path / "a" / "ckpt-3"), incremental=NO_FULL, blocking=True)
    assert manifest_of(str(tmp_path / "a" / "ckpt-3")).parent == "ckpt-0"
    ds.restore([restored], str(tmp_path / "a" / "ckpt-3"))
    assert state_of(restored) == model.state()


def test_a_saved_model_export_between_checkpoints_keeps_their_chain(tmp_path) -> None:
    saver = ds.FileSystemSaver(incremental=NO_FULL)
    var, model = make_tracked(saver=saver), Model(seed=13)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=var), tmp_path / "ckpt", 5)
    expected = {}
    for step in range(4):
        model.step(var)
        expected[manager.save()] = model.state()
        if step % 2 == 0:  # a SavedModel for serving: full, in its own folder
            module = tf.Module()
            module.emb = var
            tf.saved_model.save(module, str(tmp_path / f"export-{step}"))
            kv_url = str(tmp_path / f"export-{step}" / "variables" / "de_store" / "variables")
            assert not manifest_of(kv_url).incremental
    assert kinds_of(tmp_path / "ckpt" / "de_store", range(1, 5)) == "FDDD"
    for path, state in expected.items():
        probe = make_tracked(saver=ds.FileSystemSaver(), shards=3)
        tf.train.Checkpoint(emb=probe).read(path).expect_partial()
        assert state_of(probe) == state


def test_a_missing_or_uncommitted_link_is_named_and_nothing_is_restored(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=4)
    for i in range(3):
        model.step(var)
        ds.save([var], str(tmp_path / f"ckpt-{i}"), incremental=NO_FULL, blocking=True)
    target = make_tracked()
    Model(seed=5).step(target)
    before = state_of(target)
    for commit_record in (tmp_path / "ckpt-0").glob("COMMIT-*"):
        commit_record.unlink()
    link, child = re.escape(str(tmp_path / "ckpt-0")), re.escape(str(tmp_path / "ckpt-1"))
    with pytest.raises(CheckpointError, match=f"{child} depends on {link}, which is not committed"):
        ds.restore([target], str(tmp_path / "ckpt-2"))
    assert state_of(target) == before
    shutil.rmtree(tmp_path / "ckpt-0")
    with pytest.raises(CheckpointNotFoundError, match=f"{child} depends on {link}, which does not"):
        ds.restore([target], str(tmp_path / "ckpt-2"))
    assert state_of(target) == before


def test_a_failed_save_makes_the_next_one_full(tmp_path) -> None:
    var, model = make_tracked(), Model(seed=6)
    model.step(var)
    ds.save([var], str(tmp_path / "ckpt-0"), incremental=NO_FULL, blocking=True)
    (tmp_path / "ckpt-1.pending").write_text("a file where the staging folder goes")
    with pytest.raises(Exception, match=r"ckpt-1\.pending"):
        ds.save([var], str(tmp_path / "ckpt-1"), incremental=NO_FULL, blocking=True)
    assert var.change_base is None
    model.step(var)
    ds.save([var], str(tmp_path / "ckpt-2"), incremental=NO_FULL, blocking=True)
    assert not manifest_of(str(tmp_path / "ckpt-2")).incremental
    restored = make_tracked()
    ds.restore([restored], str(tmp_path / "ckpt-2"))
    assert state_of(restored) == model.state()


# --- through tf.train.Checkpoint -----------------------------------------------------------
def test_checkpoint_manager_keeps_every_link_a_kept_checkpoint_needs(tmp_path) -> None:
    saver = ds.FileSystemSaver(incremental=IncrementalPolicy(full_every=3, max_chain_ratio=1e9))
    var, model = make_tracked(saver=saver), Model(seed=8)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=var), tmp_path, max_to_keep=2)
    backend = open_backend(str(tmp_path / "de_store"))
    expected = {}
    for _ in range(7):  # chains: 1 2 3 | 4 5 6 | 7
        model.step(var)
        path = manager.save()
        expected[path] = model.state()
        for kept in manager.checkpoints:  # every kept checkpoint's chain is whole
            name = kept.rsplit("/", 1)[1]
            assert resolve_chain(backend, name, "emb")[0][1].incremental is False
    # ckpt-1..3 went with their TF checkpoints; ckpt-4 and 5 stay, ckpt-6 needs them
    assert sorted(p.name for p in (tmp_path / "de_store").iterdir()) == [
        "ckpt-4", "ckpt-5", "ckpt-6", "ckpt-7",
    ]  # fmt: skip
    assert [p.rsplit("/", 1)[1] for p in manager.checkpoints] == ["ckpt-6", "ckpt-7"]
    assert kinds_of(tmp_path / "de_store", range(4, 8)) == "FDDF"
    for path in manager.checkpoints:
        restored = make_tracked(saver=ds.FileSystemSaver(), shards=3)
        tf.train.Checkpoint(emb=restored).read(path).expect_partial()
        assert state_of(restored) == expected[path]


def train_step(var: ds.Variable, optimizer, ids: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(ds.embedding_lookup(var, tf.constant(ids)) - 1.0))
    variables = var.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))


def test_async_saves_while_training_restore_exactly_in_the_write_callback(tmp_path) -> None:
    saver = ds.FileSystemSaver(incremental=IncrementalPolicy(full_every=4, max_chain_ratio=1e9))
    var = make_variable("emb", saver, shards=2, initializer=0.5)
    optimizer = ds.optimizers.DynamicEmbeddingOptimizer(keras.optimizers.Adam(0.1))
    rng = np.random.default_rng(0)
    seen: list[dict] = []

    def restore_in_callback(path: str) -> None:
        probe = make_variable("emb", ds.FileSystemSaver(), shards=3)
        tf.train.Checkpoint(emb=probe).read(path)
        seen.append(state_of(probe))

    options = tf.train.CheckpointOptions(
        enable_async=True, experimental_write_callbacks=[restore_in_callback]
    )
    ckpt = tf.train.Checkpoint(emb=var)
    expected = []
    for _ in range(6):
        for _ in range(3):  # training between saves: new keys, updates, slots
            train_step(var, optimizer, rng.integers(-500, 500, 64))
        var.remove(rng.integers(-500, 500, 20))
        expected.append(state_of(var))
        ckpt.save(str(tmp_path / "ckpt"), options=options)
        train_step(var, optimizer, rng.integers(-500, 500, 64))  # while it writes
    ckpt.sync()
    assert set(expected[0]) == {"value", "adam_m", "adam_v"}
    assert seen == expected
    assert kinds_of(tmp_path / "de_store", range(1, 7)) == "FFDDDF"  # 2 targets seen: deltas


def test_async_saves_away_from_the_base_or_over_one_prefix_are_full(tmp_path) -> None:
    saver = ds.FileSystemSaver(incremental=NO_FULL)
    var, model = make_tracked(saver=saver), Model(seed=11)
    model.step(var)
    tf.train.Checkpoint(emb=var).write(str(tmp_path / "old" / "ckpt"))  # the base, elsewhere
    options = tf.train.CheckpointOptions(enable_async=True)
    ckpt = tf.train.Checkpoint(emb=var)
    expected = {}
    for _ in range(3):  # numbered prefixes: deltas once two targets were seen
        model.step(var)
        expected[ckpt.save(str(tmp_path / "new" / "ckpt"), options=options)] = model.state()
    other, other_model = make_tracked("other", saver), Model(seed=12)
    other_ckpt = tf.train.Checkpoint(emb=other)
    for _ in range(3):  # one prefix rewritten: its own base, never a delta on it
        other_model.step(other)
        other_ckpt.write(str(tmp_path / "latest"), options=options)
        other_ckpt.sync()
        assert not manifest_of(str(tmp_path / "de_store" / "latest")).incremental
    ckpt.sync()
    assert kinds_of(tmp_path / "new" / "de_store", range(1, 4)) == "FFD"
    checks = [("emb", p, state) for p, state in expected.items()]
    checks.append(("other", str(tmp_path / "latest"), other_model.state()))
    for name, path, state in checks:
        probe = make_tracked(name, ds.FileSystemSaver(), shards=3)
        tf.train.Checkpoint(emb=probe).read(path).expect_partial()
        assert state_of(probe) == state


# --- object stores and processes ------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["local", "s3", "gcs"])
def test_a_chain_on_every_storage(request: pytest.FixtureRequest, backend_name: str) -> None:
    location: StorageLocation = request.getfixturevalue(f"{backend_name}_location")
    options = location.storage_options
    var, model = make_tracked(), Model(seed=9)
    expected = []
    for i in range(3):
        model.step(var)
        expected.append(model.state())
        ds.save([var], f"{location.url}/run/ckpt-{i}", storage_options=options,
                incremental=NO_FULL, blocking=True)  # fmt: skip
    assert kinds(f"{location.url}/run", 3, options) == "FDD"
    for i in (1, 2):
        restored = make_tracked(shards=3)
        ds.restore([restored], f"{location.url}/run/ckpt-{i}", storage_options=options)
        assert state_of(restored) == expected[i]


def test_processes_save_a_full_and_a_delta_and_others_restore_it(
    local_location: StorageLocation, tmp_path
) -> None:
    full, delta = f"{local_location.url}/step-1", f"{local_location.url}/step-2"
    run_ranks([["incsave", full, delta, "2", str(r), "600", "{}"] for r in range(2)])
    manifest = manifest_of(delta)
    assert (manifest.parent, manifest.proc_size) == ("step-1", 2)
    entry = manifest.variables["emb"]
    assert entry.incremental and entry.removed_rows == 2 * 120
    final = []
    for rank in range(2):
        first, removed, added = incremental_keys(2, rank, 600)
        final += [np.setdiff1d(first, removed), added]
    restored = make_variable("emb", None, shards=3)
    ds.restore([restored], delta)
    keys, values = (t.numpy() for t in restored.export())
    np.testing.assert_array_equal(np.sort(keys), np.sort(np.concatenate(final)))
    np.testing.assert_array_equal(values, expected_rows(keys))
    parts = []
    for rank in range(3):  # each rank of another process count reads its share of the chain
        part = make_variable("emb", None, shards=2)
        ds.restore([part], delta, proc_size=3, proc_rank=rank)
        parts.append(part.export()[0].numpy())
        assert np.all(np.mod(parts[-1], 3) == rank)
    union = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(union), np.sort(keys))


def test_a_chain_of_string_keys_restores_exactly(tmp_path) -> None:
    var = make_variable("words", None, key_dtype=tf.string, dim=2)
    words = np.array([f"w{i}".encode() for i in range(300)], dtype=object)
    var.upsert(words, np.arange(600, dtype=np.float32).reshape(-1, 2))
    var.companion("adam_m", 2, tf.float32).upsert(words[:100], np.ones([100, 2], np.float32))
    ds.save([var], str(tmp_path / "ckpt-0"), incremental=NO_FULL, blocking=True)
    var.upsert(words[::7], np.full([43, 2], -1, np.float32))
    var.companions()["adam_m"].upsert(words[150:160], np.full([10, 2], 2, np.float32))
    var.remove(words[200:250])
    var.upsert(np.array(["ünï".encode(), b"w210"], dtype=object), np.zeros([2, 2], np.float32))
    ds.save([var], str(tmp_path / "ckpt-1"), incremental=NO_FULL, blocking=True)
    assert manifest_of(str(tmp_path / "ckpt-1")).variables["words"].removed_rows == 49
    restored = make_variable("words", None, key_dtype=tf.string, dim=2, shards=3)
    ds.restore([restored], str(tmp_path / "ckpt-1"))
    assert state_of(restored) == state_of(var)
