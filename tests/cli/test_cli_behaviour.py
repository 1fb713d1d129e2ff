"""How ``de-store`` behaves as a command: --version, help, Ctrl-C, a closed pipe, a missing
path, an unreachable storage server, TFRA sizes, and no TensorFlow where no table runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run

import de_store as ds
from de_store.testing import servers
from de_store.testing.sample import sample_checkpoint
from de_store.testing.tfra_sample import tfra_sample

#: The command, run from the de_store that this test imports.
DE_STORE = [sys.executable, "-m", "de_store.cli"]
#: The command, started with Python's own SIGINT handler: a parent that ignores SIGINT
#: (nohup, a background job of a non-interactive shell) would pass that on to the child.
DE_STORE_INTERRUPTIBLE = [
    sys.executable,
    "-c",
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'de-store'; runpy.run_module('de_store.cli', run_name='__main__')",
]


def test_version_comes_from_the_package_metadata(capsys) -> None:
    version = importlib.metadata.version("de_store")
    assert ds.__version__ == version
    assert run(capsys, "--version") == (0, f"de-store {version}\n", "")


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc", "demo", "convert"])
def test_every_url_argument_has_help(capsys, command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    positionals = out.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0]
    for line in positionals.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            assert len(line.split(None, 1)) == 2, f"{command}: {line.strip()} has no help"


def test_convert_help_says_tfra_files_record_no_dtype(capsys) -> None:
    _, out, _ = run(capsys, "convert", "--help")
    text = " ".join(out.split())
    assert "TFRA files hold raw keys and values and record no dim and no dtype" in text
    assert "a values file must hold keys x dim x itemsize bytes" in text


def test_ls_on_a_missing_path_says_so_and_exits_1(capsys, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-folder")
    assert run(capsys, "ls", missing) == (1, "", f"de-store: error: {missing} does not exist\n")
    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    assert run(capsys, "ls", empty) == (0, f"no checkpoints under {empty}\n", "")


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("gs", {"token": "anon"}), ("s3", servers.MOTO_CREDENTIALS)],
)
def test_an_unreachable_storage_server_fails_at_once_in_one_line(
    capsys, scheme: str, options: dict[str, str]
) -> None:
    port = servers.free_port()  # nothing listens there: connections are refused
    endpoint = json.dumps({"endpoint_url": f"http://127.0.0.1:{port}", **options})
    code, out, err = run(capsys, "ls", f"{scheme}://bkt/x", "--storage-options", endpoint)
    assert (code, out) == (1, "")
    assert err == (
        f"de-store: error: cannot reach the storage server 127.0.0.1:{port} of {scheme}://bkt/x:"
        " Connection refused (check the network, or the endpoint_url storage option)\n"
    )


def test_ctrl_c_exits_130(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        server.settimeout(60)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        options = json.dumps({"endpoint_url": endpoint, **servers.MOTO_CREDENTIALS})
        proc = subprocess.Popen(
            [*DE_STORE_INTERRUPTIBLE, "ls", "s3://bkt/x", "--storage-options", options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        reachable, _ = server.accept()  # the command checks the server first
        request, _ = server.accept()  # then lists: the command is running
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        reachable.close()
        request.close()
    assert (proc.returncode, out, err) == (130, "", "de-store: interrupted\n")


def test_a_closed_pipe_ends_quietly(checkpoint: str) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written, as with `| head`
    try:
        result = subprocess.run(
            [*DE_STORE, "inspect", "--json", checkpoint],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_tfra_values_file_of_the_wrong_size_is_refused_before_writing(
    capsys, tmp_path: Path
) -> None:
    folder = Path(tfra_sample(str(tmp_path / "tfra")))
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "convert", str(folder), str(out), "--to", "parquet", "--dim", "8",
        "--value-dtype", "float64",
    )  # fmt: skip
    assert code == 1 and not out.exists()
    assert err.startswith("de-store: error: TFRA values file ")
    assert "x dim 8 x 8 bytes (float64) = " in err and "bytes, found " in err
    assert "TFRA files record no dim or dtype: check --dim and --value-dtype" in err


def commands_without_tables(tmp_path: Path) -> list[list[str]]:
    """ls, inspect and verify of a checkpoint."""
    source = sample_checkpoint(str(tmp_path / "ckpts"), rows=50, step=1)
    (tmp_path / "ckpts" / "ckpt-2.pending").mkdir()
    return [["ls", str(tmp_path / "ckpts")], ["inspect", source], ["verify", source]]


def test_tensorflow_stays_out_of_commands_that_run_no_table(tmp_path: Path) -> None:
    commands = commands_without_tables(tmp_path)
    script = (
        "import json, sys; from de_store.cli import main; "
        "codes = [main(argv) for argv in json.loads(sys.argv[1])]; "
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.startswith('tensorf'))]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True
    )
    codes, tensorflow = json.loads(result.stdout.splitlines()[-1])
    assert codes == [0] * len(commands), result.stdout + result.stderr
    assert tensorflow == []
