"""ParameterServerStrategy restores read where the tables live (de_store.saver.device_restore).

One real local cluster (a chief, a worker, 3 PS tasks: every task a process) runs
``ps_restore_chief.py``: a Variable on 2 PS tasks with an Adagrad slot, saved by the PS
tasks, is restored into 2 and into 3 PS tasks by the tasks themselves, and through the
chief as the reference; a parquet checkpoint falls back to the chief; a changed byte fails
its crc32c, naming the file, and leaves the tables as they were.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.distribute import cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ps_restore")
    spec = cluster.cluster_spec(chief=1, worker=1, ps=3)
    with cluster.servers(spec, ["worker", "ps"]):
        cluster.run_task(
            "ps_restore_chief.py", spec, "chief", 0, str(directory), str(directory / "r.json")
        )
    return json.loads((directory / "r.json").read_text())


@pytest.mark.parametrize("restore", ["two", "three"])
def test_the_ps_tasks_restore_every_row_and_slot_exactly(report, restore: str) -> None:
    found = report[restore]
    assert found["error"] is None
    assert found["exact"]  # values and Adagrad slots, as saved
    tasks = 2 if restore == "two" else 3
    assert len(found["per_task"]) == tasks and all(n > 0 for n in found["per_task"])
    assert sum(found["per_task"]) == report["keys"] and found["placed"]
    devices = ", ".join(f"/job:ps/task:{i}" for i in range(tasks))
    (line,) = [x for x in found["lines"] if x.startswith("read ")]
    pattern = rf"read {report['keys']:,} rows of 'emb' \(.+ of shards\) on {devices} in \S+ s, "
    sent = re.fullmatch(pattern + r"([\d,]+) of them sent task to task", line)
    assert sent is not None, line
    # the same count reads each part on its task; 3 tasks get rows from each other
    assert (sent[1] == "0") == (restore == "two")


@pytest.mark.parametrize("restore", ["two", "three"])
def test_the_chief_moves_under_one_percent_of_the_table_bytes(report, restore: str) -> None:
    """The chief's own TCP bytes, sent and received, during the restore; the reference
    (the parquet checkpoint's restore, through the chief) shows that they count the rows
    the chief moves."""
    table = report["table_bytes"]
    moved = report[restore]["chief_sent"] + report[restore]["chief_received"]
    assert moved < 0.01 * table
    assert report["parquet"]["chief_sent"] > table


def test_a_parquet_checkpoint_is_read_through_the_chief_saying_why(report) -> None:
    found = report["parquet"]
    assert found["error"] is None and found["exact"]
    (line,) = [x for x in found["lines"] if "read through this process" in x]
    assert line.startswith("rows for /job:ps/task:0, /job:ps/task:1 are read through this")
    assert "is parquet, the tasks read binary only" in line


def test_a_changed_byte_fails_its_crc32c_naming_the_file_and_changes_nothing(report) -> None:
    found = report["damaged"]
    assert found["error"]["type"] == "ChecksumError"
    assert "crc32c mismatch in part 0 of " in found["error"]["message"]
    assert found["file"] in found["error"]["message"]
    assert found["unchanged"]
