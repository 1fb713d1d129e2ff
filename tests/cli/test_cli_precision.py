"""``de-store verify``, ``inspect`` and ``convert`` of a compressed, int8 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from cli_helpers import run

import de_store as ds

DIM = 8


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple]]:
    """A checkpoint of 400 rows saved as int8 values in zstd Parquet, and its rows as a
    restore gives them."""
    url = str(tmp_path_factory.mktemp("int8") / "ckpt")
    var = ds.Variable("emb", dim=DIM, kv_creator=ds.HashTableCreator())
    rng = np.random.default_rng(3)
    keys = np.arange(400, dtype=np.int64)
    var.upsert(keys, rng.standard_normal((400, DIM)).astype(np.float32))
    ds.save([var], url, blocking=True, compression="zstd", value_precision="int8")
    back = ds.Variable("emb", dim=DIM, kv_creator=ds.HashTableCreator())
    ds.restore([back], url)
    got_keys, got_values = back.export()
    rows = dict(zip(got_keys.numpy().tolist(), map(tuple, got_values.numpy()), strict=True))
    return url, rows


def test_verify_checks_every_checksum(capsys: pytest.CaptureFixture[str], int8_checkpoint) -> None:
    url, _ = int8_checkpoint
    code, out, _ = run(capsys, "verify", "-q", url)
    assert code == 0
    assert out.startswith(f"OK {url}: 1 files, ") and out.endswith(
        "400 rows, every checksum matches\n"
    )


def test_inspect_shows_compression_and_precision(
    capsys: pytest.CaptureFixture[str], int8_checkpoint
) -> None:
    url, _ = int8_checkpoint
    code, out, _ = run(capsys, "inspect", url)
    assert code == 0
    header, row = out.splitlines()[-2:]
    assert header.split() == ["VARIABLE", "DIM", "KEY", "VALUE", "COLUMNS", "ROWS", "REMOVED",
                              "SHARDS", "SIZE", "FORMAT", "COMPRESSION", "STORED-AS",
                              "SAVED-AS"]  # fmt: skip
    fields = row.split()
    assert (fields[0], fields[3], fields[-4:]) == ("emb", "float32",
                                                  ["parquet", "zstd", "int8", "full"])  # fmt: skip
    code, out, _ = run(capsys, "inspect", "--json", url)
    var = json.loads(out)["variables"]["emb"]
    assert (var["compression"], var["compression_level"], var["value_precision"]) == (
        "zstd", None, "int8")  # fmt: skip
    assert var["stored_columns"] == {
        "value": {"dtype": "packed_int8", "dim": DIM},
        "value_scale": {"dtype": "float16", "dim": 1},
    }


@pytest.mark.parametrize("to", ["arrow", "parquet"])
def test_convert_to_a_format_writes_float32_values(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, int8_checkpoint, to: str
) -> None:
    url, rows = int8_checkpoint
    out_url = str(tmp_path / "out")
    code, _, _ = run(capsys, "convert", "-q", url, out_url, "--to", to)
    assert code == 0
    _, out, _ = run(capsys, "inspect", "--json", out_url)
    var = json.loads(out)["variables"]["emb"]
    assert (var["compression"], var["value_precision"], var["stored_columns"]) == (
        "none", "float32", {})  # fmt: skip
    files = [f"{out_url}/{f}" for f in var["files"]]
    table = pads.dataset(files, format="ipc" if to == "arrow" else "parquet").to_table()
    assert table.schema.field("value").type == pa.list_(pa.field("element", pa.float32(), False),
                                                        DIM)  # fmt: skip
    values = np.array(table["value"].to_pylist(), np.float32)
    got = dict(zip(table["key"].to_pylist(), map(tuple, values), strict=True))
    assert got == rows


def test_convert_to_tfra_writes_float32_values(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, int8_checkpoint
) -> None:
    url, rows = int8_checkpoint
    folder = tmp_path / "tfra"
    assert run(capsys, "convert", "-q", url, str(folder), "--to", "tfra")[0] == 0
    keys = np.concatenate([np.fromfile(f, "<i8") for f in sorted(folder.glob("*-keys"))])
    values = np.concatenate([np.fromfile(f, "<f4") for f in sorted(folder.glob("*-values"))])
    got = dict(zip(keys.tolist(), map(tuple, values.reshape(-1, DIM)), strict=True))
    assert got == rows
