"""Serving follows training: a trainer saves incremental checkpoints, and a server applies
each one to its live table, which lookups can read all the while.

The script starts the trainer as a child process (this script, ``--role trainer``). It
fills a small Variable, saves a full checkpoint ``ROOT/ckpt-0``, then every ``--interval``
seconds changes a few rows (updates, new keys, removals) and saves ``ROOT/ckpt-N``: a
delta, or a full checkpoint when the default ``IncrementalPolicy`` asks for one (every
tenth save, or once the chain's deltas outgrow half of its full checkpoint).
The main process follows ``ROOT`` with ``de_store.follow`` and prints a line for each
checkpoint it applies, with the staleness it serves (now minus the checkpoint's commit)::

    serving ckpt-3: 1,030 keys, 16 rows changed, staleness 0.21 s

After ``--seconds`` (or once the trainer saved ``--saves`` times after ckpt-0) it stops
the trainer, waits until it serves the trainer's last checkpoint, stops the follower, and
prints the digest of the trainer's last saved rows and of the rows it serves: they are
the same.

Run ``python examples/serve_live.py`` (``--root DIR`` keeps the checkpoints).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import de_store as ds


def digest(variable: ds.Variable) -> str:
    """A short hash of the table's rows in key order."""
    keys, values = (t.numpy() for t in variable.export())
    order = np.argsort(keys)
    return hashlib.sha256(keys[order].tobytes() + values[order].tobytes()).hexdigest()[:16]


def trainer(args: argparse.Namespace) -> None:
    """Save ckpt-0, then a delta every ``--interval`` s until stdin closes or ``--saves``."""
    rng = np.random.default_rng(0)
    table = ds.Variable("embedding", dim=8)
    keys = np.arange(args.keys, dtype=np.int64)
    table.upsert(keys, rng.standard_normal((args.keys, 8), dtype=np.float32))
    ds.save([table], f"{args.root}/ckpt-0", incremental=True, blocking=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    step = 0
    while step < args.saves and not stop.wait(args.interval):
        step += 1
        moved = rng.choice(args.keys // 2, 10, replace=False)  # ten rows move,
        added = args.keys + 4 * step + np.arange(4)  # four ids appear,
        table.upsert(np.concatenate([moved, added]), rng.standard_normal((14, 8), np.float32))
        table.remove(args.keys - 2 * step + np.arange(2))  # and two old ids go
        ds.save([table], f"{args.root}/ckpt-{step}", incremental=True, blocking=True)
    print(f"ckpt-{step} {digest(table)}", flush=True)


def server(args: argparse.Namespace) -> None:
    """Follow the trainer's checkpoints and print each one served."""
    table = ds.Variable("embedding", dim=8)
    os.makedirs(args.root, exist_ok=True)
    follower = ds.follow(table, args.root, poll_interval_s=0.05)  # polls before ckpt-0
    command = [sys.executable, os.path.abspath(__file__), "--role", "trainer", "--root",
               args.root, "--keys", str(args.keys), "--interval", str(args.interval),
               "--saves", str(args.saves)]  # fmt: skip
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    printed, deadline = 0, float("inf")
    while child.poll() is None:
        follower.wait_for(lambda f, n=printed: len(f.history) > n, timeout_s=0.2)
        if not printed and follower.history:  # the clock starts once ckpt-0 is served
            deadline = time.monotonic() + args.seconds
        printed = report(follower, table, printed)
        if time.monotonic() > deadline and child.stdin and not child.stdin.closed:
            child.stdin.close()  # the trainer finishes its save and ends
    assert child.stdout is not None and child.returncode == 0, "the trainer failed"
    last, trained = child.stdout.read().split()
    follower.wait_for(lambda f: (f.applied or "").endswith("/" + last), timeout_s=30)
    follower.stop()
    report(follower, table, printed)
    print(f"trainer saved {last}, digest {trained}")
    print(f"server serves {os.path.basename(follower.applied or '')}, digest {digest(table)}")


def report(follower: ds.Follower, table: ds.Variable, printed: int) -> int:
    """Print the checkpoints applied since the first ``printed``; return how many are."""
    history = list(follower.history)
    for applied in history[printed:]:
        name, changed = os.path.basename(applied.url), applied.upserted + applied.removed
        staleness = time.time() - applied.committed
        print(f"serving {name}: {int(table.size()):,} keys, {changed:,} rows changed, "
              f"staleness {staleness:.2f} s", flush=True)  # fmt: skip
    return len(history)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=None, help="checkpoint folder (default: a tmp dir)")
    parser.add_argument("--keys", type=int, default=1024, help="rows of ckpt-0")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between saves")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the trainer saves")
    parser.add_argument("--saves", type=int, default=1_000_000, help="most deltas saved")
    parser.add_argument("--role", choices=["server", "trainer"], default="server")
    args = parser.parse_args()
    args.root = args.root or tempfile.mkdtemp(prefix="serve_live_")
    trainer(args) if args.role == "trainer" else server(args)
