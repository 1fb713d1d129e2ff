"""``de-store ls``, ``inspect``, ``verify`` and ``gc`` on real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run

from de_store.cli import main
from de_store.testing.sample import sample_checkpoint


def test_inspect_json_describes_variables_and_topology(capsys, checkpoint: str) -> None:
    code, out, _ = run(capsys, "inspect", "--json", checkpoint)
    info = json.loads(out)
    assert code == 0
    assert info["topology"] == {"proc_size": 1, "shards_per_rank": {"0": 1}}
    assert info["rows"] == 300 and info["generation"] == 1
    var = info["variables"]["user_emb"]
    assert {k: var[k] for k in ("dim", "key_dtype", "value_dtype", "format", "rows", "shards")} == {
        "dim": 8,
        "key_dtype": "int64",
        "value_dtype": "float32",
        "format": "parquet",
        "rows": 300,
        "shards": 1,
    }
    assert set(var["columns"]) == {"value", "accumulator"}
    assert var["bytes"] == sum(os.path.getsize(f"{checkpoint}/{f}") for f in var["files"])


def test_inspect_table_names_each_variable(capsys, checkpoint: str) -> None:
    code, out, _ = run(capsys, "inspect", checkpoint)
    assert code == 0
    assert "user_emb" in out and "accumulator" in out and "parquet" in out


def test_ls_lists_committed_and_uncommitted_checkpoints(capsys, tmp_path: Path) -> None:
    sample_checkpoint(str(tmp_path), rows=10, step=3)
    broken = tmp_path / "ckpt-7.pending" / "user_emb"
    broken.mkdir(parents=True)
    (broken / "r00000-s00000-x.parquet").write_bytes(b"half a file")
    code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
    found = {s["path"]: s for s in json.loads(out)}
    assert code == 0
    assert found["ckpt-3"]["status"] == "committed" and found["ckpt-3"]["step"] == 3
    assert found["ckpt-3"]["committed"] is not None and found["ckpt-3"]["bytes"] > 0
    assert found["ckpt-7.pending"]["status"] == "uncommitted"
    assert found["ckpt-7.pending"]["step"] == 7 and found["ckpt-7.pending"]["bytes"] == 11
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert "ckpt-3" in out and "committed" in out and "uncommitted" in out


def test_verify_intact_checkpoint_exits_0(capsys, checkpoint: str) -> None:
    code, out, _ = run(capsys, "verify", checkpoint)
    assert code == 0 and out.startswith("OK ")


def test_verify_names_a_corrupted_file_and_exits_1(capsys, tmp_path: Path) -> None:
    url = sample_checkpoint(str(tmp_path), rows=200)
    (shard,) = Path(url, "user_emb").glob("*.parquet")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, one flipped byte: only a checksum can tell
    shard.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", url)
    assert code == 1
    assert f"BAD user_emb/{shard.name}" in out and "crc32c" in out.lower()
    assert err.startswith("de-store: error:")


def test_verify_names_a_missing_file(capsys, tmp_path: Path) -> None:
    url = sample_checkpoint(str(tmp_path), rows=20)
    (shard,) = Path(url, "user_emb").glob("*.parquet")
    shard.unlink()
    code, out, _ = run(capsys, "verify", url)
    assert code == 1 and f"BAD user_emb/{shard.name}: missing" in out


def test_gc_dry_run_lists_then_gc_removes_only_abandoned(capsys, tmp_path: Path) -> None:
    sample_checkpoint(str(tmp_path), rows=10, step=1)
    (tmp_path / "ckpt-2.pending" / "_ranks").mkdir(parents=True)
    (tmp_path / "ckpt-2.pending" / "_ranks" / "rank-00000.json").write_text("{}")
    code, out, _ = run(capsys, "gc", "--dry-run", "--grace", "0", str(tmp_path))
    assert code == 0 and "would remove ckpt-2.pending" in out
    assert (tmp_path / "ckpt-2.pending").exists()
    code, out, _ = run(capsys, "gc", "--yes", "--grace", "0", str(tmp_path))
    assert code == 0 and "removed ckpt-2.pending" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]


def test_errors_are_one_line_with_exit_code(capsys, tmp_path: Path) -> None:
    code, out, err = run(capsys, "inspect", str(tmp_path / "nothing-here"))
    assert code == 1 and out == ""
    assert err.startswith("de-store: error: no committed checkpoint at") and err.count("\n") == 1
    code, _, err = run(capsys, "inspect")  # missing argument: a usage error
    assert code == 2 and "usage:" in err
    with pytest.raises(Exception, match="no committed checkpoint"):
        main(["inspect", "--debug", str(tmp_path / "nothing-here")])


def test_console_script_starts_without_tensorflow(checkpoint: str) -> None:
    code = (
        "import sys; from de_store.cli import main; "
        f"rc = main(['inspect', {checkpoint!r}]); "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    result = subprocess.run(
        ["de-store", "verify", "-q", checkpoint], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
