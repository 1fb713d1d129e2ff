"""``de-store inspect``/``ls`` on chains of incremental checkpoints; ``convert`` and
``compact`` flatten a chain into a full checkpoint that restores exactly as the chain does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import tensorflow as tf

import de_store as ds
from de_store.cli import main
from de_store.compaction import compact
from de_store.errors import CheckpointError, CheckpointNotFoundError, FormatError

DIM = 4
ROWS = 70_000  # a shard of the full checkpoint has 4 key buckets, a delta's 1


def make_variable(name: str, shards: int = 1) -> ds.Variable:
    devices = [f"/CPU:{i}" for i in range(shards)]
    return ds.Variable(name, dim=DIM, devices=devices)  # not registered: any number coexist


def build_chain(
    directory: Path, *, slots: bool = True, deltas: int = 2, shards: int = 1
) -> ds.Variable:
    """``ckpt-1`` (full) and ``ckpt-2 ..`` deltas of a Variable with updates, inserts and
    removes between saves; returns the Variable as saved last."""
    rng = np.random.default_rng(7)
    variable = make_variable("emb", shards)
    keys = np.arange(ROWS, dtype=np.int64) * 7919
    variable.upsert(tf.constant(keys), tf.constant(rng.standard_normal((ROWS, DIM), np.float32)))
    if slots:
        variable.companion("accumulator", DIM, tf.float32).upsert(
            tf.constant(keys), tf.fill([ROWS, DIM], 0.5)
        )
    ds.save([variable], str(directory / "ckpt-1"), incremental=True, blocking=True)
    for step in range(2, deltas + 2):
        changed = np.concatenate([keys[rng.choice(ROWS, 40, replace=False)], [10**9 + step]])
        rows = rng.standard_normal((len(changed), DIM), np.float32)
        variable.upsert(tf.constant(changed), tf.constant(rows))
        if slots:
            variable.companion("accumulator", DIM, tf.float32).accum(
                tf.constant(changed), tf.ones([len(changed), DIM])
            )
        variable.remove(tf.constant(keys[rng.choice(ROWS, 10, replace=False)]))
        ds.save([variable], str(directory / f"ckpt-{step}"), incremental=True, blocking=True)
    return variable


def rows_of(variable: ds.Variable) -> dict[str, dict[int, tuple[float, ...]]]:
    """Every column of ``variable``: column -> key -> row."""
    keys, values = variable.export()
    keys = np.asarray(keys)
    out = {"value": _by_key(keys, np.asarray(values))}
    for column, companion in variable.companions().items():
        found, _ = companion.lookup(tf.constant(keys), return_exists=True)
        out[column] = _by_key(keys, np.asarray(found))
    return out


def _by_key(keys: np.ndarray, rows: np.ndarray) -> dict[int, tuple[float, ...]]:
    return {int(k): tuple(r) for k, r in zip(keys, rows.tolist(), strict=True)}


def restored(
    url: str, *, slots: bool = True, shards: int = 1
) -> dict[str, dict[int, tuple[float, ...]]]:
    variable = make_variable("emb", shards)
    if slots:
        variable.companion("accumulator", DIM, tf.float32)
    ds.restore([variable], url)
    return rows_of(variable)


def files_rows(url: str) -> dict[str, dict[int, tuple[float, ...]]]:
    """Every column of the checkpoint's shard files, read with pyarrow."""
    info = json.loads(run_main("inspect", "--json", url)[1])
    var = info["variables"]["emb"]
    fmt = "ipc" if var["format"] == "arrow" else "parquet"
    table = pads.dataset([f"{url}/{f}" for f in var["files"]], format=fmt).to_table()
    keys = table["key"].to_pylist()
    assert len(set(keys)) == len(keys)
    return {
        column: {k: tuple(v) for k, v in zip(keys, table[column].to_pylist(), strict=True)}
        for column in var["columns"]
    }


def run_main(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ds.Variable]:
    directory = tmp_path_factory.mktemp("chain")
    return directory, build_chain(directory)


def test_inspect_json_shows_the_chain_oldest_first(chain) -> None:
    directory, _ = chain
    code, out = run_main("inspect", "--json", str(directory / "ckpt-3"))
    info = json.loads(out)
    assert code == 0
    assert (info["kind"], info["parent"], info["chain_error"]) == ("delta", "ckpt-2", None)
    assert [(link["folder"], link["kind"]) for link in info["chain"]] == [
        ("ckpt-1", "full"),
        ("ckpt-2", "delta"),
        ("ckpt-3", "delta"),
    ]
    assert info["chain"][0]["rows"] == ROWS
    assert [link["removed"] for link in info["chain"]] == [0, 10, 10]
    emb = info["variables"]["emb"]
    assert (emb["incremental"], emb["removed"], emb["chain_links"]) == (True, 10, 3)
    tombstones = pads.dataset(
        [str(directory / "ckpt-3" / f) for f in emb["removed_files"]], format="parquet"
    ).to_table()
    assert tombstones.num_rows == 10 and len(emb["files"]) == emb["shards"]
    assert emb["rows"] == info["chain"][2]["rows"] == 41
    full = json.loads(run_main("inspect", "--json", str(directory / "ckpt-1"))[1])
    assert (full["kind"], full["parent"], len(full["chain"])) == ("full", None, 1)
    assert full["variables"]["emb"]["incremental"] is False


def test_inspect_table_lists_the_links(chain) -> None:
    directory, _ = chain
    code, out = run_main("inspect", str(directory / "ckpt-3"))
    assert code == 0
    assert "kind        delta on ckpt-2" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("  ckpt-")]
    assert [line[:2] for line in lines] == [["ckpt-1", "full"], ["ckpt-2", "delta"],
                                            ["ckpt-3", "delta"]]  # fmt: skip
    assert "this checkpoint" in next(line for line in out.splitlines() if "  ckpt-3" in line)
    assert "delta (chain of 3)" in out


def test_ls_shows_kind_and_parent(chain) -> None:
    directory, _ = chain
    found = {s["path"]: s for s in json.loads(run_main("ls", "--json", str(directory))[1])}
    assert {p: (s["status"], s["kind"], s["parent"]) for p, s in found.items()} == {
        "ckpt-1": ("committed", "full", None),
        "ckpt-2": ("committed", "delta", "ckpt-1"),
        "ckpt-3": ("committed", "delta", "ckpt-2"),
    }


@pytest.mark.parametrize("to", ["parquet", "arrow", None])
def test_convert_flattens_a_chain_into_what_its_restore_gives(chain, tmp_path, to) -> None:
    directory, variable = chain
    src, dst = str(directory / "ckpt-3"), str(tmp_path / "flat")
    expected = restored(src)
    assert expected == rows_of(variable)
    code, out = run_main("convert", "-q", src, dst, *(["--to", to] if to else []))
    assert code == 0 and "flattened" in out
    info = json.loads(run_main("inspect", "--json", dst)[1])
    assert (info["kind"], info["parent"], info["variables"]["emb"]["format"]) == (
        "full", None, to or "parquet",
    )  # fmt: skip
    assert run_main("verify", "-q", dst)[0] == 0
    assert files_rows(dst) == expected
    assert restored(dst) == expected


def test_compact_merges_group_by_group_exactly(chain, tmp_path) -> None:
    directory, _ = chain
    src = str(directory / "ckpt-3")
    out = compact(src, str(tmp_path / "compacted"), group_rows=1000)
    info = json.loads(run_main("inspect", "--json", out)[1])
    assert info["metadata"] == {"compacted_from": src}
    # one file per key group: 70 groups of <= 1000 rows wanted, but the full link has only
    # 4 buckets, so 4 groups, one bucket each
    assert info["variables"]["emb"]["shards"] == 4
    assert files_rows(out) == restored(src)


def test_compact_of_a_sharded_chain_restores_into_other_shard_counts(tmp_path) -> None:
    variable = build_chain(tmp_path / "run", shards=2, deltas=3)
    out = compact(str(tmp_path / "run" / "ckpt-4"), str(tmp_path / "flat"), group_rows=4000)
    expected = rows_of(variable)
    assert restored(out, shards=3) == expected
    assert restored(str(tmp_path / "run" / "ckpt-4"), shards=3) == expected


def test_compact_of_a_full_checkpoint_copies_it(chain, tmp_path) -> None:
    directory, _ = chain
    src = str(directory / "ckpt-1")
    out = compact(src, str(tmp_path / "copy"), format="arrow", values_only=True)
    expected = restored(src)
    assert files_rows(out) == {"value": expected["value"]}


def test_convert_of_a_chain_to_tfra_writes_the_flattened_rows(tmp_path) -> None:
    variable = build_chain(tmp_path / "run", slots=False)
    dst = tmp_path / "TFRADynamicEmbedding"
    code, _ = run_main("convert", "-q", str(tmp_path / "run" / "ckpt-3"), str(dst), "--to", "tfra")
    assert code == 0
    keys = np.concatenate([np.fromfile(f, "<i8") for f in sorted(dst.glob("*-keys"))])
    values = np.concatenate([np.fromfile(f, "<f4") for f in sorted(dst.glob("*-values"))])
    assert _by_key(keys, values.reshape(-1, DIM)) == rows_of(variable)["value"]


def test_convert_without_to_needs_a_checkpoint(tmp_path, capsys) -> None:
    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "give --to" in capsys.readouterr().err


def test_a_missing_link_is_an_error_naming_it(tmp_path, capsys) -> None:
    build_chain(tmp_path, slots=False)
    shutil.rmtree(tmp_path / "ckpt-2")
    src = str(tmp_path / "ckpt-3")
    assert main(["convert", "-q", src, str(tmp_path / "flat"), "--to", "parquet"]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}/ckpt-3 depends on {tmp_path}/ckpt-2, which does not exist" in err
    assert not (tmp_path / "flat").exists()
    with pytest.raises(CheckpointNotFoundError, match="ckpt-2"):
        compact(src, str(tmp_path / "flat"))
    assert main(["inspect", src]) == 1
    out, err = capsys.readouterr()
    assert "BROKEN" in out and "ckpt-2  missing" in out and "ckpt-2" in err


def test_an_uncommitted_link_is_an_error_naming_it(tmp_path, capsys) -> None:
    build_chain(tmp_path, slots=False)
    for record in (tmp_path / "ckpt-1").glob("COMMIT-*"):
        record.unlink()
    src = str(tmp_path / "ckpt-3")
    with pytest.raises(CheckpointError, match=r"depends on .*/ckpt-1, which is not committed"):
        compact(src, str(tmp_path / "flat"))
    assert not (tmp_path / "flat").exists()
    assert main(["convert", "-q", src, str(tmp_path / "flat"), "--to", "arrow"]) == 1
    assert "ckpt-1, which is not committed" in capsys.readouterr().err


def test_a_corrupt_link_fails_compact_and_leaves_nothing(tmp_path) -> None:
    build_chain(tmp_path, slots=False)
    victim = next((tmp_path / "ckpt-1").glob("emb/*.parquet"))  # its last group's part
    data = bytearray(victim.read_bytes())
    data[len(data) * 9 // 10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=victim.name):  # after the first groups' files
        compact(str(tmp_path / "ckpt-3"), str(tmp_path / "flat"), group_rows=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_ls_marks_an_orphan_a_kept_delta_needs_as_parent_and_gc_keeps_it(tmp_path) -> None:
    kv, tf_dir = tmp_path / "kv", tmp_path / "tf"
    saver = ds.FileSystemSaver(save_path=str(kv), incremental=True)
    variable = ds.Variable("emb", dim=DIM, kv_creator=ds.HashTableCreator(saver=saver))
    variable.upsert(tf.range(ROWS, dtype=tf.int64), tf.ones([ROWS, DIM]))
    for step in (1, 2, 3):  # a full checkpoint, then two deltas
        tf.train.Checkpoint(emb=variable).write(str(tf_dir / f"ckpt-{step}"))
        variable.upsert(tf.constant([step], tf.int64), tf.zeros([1, DIM]))
    full = ds.Variable("emb", dim=DIM, kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver(
        save_path=str(kv))))  # fmt: skip
    tf.train.Checkpoint(emb=full).write(str(tf_dir / "ckpt-4"))
    for step in (1, 2, 4):  # TF checkpoints deleted, as CheckpointManager deletes them
        for path in tf_dir.glob(f"ckpt-{step}.*"):
            path.unlink()
    found = {s["path"]: s for s in json.loads(run_main("ls", "--json", str(kv))[1])}
    assert {p: (s["status"], s["kind"]) for p, s in found.items()} == {
        "ckpt-1": ("parent", "full"),
        "ckpt-2": ("parent", "delta"),
        "ckpt-3": ("committed", "delta"),
        "ckpt-4": ("orphaned", "full"),
    }
    # gc agrees: only the unneeded orphan goes
    assert main(["gc", "--yes", "--grace", "0", str(kv)]) == 0
    assert sorted(p.name for p in kv.glob("ckpt-*")) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_verify_reads_a_deltas_tombstones_and_checks_its_links(tmp_path, capsys) -> None:
    build_chain(tmp_path, slots=False)
    src = str(tmp_path / "ckpt-3")
    assert main(["verify", src]) == 0
    capsys.readouterr()
    tombstones = json.loads(run_main("inspect", "--json", src)[1])["variables"]["emb"]
    victim = tmp_path / "ckpt-3" / tombstones["removed_files"][0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "ckpt-2")
    assert main(["verify", src]) == 1
    out = capsys.readouterr().out
    assert victim.name in out
    assert f"{tmp_path}/ckpt-3 depends on {tmp_path}/ckpt-2, which does not exist" in out
