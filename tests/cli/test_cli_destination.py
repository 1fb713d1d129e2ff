"""Destinations are checked before any work: ``de-store demo`` fails before training (no
TensorFlow imported), a save before writing anything, ``convert`` before reading."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf

import de_store as ds
from de_store.cli import main
from de_store.errors import DestinationError
from de_store.testing import StorageLocation
from de_store.testing.sample import sample_checkpoint


def run_cli(*argv: str) -> tuple[int, str, str, bool]:
    """``de-store ARGV`` in a new process: exit code, stdout, stderr, TensorFlow imported."""
    code = (
        "import sys; from de_store.cli import main; rc = main(sys.argv[1:]); "
        "print('TF', 'tensorflow' in sys.modules, file=sys.stderr); sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    err, _, tf_line = result.stderr.rstrip("\n").rpartition("\n")
    return result.returncode, result.stdout, err + "\n" if err else "", tf_line == "TF True"


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder this process cannot create files in. Mode bits stop anyone but root; root
    gets /sys, where even root cannot create a file."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except PermissionError:
        yield folder
    else:  # root: mode bits do not apply
        (folder / "probe").unlink()
        yield Path("/sys")
    finally:
        folder.chmod(0o755)


def test_demo_with_an_unknown_protocol_fails_at_once_in_one_line() -> None:
    code, out, err, tf_imported = run_cli("demo", "s4://x/y")
    assert code == 1 and out == "" and not tf_imported
    assert err == (
        "de-store: error: unknown storage protocol 's4': neither de_store nor fsspec serves "
        "it (fsspec.available_protocols() lists the known ones)\n"
    )


def test_demo_into_an_unwritable_folder_fails_before_training(unwritable_dir: Path) -> None:
    code, out, err, tf_imported = run_cli("demo", str(unwritable_dir / "demo"))
    assert code == 1 and out == "" and not tf_imported
    kv = unwritable_dir / "demo" / "de_store" / "ckpt-200"
    assert err == (
        f"de-store: error: cannot save checkpoint {kv}: folder {unwritable_dir} is not "
        "writable (PermissionError: Permission denied)\n"
    )
    assert not (unwritable_dir / "demo").exists()


def test_demo_under_a_file_fails_before_training(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    code, _, err, tf_imported = run_cli("demo", str(tmp_path / "afile" / "demo"))
    kv = tmp_path / "afile" / "demo" / "de_store" / "ckpt-200"
    assert code == 1 and not tf_imported
    assert err == (
        f"de-store: error: cannot save checkpoint {kv}: {tmp_path / 'afile'} is a file, so "
        f"the folders of {kv} cannot be created in it\n"
    )


def test_demo_into_a_missing_bucket_fails_before_training(s3_location: StorageLocation) -> None:
    options = json.dumps(s3_location.storage_options)
    code, _, err, tf_imported = run_cli(
        "demo", "s3://no-such-bucket/demo", "--storage-options", options
    )
    assert code == 1 and not tf_imported
    assert err.startswith(
        "de-store: error: cannot save checkpoint s3://no-such-bucket/demo/de_store/ckpt-200: "
        "writing a test object there failed: "
    )
    assert err.count("\n") == 1


def variable() -> ds.Variable:
    var = ds.Variable("emb", dim=2, devices=["/CPU:0"])
    var.upsert(tf.constant([1, 2, 3], tf.int64), tf.ones([3, 2]))
    return var


def test_save_aimed_at_a_file_fails_before_writing_anything(tmp_path: Path) -> None:
    target = tmp_path / "afile.txt"
    target.write_text("keep me")
    with pytest.raises(DestinationError) as info:
        ds.save([variable()], str(target))  # raised here, before the tables are read
    assert str(info.value) == (
        f"cannot save checkpoint {target}: {target} is a file, expected a folder (or nothing)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt"]  # no afile.txt.pending
    assert target.read_text() == "keep me"


def test_save_into_an_unwritable_folder_fails_before_writing(unwritable_dir: Path) -> None:
    with pytest.raises(DestinationError, match=f"folder {unwritable_dir} is not writable"):
        ds.save([variable()], str(unwritable_dir / "run" / "ckpt-1"), blocking=True)


def test_convert_to_a_path_under_a_file_fails_before_reading(capsys, tmp_path: Path) -> None:
    source = sample_checkpoint(str(tmp_path / "src"), rows=10)
    (tmp_path / "afile").write_text("")
    code = main(["convert", source, str(tmp_path / "afile" / "out"), "--to", "arrow"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err.startswith(
        f"de-store: error: cannot save checkpoint {tmp_path / 'afile' / 'out'}: "
        f"{tmp_path / 'afile'} is a file"
    )


@pytest.mark.slow
def test_demo_passes_storage_options_to_save_restore_and_inspect_commands(
    capsys, s3_location: StorageLocation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the TF bundle of a remote demo goes to ./de_store_demo_tf
    url = f"{s3_location.url}/demo"
    options = json.dumps(s3_location.storage_options)
    argv = ["demo", url, "--storage-options", options, "--steps", "2", "--ids", "500", "-q"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "OK: 500 keys and their optimizer slots restored equal" in out
    flag = f"--storage-options {shlex.quote(options)}"
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("de-store")]
    assert commands == [
        f"de-store inspect {url}/de_store/ckpt-2 {flag}",
        f"de-store verify {url}/de_store/ckpt-2 {flag}",
        f"de-store ls {url}/de_store {flag}",
    ]
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0
    assert "ckpt-2" in capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    start = lines.index("open a shard with pyarrow:") + 1
    snippet = lines[start : start + 5]
    assert snippet[2].startswith("fs, path = fsspec.core.url_to_fs(") and options[1:-1] in (
        snippet[2].replace("'", '"')
    )
    exec("\n".join(snippet), {})  # the printed snippet opens the shard on S3
