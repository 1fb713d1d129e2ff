"""A trainer process for the follower tests: changes a Variable and saves checkpoints.

    python follow_trainer.py ROOT STATES STEPS MODE [lockstep]

Each step upserts rows (new keys and existing ones) and removes a few keys, writes the
Variable's whole content to ``STATES/state-{step}.npz`` (keys sorted, with their rows),
then saves:

- MODE ``save``: ``de_store.save`` into ``ROOT/ckpt-{step}``, incremental, a full
  checkpoint every third save;
- MODE ``manager``: ``tf.train.CheckpointManager(max_to_keep=2)`` on ``ROOT`` with an
  incremental ``FileSystemSaver`` (a full checkpoint every third save): each save deletes
  the KV checkpoints whose TF checkpoint the manager dropped, as gc does, while the test's
  process follows ``ROOT/de_store``.

With ``lockstep`` the trainer waits after each save until ``STATES/ack-{step}`` exists
(the follower checked that step), so that every checkpoint is applied on its parent.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import tensorflow as tf

import de_store as ds

root, states, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
lockstep = sys.argv[5:] == ["lockstep"]
policy = ds.IncrementalPolicy(full_every=3, max_chain_ratio=1e9)
saver = ds.FileSystemSaver(incremental=policy)
var = ds.Variable("emb", dim=4, devices=["/CPU:0", "/CPU:0"],
                  kv_creator=ds.HashTableCreator(saver=saver))  # fmt: skip
manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=var), root, max_to_keep=2)
rng = np.random.default_rng(5)
for step in range(steps):
    keys = rng.integers(0, 3000, 200).astype(np.int64)  # new keys and keys held already
    var.upsert(tf.constant(keys), tf.constant(rng.standard_normal((200, 4)), tf.float32))
    var.remove(tf.constant(rng.integers(0, 3000, 20).astype(np.int64)))
    held, rows = (t.numpy() for t in var.export())
    order = np.argsort(held)
    np.savez(f"{states}/.state-{step}.npz", keys=held[order], values=rows[order])
    os.replace(f"{states}/.state-{step}.npz", f"{states}/state-{step}.npz")
    if mode == "save":
        ds.save([var], f"{root}/ckpt-{step}", incremental=policy, blocking=True)
    else:
        manager.save(checkpoint_number=step)
    deadline = time.monotonic() + 60
    while lockstep and not os.path.exists(f"{states}/ack-{step}"):
        if time.monotonic() > deadline:
            sys.exit(f"no ack-{step} from the follower within 60 s")
        time.sleep(0.005)
print("trainer done", flush=True)
