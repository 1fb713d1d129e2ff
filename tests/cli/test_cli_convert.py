"""``de-store convert``: between shard formats, from TFRA folders and back, byte for byte."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest

from de_store.cli import main
from de_store.testing.sample import sample_checkpoint

INTEROP = Path("/work/shared/interop/tfra-0.8.1")
needs_samples = pytest.mark.skipif(not INTEROP.exists(), reason="TFRA samples not present")


def rows_of(url: str) -> dict[int, tuple[float, ...]]:
    """key -> value row of every shard, read through ``de-store inspect`` and pyarrow."""
    info = json.loads(_inspect(url))
    out = {}
    for var in info["variables"].values():
        files = [f"{url}/{f}" for f in var["files"]]
        if var["format"] == "binary":
            return _binary_rows(files, var["dim"])
        fmt = "ipc" if var["format"] == "arrow" else "parquet"
        table = pads.dataset(files, format=fmt).to_table()
        for key, value in zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True):
            out[key] = tuple(value)
    return out


def _binary_rows(files: list[str], dim: int) -> dict[int, tuple[float, ...]]:
    keys = np.concatenate([np.fromfile(f, "<i8") for f in files if f.endswith("-keys")])
    values = np.concatenate([np.fromfile(f, "<f4") for f in files if f.endswith("-values")])
    return {int(k): tuple(v) for k, v in zip(keys, values.reshape(-1, dim).tolist(), strict=True)}


def _inspect(url: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", "--json", url]) == 0
    return out.getvalue()


def test_parquet_to_arrow_keeps_rows_and_slots(tmp_path: Path) -> None:
    src = sample_checkpoint(str(tmp_path / "a"), rows=500)
    dst = str(tmp_path / "b" / "ckpt-1")
    assert main(["convert", "-q", src, dst, "--to", "arrow"]) == 0
    assert main(["verify", "-q", dst]) == 0
    info = json.loads(_inspect(dst))["variables"]["user_emb"]
    assert info["format"] == "arrow" and set(info["columns"]) == {"value", "accumulator"}
    assert rows_of(dst) == rows_of(src)


def test_to_binary_keeps_slots_as_files_of_their_own(tmp_path: Path) -> None:
    src = sample_checkpoint(str(tmp_path / "a"), rows=50)
    dst = str(tmp_path / "b" / "ckpt-1")
    assert main(["convert", "-q", src, dst, "--to", "binary"]) == 0
    assert main(["verify", "-q", dst]) == 0
    info = json.loads(_inspect(dst))["variables"]["user_emb"]
    assert info["format"] == "binary" and set(info["columns"]) == {"value", "accumulator"}
    assert sum(f.endswith("-accumulator") for f in info["files"]) >= 1
    assert rows_of(dst) == rows_of(src)


def test_convert_refuses_to_overwrite(tmp_path: Path, capsys) -> None:
    src = sample_checkpoint(str(tmp_path), rows=5)
    assert main(["convert", src, src, "--to", "arrow"]) == 1
    assert "exists already" in capsys.readouterr().err


@needs_samples
@pytest.mark.parametrize("sample", ["basic", "two_procs"])
def test_tfra_to_checkpoint_and_back_is_byte_identical(tmp_path: Path, sample: str) -> None:
    src = INTEROP / sample / "TFRADynamicEmbedding"
    dim = {"basic": "8", "two_procs": "4"}[sample]
    ours = str(tmp_path / "ckpt-1")
    assert main(["convert", "-q", str(src), ours, "--to", "parquet", "--dim", dim]) == 0
    assert main(["verify", "-q", ours]) == 0
    expected = {}
    for npz in sorted((INTEROP / sample).glob("expected_rank*.npz")):
        data = np.load(npz)
        expected.update(
            {int(k): tuple(v) for k, v in zip(data["keys"], data["values"].tolist(), strict=True)}
        )
    assert rows_of(ours) == expected
    back = tmp_path / "TFRADynamicEmbedding"
    assert main(["convert", "-q", ours, str(back), "--to", "tfra"]) == 0
    names = sorted(p.name for p in src.iterdir())
    assert sorted(p.name for p in back.iterdir()) == names
    _, mismatch, errors = filecmp.cmpfiles(src, back, names, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_tfra_source_needs_dim(tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--to", "parquet"]) == 1
    assert "give --dim" in capsys.readouterr().err


def test_tfra_slot_files_come_in_as_the_variables_slots(tmp_path: Path) -> None:
    """TFRA 0.8.1 saves Adam's slots of variable tower/emb, looked up as "lk", as the
    variables tower_emb_lk_m and tower_emb_lk_v (what it wrote in a run of TFRA 0.8.1)."""
    import pyarrow as pa
    import tensorflow as tf

    import de_store as ds
    from de_store.formats import batch_from_numpy, tfra

    keys = np.array([4, 1, 3, 2], np.int64)
    trained = np.array([3, 1], np.int64)
    rows = {
        "tower/emb": (keys, np.stack([keys, -keys], 1).astype(np.float32)),
        "tower_emb_lk_m": (trained, (np.full([2, 2], 0.5) * trained[:, None]).astype(np.float32)),
        "tower_emb_lk_v": (trained, (np.full([2, 2], 0.25) * trained[:, None]).astype(np.float32)),
    }
    folder = tmp_path / "TFRADynamicEmbedding"
    folder.mkdir()
    for name, (k, v) in rows.items():
        tfra.write_table(str(folder), name, pa.Table.from_batches([batch_from_numpy(k, v)]))
    dst = str(tmp_path / "ckpt")
    assert (
        main(
            [
                "convert",
                "-q",
                str(folder),
                dst,
                "--dim",
                "2",
                "--name",
                "tower/emb",
                "--to",
                "parquet",
            ]
        )
        == 0
    )
    var = ds.Variable("tower/emb", dim=2)
    ds.restore([var], dst)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), rows["tower/emb"][1])
    m, v = var.companions()["adam_m"], var.companions()["adam_v"]
    np.testing.assert_array_equal(m.lookup([3, 1, 4]).numpy(), [[1.5, 1.5], [0.5, 0.5], [0, 0]])
    np.testing.assert_array_equal(v.lookup(tf.constant([3], tf.int64)).numpy(), [[0.75, 0.75]])
    assert (
        main(["convert", "-q", str(folder), str(tmp_path / "all"), "--dim", "2", "--to", "parquet"])
        == 0
    )
    listed = json.loads(
        __import__("subprocess")
        .run(
            ["de-store", "inspect", "--json", str(tmp_path / "all")], capture_output=True, text=True
        )
        .stdout
    )
    assert sorted(listed["variables"]) == ["tower_emb"]  # the slot files are not variables


def tf_checkpoint_naming(prefix: Path, *names: str) -> None:
    """A TF checkpoint at ``prefix`` holding, as TFRA 0.8.1's does, an object
    ``tables_of_{name}`` for each TFRA variable (TensorFlow escapes its ``/`` and ``.``)."""
    import tensorflow as tf

    module = tf.Module()
    for name in names:
        module._track_trackable(tf.Variable([0.0]), name=f"tables_of_{name}")
    tf.train.Checkpoint(m=module).write(str(prefix))


def test_tfra_names_come_from_the_tf_checkpoint_beside_the_folder(tmp_path: Path) -> None:
    """TFRA writes variable ``tower/emb`` as files ``tower_emb_*``: the TF checkpoint it
    restores them with (``ckpt-N.index``) names it; a bare folder keeps the file names."""
    import pyarrow as pa

    import de_store as ds
    from de_store.formats import batch_from_numpy, tfra

    keys = np.array([7, -3, 5], np.int64)
    rows = {name: (keys, np.stack([keys, keys * i], 1).astype(np.float32))
            for i, name in enumerate(["tower/emb", "scope.v2/item_emb", "plain_emb"])}  # fmt: skip
    folder = tmp_path / "run" / "TFRADynamicEmbedding"
    folder.mkdir(parents=True)
    for name, (k, v) in rows.items():
        tfra.write_table(str(folder), name, pa.Table.from_batches([batch_from_numpy(k, v)]))
    tf_checkpoint_naming(tmp_path / "run" / "ckpt-1", *rows)
    dst = str(tmp_path / "ckpt")
    assert main(["convert", "-q", str(tmp_path / "run"), dst, "--dim", "2", "--to", "parquet"]) == 0
    for name, (k, v) in rows.items():
        var = ds.Variable(name, dim=2)
        ds.restore([var], dst)
        np.testing.assert_array_equal(var.lookup(k).numpy(), v)
    bare = str(tmp_path / "bare")
    assert main(["convert", "-q", str(folder), bare, "--dim", "2", "--to", "parquet"]) == 0
    assert sorted(json.loads(_inspect(bare))["variables"]) == [
        "plain_emb", "scope.v2_item_emb", "tower_emb"]  # fmt: skip
