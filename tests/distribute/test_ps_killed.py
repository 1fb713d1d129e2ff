"""A PS task killed in the middle of a save (issue 33).

A real local cluster (a chief, a worker, 2 PS tasks: every task a process) saves a table
spread over both PS tasks, with its Adagrad slot, through ``CheckpointManager``; the second
save loses PS task 1 while it writes its shard: its file-size limit parks the write of its
values bundle midway (``server.py``), and the test SIGKILLs it there. Nothing is
committed, the chief's error names the task, the first checkpoint restores exactly, and
``de-store gc`` removes everything the killed save left (PS task 0's renamed shard files,
PS task 1's bundles and ``.tempstate`` files) and nothing else.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

import de_store as ds
from de_store.cli import main as cli_main
from tests.distribute import cluster, ps_chief

pytestmark = pytest.mark.slow

#: PS task 1's files stop growing at this size: its first save's largest file (500 rows
#: of 16 float32) is below it, the second save's (5,000 rows) above.
PARK_AT = 256 * 1024
KILLED = "/job:ps/task:1"  # as the Variable names its device
TF_SLOT = "adagrad_accumulator"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The chief's report, the checkpoint directory, the files under its KV folder
    (relative paths) right after the chief failed, and the one of them PS task 1 was
    writing when it was killed."""
    directory = tmp_path_factory.mktemp("ps_killed")
    spec = cluster.cluster_spec(chief=1, worker=1, ps=2)
    with cluster.servers(spec, ["worker", "ps"], {("ps", 1): [str(PARK_AT)]}) as procs:
        chief = _start_chief(spec, directory)
        root = directory / "ckpt" / "de_store"
        parked = _wait_for_parked_write(root, chief)
        ps1 = procs[-1]  # the last task of the last job
        ps1.send_signal(signal.SIGKILL)
        assert ps1.wait(timeout=60) == -signal.SIGKILL
        assert chief.wait(timeout=300) == 0, (directory / "chief.log").read_text()[-6000:]
    report = json.loads((directory / "report.json").read_text())
    return report, directory / "ckpt", _files(root), str(parked.relative_to(root))


def _start_chief(spec: dict[str, list[str]], directory: Path) -> subprocess.Popen:
    with open(directory / "chief.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(cluster.HERE / "ps_killed_chief.py"),
             str(directory / "ckpt"), str(directory / "report.json")],
            env=cluster.task_env(spec, "chief", 0),
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def _wait_for_parked_write(root: Path, chief: subprocess.Popen, timeout_s: float = 240) -> Path:
    """The data file PS task 1 was writing when the write stopped at ``PARK_AT`` bytes:
    from then on that task is parked in the middle of its save."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in root.glob("ckpt-2.pending/**/r00000-s00001-*.tempstate*"):
            try:
                if path.stat().st_size == PARK_AT:
                    return path
            except FileNotFoundError:
                continue  # renamed meanwhile: a file below the limit
        if chief.poll() is not None:
            raise AssertionError(f"the chief ended (exit {chief.returncode}) before PS task 1 "
                                 "wrote its second save")  # fmt: skip
        time.sleep(0.05)
    raise AssertionError(f"PS task 1 wrote no file of {PARK_AT} bytes in {timeout_s} s")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_save_fails_naming_the_killed_task_and_commits_nothing(killed):
    report, directory, _, _ = killed
    assert "second" not in report
    error = report["error"]
    assert error["type"] == "CheckpointError", error
    message = error["message"]
    assert message.startswith(f"{KILLED} did not write table shard 1 of 'emb' to "), message
    assert re.search(r"/ckpt-2\.pending/[^/]+/emb/r00000-s00001-[0-9a-f]{8} \(3 ", message)
    assert ": UnavailableError: " in message and "commits nothing" in message, message
    assert tf.train.latest_checkpoint(str(directory)) == report["saved"]
    with pytest.raises(ds.errors.CheckpointNotFoundError):
        ds.restore([ds.Variable("emb", dim=report["dim"])], str(directory / "de_store/ckpt-2"))


def test_the_previous_checkpoint_restores_exactly_into_one_process(killed):
    report, directory, _, _ = killed
    saver = ds.FileSystemSaver()
    emb = ds.Variable("emb", dim=report["dim"], kv_creator=ds.HashTableCreator(saver=saver))
    tf.train.Checkpoint(emb=emb).restore(tf.train.latest_checkpoint(str(directory)))
    assert ps_chief.content(emb) == report["values"]
    slots = {name: ps_chief.content(c) for name, c in emb.companions().items()}
    assert slots == report["slots"]


def test_gc_removes_what_the_killed_save_left_and_keeps_the_checkpoint(killed, capsys):
    _, directory, left, parked = killed
    root = directory / "de_store"
    staged = [p.split("/", 2)[2] for p in left if p.startswith("ckpt-2.pending/")]
    # PS task 0's shard, written and renamed; PS task 1's, stopped in its bundle writes
    renamed = {re.sub("-[0-9a-f]{8}-", "-*-", p) for p in staged if "-s00000-" in p}
    assert renamed == {f"emb/r00000-s00000-*-{c}" for c in ("keys", "values", TF_SLOT)}
    bundle = r"emb/r00000-s00001-[0-9a-f]{8}-(values|adagrad_accumulator)\.tf\.data-00000-of-00001"
    assert parked in left and re.fullmatch(rf"ckpt-2\.pending/[^/]+/{bundle}\.tempstate\d+", parked)
    committed = {p: (root / p).read_bytes() for p in left if p.startswith("ckpt-1/")}
    assert cli_main(["gc", "--yes", "--grace", "0", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "removed ckpt-2.pending: staging folder of a save that never committed",
        f"removed 1 item(s) under {root}",
    ]
    assert _files(root) == sorted(committed)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-1"]
    assert all((root / p).read_bytes() == data for p, data in committed.items())
    assert cli_main(["verify", "-q", str(root / "ckpt-1")]) == 0
