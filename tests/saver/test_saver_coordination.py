"""Two workers of a real ``tf.distribute`` cluster save through the coordination service:
they agree on each save's attempt through its key-value store and meet at its barriers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from coordination_worker import KEYS_PER_RANK
from mp_worker import expected_rows, rank_keys

import de_store as ds
from de_store.backends import open_backend
from de_store.checkpoint.commit import read_manifest
from de_store.testing.servers import free_ports

WORKER = str(Path(__file__).with_name("coordination_worker.py"))


def test_workers_save_through_the_coordination_service(tmp_path: Path) -> None:
    urls = [str(tmp_path / "step-1"), str(tmp_path / "step-2")]
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(2)]}
    procs = []
    for rank in range(2):
        config = {"cluster": cluster, "task": {"type": "worker", "index": rank}}
        env = {**os.environ, "TF_CONFIG": json.dumps(config)}
        procs.append(subprocess.Popen([sys.executable, WORKER, *urls], env=env,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [e[-3000:] for e in errors]
    saved = np.sort(np.concatenate([rank_keys(2, r, KEYS_PER_RANK) for r in range(2)]))
    for url in urls:
        var = ds.Variable("emb", dim=4)
        manifest = ds.restore([var], url)
        keys, values = (t.numpy() for t in var.export())
        order = np.argsort(keys)
        np.testing.assert_array_equal(keys[order], saved)
        np.testing.assert_array_equal(values[order], expected_rows(saved))
        assert manifest.proc_size == 2
        _, manifest = read_manifest(open_backend(str(tmp_path)), Path(url).name)
        assert sorted(s.rank for s in manifest.variables["emb"].shards) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
