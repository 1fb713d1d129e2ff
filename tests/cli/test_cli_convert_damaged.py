"""``de-store convert`` of damaged TFRA folders (copies of the real TFRA 0.8.1 samples): the
command fails naming the file, what it expected and what it found, and nothing is committed
at the destination (no checkpoint folder, no staging that ``de-store gc`` would not remove).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run

from de_store.catalog import list_checkpoints

INTEROP = Path("/work/shared/interop/tfra-0.8.1")
pytestmark = pytest.mark.skipif(not INTEROP.exists(), reason="TFRA samples not present")

#: The table of the basic sample (dim 8, float32) that each test damages: the second one,
#: so that the first is read, and would be written, before the damage is met.
STEM = "user_emb_mht_2of2_rank0_size1"
ROW_BYTES = 8 * 4


def sample(tmp_path: Path, name: str = "basic") -> Path:
    folder = tmp_path / "src" / "TFRADynamicEmbedding"
    shutil.copytree(INTEROP / name / "TFRADynamicEmbedding", folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


def damage(folder: Path, stem: str, how: str) -> tuple[str, int, int]:
    """Damage ``stem``'s pair as ``how`` says; the damaged file, its key count, its size."""
    keys, values = folder / f"{stem}-keys", folder / f"{stem}-values"
    if how == "values not whole rows":
        values.write_bytes(values.read_bytes()[:-3])
    elif how == "empty keys":
        keys.write_bytes(b"")
    elif how == "empty values":
        values.write_bytes(b"")
    elif how == "more keys than rows":
        extra = np.arange(10**9, 10**9 + 5, dtype="<i8").tobytes()
        keys.write_bytes(keys.read_bytes() + extra)
    elif how == "keys not whole":
        keys.write_bytes(keys.read_bytes() + b"\x01\x02")
        return str(keys), keys.stat().st_size, keys.stat().st_size
    return str(values), keys.stat().st_size // 8, values.stat().st_size


def nothing_committed(capsys: pytest.CaptureFixture[str], parent: Path) -> None:
    """No checkpoint under ``parent``; ``de-store gc`` leaves nothing there."""
    if not parent.exists():
        return
    assert [c.path for c in list_checkpoints(str(parent))] == []
    code, _, err = run(capsys, "gc", "--yes", "--grace", "0", str(parent))
    assert code == 0, err
    assert list(parent.rglob("*")) == []


HOWS = ["values not whole rows", "empty keys", "empty values", "more keys than rows"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("to", ["parquet", "binary"])
def test_a_damaged_pair_fails_naming_the_file_and_commits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, to: str
) -> None:
    folder = sample(tmp_path)
    path, keys, size = damage(folder, STEM, how)
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out / "ckpt-1"), "--to", to,
                       "--dim", "8")  # fmt: skip
    assert code == 1
    expected = f"expected {keys:,} keys x dim 8 x 4 bytes (float32) = {keys * ROW_BYTES:,} bytes"
    assert f"de-store: error: TFRA values file {path}: {expected}, found {size:,}" in err
    assert f"(the keys are those of {STEM}-keys, {keys * 8:,} bytes)" in err
    nothing_committed(capsys, out)


def test_a_keys_file_of_part_of_a_key_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = sample(tmp_path)
    path, _, size = damage(folder, STEM, "keys not whole")
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out / "ckpt-1"), "--to",
                       "parquet", "--dim", "8")  # fmt: skip
    assert code == 1
    assert (
        f"TFRA keys file {path}: expected a whole number of 8-byte int64 keys, found {size} bytes"
    ) in err
    nothing_committed(capsys, out)


def test_a_damaged_rank_fails_after_a_sound_one_and_commits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 of two is damaged: rank 0 alone must not become a checkpoint."""
    folder = sample(tmp_path, "two_procs")
    path, keys, size = damage(folder, "item_emb_mht_1of1_rank1_size2", "more keys than rows")
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out / "ckpt-1"), "--to",
                       "arrow", "--dim", "4")  # fmt: skip
    assert code == 1
    assert f"TFRA values file {path}: expected {keys:,} keys x dim 4" in err
    assert f"found {size:,}" in err
    nothing_committed(capsys, out)


def test_a_keys_file_holding_a_key_twice_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes that fit, but a key written over the next one: the checkpoint would hold the
    key twice, which no restore accepts."""
    folder = sample(tmp_path)
    keys = folder / f"{STEM}-keys"
    data = bytearray(keys.read_bytes())
    data[8:16] = data[0:8]
    keys.write_bytes(bytes(data))
    key = int(np.frombuffer(bytes(data[:8]), "<i8")[0])
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out / "ckpt-1"), "--to",
                       "parquet", "--dim", "8")  # fmt: skip
    assert code == 1
    assert (
        f"TFRA keys file {keys}: expected each key once, found key {key} 2 times "
        "(1 extra copies of keys in all)"
    ) in err
    nothing_committed(capsys, out)


def test_a_damaged_pair_converted_to_tfra_writes_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = sample(tmp_path)
    path, _, _ = damage(folder, STEM, "empty values")
    out = tmp_path / "out" / "TFRADynamicEmbedding"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out), "--to", "tfra",
                       "--dim", "8")  # fmt: skip
    assert code == 1
    assert f"TFRA values file {path}: expected" in err
    assert not out.exists() or list(out.rglob("*")) == []


def test_a_missing_values_file_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = sample(tmp_path)
    (folder / f"{STEM}-values").unlink()
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(out / "ckpt-1"), "--to",
                       "parquet", "--dim", "8")  # fmt: skip
    assert code == 1
    assert f"{STEM}-values" in err
    nothing_committed(capsys, out)


def test_empty_keys_and_values_are_an_empty_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TFRA writes an empty table as two empty files: that is no damage."""
    folder = sample(tmp_path)
    (folder / f"{STEM}-keys").write_bytes(b"")
    (folder / f"{STEM}-values").write_bytes(b"")
    dst = tmp_path / "out" / "ckpt-1"
    code, _, err = run(capsys, "convert", "-q", str(folder), str(dst), "--to", "parquet",
                       "--dim", "8")  # fmt: skip
    assert code == 0, err
    assert run(capsys, "verify", "-q", str(dst))[0] == 0
    expected = np.load(INTEROP / "basic" / "expected_rank0.npz")["keys"]
    table_1 = np.fromfile(folder / "user_emb_mht_1of2_rank0_size1-keys", "<i8")
    assert set(table_1) < set(expected.tolist())
    import de_store as ds

    var = ds.Variable("user_emb", dim=8)
    ds.restore([var], str(dst))
    assert sorted(var.export()[0].numpy().tolist()) == sorted(table_1.tolist())
