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


def test_to_binary_refuses_extra_columns_unless_values_only(tmp_path: Path, capsys) -> None:
    src = sample_checkpoint(str(tmp_path / "a"), rows=50)
    dst = str(tmp_path / "b" / "ckpt-1")
    assert main(["convert", src, dst, "--to", "binary"]) == 1
    err = capsys.readouterr().err
    assert "'user_emb' cannot be written as binary" in err and "--values-only" in err
    assert not Path(dst).exists()
    assert main(["convert", "-q", src, dst, "--to", "binary", "--values-only"]) == 0
    assert main(["verify", "-q", dst]) == 0
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
