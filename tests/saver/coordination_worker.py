"""One worker of a two-worker ``tf.distribute`` cluster that saves through the coordination
service's barrier, run as a real process by the tests (``TF_CONFIG`` set by them).

    python coordination_worker.py URL...

Rank r saves the keys ``r, r + 2, ...`` (rows ``mp_worker.expected_rows``) into every URL,
one blocking save after another.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf
from mp_worker import expected_rows, rank_keys

import de_store as ds
from de_store.checkpoint.barrier import CoordinationServiceBarrier
from de_store.checkpoint.topology import detect_topology

KEYS_PER_RANK = 500


def main(urls: list[str]) -> None:
    tf.distribute.MultiWorkerMirroredStrategy()  # joins the cluster: the coordination service
    topology = detect_topology()
    assert topology.source == "TF_CONFIG" and topology.proc_size == 2, topology
    saver = ds.FileSystemSaver(barrier=CoordinationServiceBarrier(topology), barrier_timeout_s=120)
    var = ds.Variable("emb", dim=4)
    keys = rank_keys(2, topology.proc_rank, KEYS_PER_RANK)
    var.upsert(keys, expected_rows(keys))
    for url in urls:
        ds.save([var], url, saver=saver, blocking=True)


if __name__ == "__main__":
    main(sys.argv[1:])
