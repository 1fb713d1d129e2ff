"""A serving process follows a trainer's checkpoints while it answers lookups.

Two processes. The trainer (this script, ``--role trainer``, a child of the run) fills a
Variable of ``--keys`` x ``--dim`` float32 rows and saves a full checkpoint ``ROOT/ckpt-0``
(``de_store.save(..., incremental=IncrementalPolicy(...), blocking=True)``). Once the
server holds it, the trainer changes ``--change`` of the rows every ``--interval`` seconds
(existing keys: the table does not grow) and saves a delta ``ROOT/ckpt-{s}``, ``--deltas``
times (``--full-every N``: every Nth save is full, as the default ``IncrementalPolicy``
makes every tenth). Every checkpoint also holds a marker row (key ``MARKER``, outside the
data's keys) whose values are its step ``s``.

The server (a process of its own for each store, started by the run) creates the same
Variable empty, starts ``de_store.follow(variable, ROOT)`` and, once ckpt-0 is applied
(and ``WARMUP_LOOKUPS`` untimed lookups ran), looks up 4,096 random existing keys plus
the marker in a loop, timing each lookup (``time.perf_counter`` around
``lookup(...).numpy()``) until the marker shows the last step. It measures:

* ``visibility_s``: per delta, the first time a lookup returned the marker at step ``s``
  or later, minus the commit time of ckpt-``s`` (its COMMIT record, as the follower's
  ``history`` gives it); p50, p99, max. Target: p99 <= 1 s.
* ``lookup_ms``: lookup latency p50 / p99 while idle and while a checkpoint is being
  applied, and the ratio of the p99s. "Applied" is the whole of the follower's work on
  one checkpoint (plan, check, read, table changes): the run wraps the follower's
  ``_apply`` method and ``_apply.apply_update`` (the table changes alone, ``write``) to
  record when each starts and ends; a lookup counts as "during" if it overlaps such a
  window. Target: p99 during <= 2x idle p99.
* ``rss``: the server's RSS (``/proc/self/status``, sampled every 20 ms in a thread) right
  after ckpt-0 is applied, then serving (after ``WARMUP_LOOKUPS`` lookups, whose first
  calls trace and compile), against its maximum while only deltas arrive; the growth
  over the serving RSS is given in deltas' bytes on storage, and that of its anonymous
  part (``RssAnon``: RSS also counts file pages mapped). Target: growth <= 2 deltas.
  Beside it, the RSS at the end, and the bytes glibc's malloc counts as in use
  (``mallinfo2``): what the process holds, apart from what the allocator keeps freed.
* ``full_load_s``: from ``follow()`` to ckpt-0 applied, against the reference
  ``de_store.restore`` of the same checkpoint into a fresh Variable in the same process,
  run after the follower stopped (its figures are not disturbed).
* ``memory_state``: first touch of the table's bytes after the run
  (``harness.memory_first_touch``): ``first touch after boot`` above 1.5 s per GiB, else
  ``warm``.

Stores: a local temporary folder (``--store local``, the default), S3 on a moto server
started in a subprocess (``--store s3``), or both (``--store both``).

Allocator (``--malloc``): each store's server runs with glibc's malloc as it comes
(``default``), with ``MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=131072`` in its
environment (``tuned``: two arenas instead of one per thread, and buffers of 128 KiB and
more mapped and returned to the system when freed, instead of kept for reuse), or both,
one after the other (``both``, the default). The RSS target depends on it most.

Usage::

    python benchmarks/follow_bench.py --keys 1000000 --store both

Prints the figures of each store; the last stdout line is one JSON object with all of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import _harness as harness
import numpy as np
from _harness import emit, timed

BUCKET = "bench"
VARIABLE = "embedding"
#: The rows' keys are ids 0..keys-1 times this odd multiplier (``harness.rows``).
MULTIPLIER = -7046029254386353131
MARKER = -1
LOOKUP_IDS = 4096
LOOKUP_BATCHES = 256
WARMUP_LOOKUPS = 32
RSS_INTERVAL_S = 0.02
FIRST_TOUCH_S_PER_GIB = 1.5
TARGETS = {"visibility_p99_s": 1.0, "lookup_p99_ratio": 2.0, "rss_growth_deltas": 2.0}


def keys_of(ids: np.ndarray) -> np.ndarray:
    """The keys ``harness.rows`` gives the rows of ``ids`` (int64 arithmetic wraps)."""
    return ids.astype(np.int64) * np.int64(MULTIPLIER)


def marker_is_free(keys: int) -> bool:
    """Whether no row of the data has the marker's key."""
    inverse = pow(MULTIPLIER % 2**64, -1, 2**64)
    return (MARKER * inverse) % 2**64 >= keys


def storage_options(endpoint: str) -> dict[str, Any]:
    from de_store.testing import servers

    return servers.s3_storage_options(endpoint) if endpoint else {}


def new_variable(args: argparse.Namespace) -> Any:
    import de_store

    return de_store.Variable(VARIABLE, dim=args.dim, init_size=args.keys + 1)


# --- the trainer (a child process) -----------------------------------------------------------
def role_trainer(args: argparse.Namespace) -> None:
    import de_store

    options = storage_options(args.endpoint)
    variable = new_variable(args)
    for batch_keys, batch_values in harness.rows(args.keys, args.dim):
        variable.upsert(batch_keys, batch_values)
    variable.upsert(np.array([MARKER], np.int64), np.zeros([1, args.dim], np.float32))
    out: dict[str, Any] = {}
    out["full_save_s"], _ = timed(lambda: save(de_store, variable, args, 0, options))
    print("READY", flush=True)
    sys.stdin.readline()  # the server holds ckpt-0
    rng = np.random.default_rng(harness.SEED + 1)
    changed = max(1, int(args.keys * args.change))
    start, saves = time.monotonic(), []
    for step in range(1, args.deltas + 1):
        time.sleep(max(0.0, start + step * args.interval - time.monotonic()))
        first = int(rng.integers(args.keys))
        ids = (first + np.arange(changed)) % args.keys
        values = rng.standard_normal((changed, args.dim), dtype=np.float32)
        variable.upsert(keys_of(ids), values)
        variable.upsert(np.array([MARKER], np.int64), np.full([1, args.dim], step, np.float32))
        saves.append(timed(lambda step=step: save(de_store, variable, args, step, options))[0])
    out.update(delta_save_s=saves, changed_rows=changed)
    emit(out)


def save(de_store: Any, variable: Any, args: argparse.Namespace, step: int, options: dict) -> None:
    url = f"{args.root}/ckpt-{step}"
    policy = de_store.IncrementalPolicy(full_every=args.full_every or args.deltas + 1)
    de_store.save([variable], url, incremental=policy, blocking=True, storage_options=options)


# --- the server (a process of its own for each store) ------------------------------------
class RssSampler:
    """This process's RSS every ``RSS_INTERVAL_S`` seconds: ``(perf_counter, rss, anon,
    malloc_in_use)`` in bytes (``VmRSS`` and ``RssAnon`` of ``/proc/self/status``: RSS
    holds file pages mapped too; ``malloc_in_use``: the bytes glibc's malloc has handed out
    and not had back, ``mallinfo2``'s ``uordblks + hblkhd``, 0 without glibc)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int, int]] = []
        self._mallinfo = _mallinfo2()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> tuple[int, int]:
        """RSS and its anonymous part, bytes."""
        found = harness.proc_status("VmRSS", "RssAnon")
        return found["VmRSS"], found["RssAnon"]

    def _run(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            info = self._mallinfo() if self._mallinfo is not None else None
            in_use = 0 if info is None else info.uordblks + info.hblkhd
            self.samples.append((time.perf_counter(), *self.now(), in_use))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


MALLINFO2_FIELDS = ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                    "uordblks", "fordblks", "keepcost"]  # fmt: skip


def _mallinfo2() -> Callable[[], Any] | None:
    """glibc's ``mallinfo2`` (2.33 and later), or None."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]

    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is None:
        return None
    function.restype = MallInfo2
    return function


class Windows:
    """When the follower works on a checkpoint (``update``) and changes the tables
    (``write``): ``(start, end)`` in ``perf_counter`` seconds, recorded by wrapping."""

    def __init__(self, follower: Any) -> None:
        from de_store.following import _apply

        self.update: list[tuple[float, float]] = []
        self.write: list[tuple[float, float]] = []
        self._restore = (_apply, _apply.apply_update)
        follower._apply = self._wrap(follower._apply, self.update)
        _apply.apply_update = self._wrap(_apply.apply_update, self.write)

    @staticmethod
    def _wrap(fn: Callable[..., Any], into: list[tuple[float, float]]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append((start, time.perf_counter()))

        return wrapped

    def close(self) -> None:
        module, original = self._restore
        module.apply_update = original


def lookup_batches(args: argparse.Namespace) -> list[Any]:
    """``LOOKUP_BATCHES`` batches of 4,096 random existing keys and the marker (last)."""
    import tensorflow as tf

    rng = np.random.default_rng(harness.SEED + 2)
    batches = []
    for _ in range(LOOKUP_BATCHES):
        ids = keys_of(rng.integers(0, args.keys, LOOKUP_IDS))
        batches.append(tf.constant(np.append(ids, np.int64(MARKER))))
    return batches


def serve(
    variable: Any, args: argparse.Namespace, trainer: subprocess.Popen, batches: list[Any]
) -> dict[str, Any]:
    """Look up ``batches`` in a loop until the marker shows the last step (or the trainer
    ended and nothing new came for ``--wait`` seconds): each lookup's start, latency and
    the first wall time each step was seen."""
    starts, latencies, seen = [], [], {}
    step, last_news = 0, time.monotonic()
    while step < args.deltas:
        batch = batches[len(starts) % LOOKUP_BATCHES]
        start = time.perf_counter()
        found = variable.lookup(batch).numpy()
        latencies.append(time.perf_counter() - start)
        starts.append(start)
        marker = int(found[-1, 0])
        if marker > step:
            now = time.time()
            for s in range(step + 1, marker + 1):
                seen[s] = now
            step, last_news = marker, time.monotonic()
        elif trainer.poll() is not None and time.monotonic() - last_news > args.wait:
            break
    return {"starts": np.array(starts), "latencies": np.array(latencies), "seen": seen}


def follow_and_serve(
    args: argparse.Namespace, root: str, options: dict[str, Any], trainer: subprocess.Popen
) -> dict[str, Any]:
    """Follow ``root`` from ckpt-0 on, then serve while the trainer saves its deltas."""
    import de_store

    variable = new_variable(args)
    rss = RssSampler()
    chunk = {} if args.chunk_rows is None else {"chunk_rows": args.chunk_rows}
    follower = de_store.follow(variable, root, storage_options=options,
                               poll_interval_s=args.poll, start=False, **chunk)  # fmt: skip
    windows = Windows(follower)
    try:
        start = time.perf_counter()
        follower.start()
        if not follower.wait_for(lambda f: f.applied is not None, args.wait_full):
            raise RuntimeError(f"{root}/ckpt-0 was not applied within {args.wait_full} s")
        out: dict[str, Any] = {"full_load_s": time.perf_counter() - start}
        out["rss_after_full_bytes"] = rss.now()[0]
        batches = lookup_batches(args)
        for batch in batches[:WARMUP_LOOKUPS]:  # the lookup's first calls trace and compile
            variable.lookup(batch).numpy()
        gc.collect()
        (out["rss_serving_bytes"], out["anon_serving_bytes"]), go = rss.now(), time.perf_counter()
        assert trainer.stdin is not None
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        out["served"] = serve(variable, args, trainer, batches)
        follower.stop()
    finally:
        follower.stop()
        windows.close()
        rss.stop()
    during = [sample for sample in rss.samples if sample[0] >= go]
    serving = [sample for sample in rss.samples if sample[0] < go][-1]
    out["rss_max_deltas_bytes"] = max(total for _, total, _, _ in during)
    out["anon_max_deltas_bytes"] = max(anon for _, _, anon, _ in during)
    out["rss_end_bytes"] = during[-1][1]
    out["malloc_in_use_serving_bytes"] = serving[3]
    out["malloc_in_use_max_deltas_bytes"] = max(in_use for *_, in_use in during)
    out["malloc_in_use_end_bytes"] = during[-1][3]
    out["commits"] = commit_times(follower)
    out["windows"] = windows
    out["history"] = list(follower.history)
    out["table_keys"] = int(variable.size())
    return out


def commit_times(follower: Any) -> dict[str, float]:
    """The commit time of every checkpoint the follower saw, by folder name: from its
    ``history``, and for a checkpoint applied within a later one's chain, from the times
    the follower read off the COMMIT records."""
    times = {
        os.path.basename(folder.rstrip("/")): at for (folder, _), at in follower._times.items()
    }
    for applied in follower.history:
        times[os.path.basename(applied.url.rstrip("/"))] = applied.committed
    return times


def start_trainer(args: argparse.Namespace, root: str, endpoint: str) -> subprocess.Popen:
    """The trainer process, once it has saved ckpt-0."""
    command = [sys.executable, os.path.abspath(__file__), "--role", "trainer", "--root", root,
               "--endpoint", endpoint, "--keys", str(args.keys), "--dim", str(args.dim),
               "--interval", str(args.interval), "--deltas", str(args.deltas),
               "--change", str(args.change), "--full-every", str(args.full_every)]  # fmt: skip
    trainer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    line = trainer.stdout.readline()
    if line.strip() != "READY":
        trainer.kill()
        raise RuntimeError(f"the trainer failed before saving ckpt-0 (it printed {line!r})")
    return trainer


def trainer_result(trainer: subprocess.Popen) -> dict[str, Any]:
    assert trainer.stdout is not None
    lines = trainer.stdout.read().splitlines()
    if trainer.wait() != 0 or not lines or not lines[-1].startswith(harness.RESULT_TAG):
        raise RuntimeError(f"the trainer failed with exit status {trainer.returncode}")
    return dict(json.loads(lines[-1][len(harness.RESULT_TAG) :]))


def reference_restore(args: argparse.Namespace, url: str, options: dict[str, Any]) -> float:
    """Seconds ``de_store.restore`` takes to load ``url`` into a fresh Variable."""
    import de_store

    fresh = new_variable(args)
    seconds, _ = timed(lambda: de_store.restore([fresh], url, storage_options=options))
    if int(fresh.size()) != args.keys + 1:
        raise AssertionError(f"the reference restore of {url} holds {int(fresh.size())} keys")
    return seconds


def run_store(args: argparse.Namespace, store: str, endpoint: str) -> dict[str, Any]:
    """One run on one store: the trainer and the follower, then the reference restore."""
    import fsspec

    options = storage_options(endpoint)
    # each run in a root of its own: one server phase never sees another's checkpoints
    run_name = os.path.basename(args.dir)
    root = os.path.join(args.dir, "root") if store == "local" else f"s3://{BUCKET}/{run_name}"
    trainer = start_trainer(args, root, endpoint)
    try:
        run = follow_and_serve(args, root, options, trainer)
    except BaseException:
        trainer.kill()
        trainer.wait()
        raise
    run["trainer"] = trainer_result(trainer)
    gc.collect()
    run["restore_s"] = reference_restore(args, f"{root}/ckpt-0", options)
    fs, path = fsspec.core.url_to_fs(root, **options)
    run["delta_bytes"] = [int(fs.du(f"{path}/ckpt-{s}")) for s in range(1, args.deltas + 1)]
    return figures(args, run)


# --- figures ---------------------------------------------------------------------------------
def overlaps(starts: np.ndarray, ends: np.ndarray, windows: list[tuple[float, float]]) -> Any:
    """Which lookups ``[start, end]`` overlap any of ``windows``."""
    hit = np.zeros(len(starts), bool)
    for begin, end in windows:
        hit |= (starts < end) & (ends > begin)
    return hit


def spread(values: Any) -> dict[str, Any]:
    """p50, p99, max and count of ``values`` (None for none)."""
    values = np.asarray(values, float)
    if not len(values):
        return {"p50": None, "p99": None, "max": None, "n": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(values.max()), "n": len(values)}


def figures(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    served, windows = run["served"], run["windows"]
    starts, ms = served["starts"], served["latencies"] * 1e3
    ends = served["starts"] + served["latencies"]
    during = overlaps(starts, ends, windows.update)
    writing = overlaps(starts, ends, windows.write)
    lookups = {"idle": spread(ms[~during]), "during": spread(ms[during]),
               "writing": spread(ms[writing])}  # fmt: skip
    for side in ("during", "writing"):
        theirs, idle = lookups[side]["p99"], lookups["idle"]["p99"]
        lookups[f"p99_ratio_{side}"] = None if theirs is None or idle is None else theirs / idle
    steps = range(1, args.deltas + 1)
    visible = [
        served["seen"][s] - run["commits"][f"ckpt-{s}"] for s in steps if s in served["seen"]
    ]
    delta_bytes = float(np.median(run["delta_bytes"]))
    growth = run["rss_max_deltas_bytes"] - run["rss_serving_bytes"]
    update = [end - start for start, end in windows.update]
    write = [end - start for start, end in windows.write]
    out = {
        "full_load_s": run["full_load_s"],
        "full_load_write_s": write[0],
        "restore_s": run["restore_s"],
        "full_load_over_restore": run["full_load_s"] / run["restore_s"],
        "visibility_s": spread(visible),
        "steps_not_seen": [s for s in steps if s not in served["seen"]],
        "lookup_ms": lookups,
        "delta_update_s": spread(update[1:]),
        "delta_write_s": spread(write[1:]),
        "delta_lag_s": [h.lag_s for h in run["history"][1:]],
        "checkpoints_applied": [(os.path.basename(h.url), h.kind) for h in run["history"]],
        "rss_after_full_mb": run["rss_after_full_bytes"] / 2**20,
        "rss_serving_mb": run["rss_serving_bytes"] / 2**20,
        "rss_max_deltas_mb": run["rss_max_deltas_bytes"] / 2**20,
        "rss_growth_mb": growth / 2**20,
        "delta_bytes": run["delta_bytes"],
        "rss_growth_deltas": growth / delta_bytes,
        "anon_growth_mb": (run["anon_max_deltas_bytes"] - run["anon_serving_bytes"]) / 2**20,
        "rss_end_growth_mb": (run["rss_end_bytes"] - run["rss_serving_bytes"]) / 2**20,
        "malloc_in_use_growth_mb": (
            run["malloc_in_use_max_deltas_bytes"] - run["malloc_in_use_serving_bytes"]
        )
        / 2**20,
        "malloc_in_use_end_growth_mb": (
            run["malloc_in_use_end_bytes"] - run["malloc_in_use_serving_bytes"]
        )
        / 2**20,
        "table_keys": run["table_keys"],
        "trainer": run["trainer"],
    }
    out["targets_met"] = {
        "visibility_p99": out["visibility_s"]["p99"] is not None
        and out["visibility_s"]["p99"] <= TARGETS["visibility_p99_s"]
        and not out["steps_not_seen"],
        "lookup_p99_ratio": (lookups["p99_ratio_during"] or np.inf) <= TARGETS["lookup_p99_ratio"],
        "rss_growth": out["rss_growth_deltas"] <= TARGETS["rss_growth_deltas"],
    }
    return out


def memory_state(args: argparse.Namespace) -> dict[str, Any]:
    """First touch of the table's bytes in this process: seconds per GiB and the state."""
    import tensorflow as tf

    nbytes = args.keys * (8 + 4 * args.dim)
    per_gib = harness.memory_first_touch(tf, nbytes) / (nbytes / 2**30)
    state = "first touch after boot" if per_gib > FIRST_TOUCH_S_PER_GIB else "warm"
    return {"memory_s_per_gib": per_gib, "memory_state": state}


def report(store: str, f: dict[str, Any], args: argparse.Namespace) -> None:
    def cell(spread: dict[str, Any], scale: float = 1.0, unit: str = "s") -> str:
        if not spread["n"]:
            return "none"
        return (f"p50 {spread['p50'] * scale:.3f} {unit}, p99 {spread['p99'] * scale:.3f} "
                f"{unit}, max {spread['max'] * scale:.3f} {unit} (n={spread['n']:,})")  # fmt: skip

    met = {True: "met", False: "MISSED"}
    look, t = f["lookup_ms"], f["targets_met"]
    ratio = look["p99_ratio_during"]
    print(f"== {store}: {args.keys:,} x {args.dim} float32, {args.deltas} deltas of "
          f"{f['trainer']['changed_rows']:,} rows every {args.interval} s, follower "
          f"chunk_rows {args.chunk_rows or 'default'}")  # fmt: skip
    print(f"full load of ckpt-0: follow {f['full_load_s']:.3f} s (table writes "
          f"{f['full_load_write_s']:.3f} s), de_store.restore {f['restore_s']:.3f} s "
          f"(reference): {f['full_load_over_restore']:.2f}x")  # fmt: skip
    print(f"visibility (first lookup seeing step s - commit of ckpt-s): "
          f"{cell(f['visibility_s'])} [p99 <= 1 s: {met[t['visibility_p99']]}]")  # fmt: skip
    kinds = [f"{name} {kind}" for name, kind in f["checkpoints_applied"][1:]]
    print(f"applied after ckpt-0: {', '.join(kinds) or 'none'}")
    if f["steps_not_seen"]:
        print(f"  steps never seen: {f['steps_not_seen']}")
    print(f"lookup of {LOOKUP_IDS + 1:,} keys, idle: {cell(look['idle'], unit='ms')}")
    print(f"  during applies: {cell(look['during'], unit='ms')}")
    print(f"  during table writes: {cell(look['writing'], unit='ms')}")
    shown = "n/a" if ratio is None else f"{ratio:.2f}x"
    print(f"  p99 during / idle {shown} [<= 2x: {met[t['lookup_p99_ratio']]}]")
    print(f"apply of a delta: whole {cell(f['delta_update_s'])}; "
          f"table writes {cell(f['delta_write_s'])}")  # fmt: skip
    print(f"RSS after the full load {f['rss_after_full_mb']:,.1f} MiB, serving "
          f"{f['rss_serving_mb']:,.1f} MiB, max while deltas arrive "
          f"{f['rss_max_deltas_mb']:,.1f} MiB: growth {f['rss_growth_mb']:.1f} MiB = "
          f"{f['rss_growth_deltas']:.2f} deltas of {np.median(f['delta_bytes']) / 2**20:.1f} "
          f"MiB [<= 2 deltas: {met[t['rss_growth']]}]")  # fmt: skip
    print(f"  of which anonymous memory: growth {f['anon_growth_mb']:.1f} MiB = "
          f"{f['anon_growth_mb'] * 2**20 / np.median(f['delta_bytes']):.2f} deltas")  # fmt: skip
    print(f"  at the end: RSS {f['rss_end_growth_mb']:+.1f} MiB over serving; malloc's bytes "
          f"in use {f['malloc_in_use_end_growth_mb']:+.1f} MiB "
          f"(max {f['malloc_in_use_growth_mb']:+.1f})")  # fmt: skip
    print(f"memory state: {f['memory_state']} (first touch {f['memory_s_per_gib']:.2f} s per GiB)")


# --- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--deltas", type=int, default=15, help="delta saves after ckpt-0")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between deltas")
    parser.add_argument("--change", type=float, default=0.01, help="share of rows a delta changes")
    parser.add_argument("--full-every", type=int, default=0,
                        help="the trainer's IncrementalPolicy.full_every (default: only deltas "
                        "after ckpt-0)")  # fmt: skip
    parser.add_argument("--store", choices=["local", "s3", "both"], default="local")
    parser.add_argument("--poll", type=float, default=0.1, help="the follower's poll interval")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for a step once the trainer has ended")  # fmt: skip
    parser.add_argument("--wait-full", type=float, default=600.0,
                        help="seconds to wait for ckpt-0 to be applied")  # fmt: skip
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="the follower's chunk_rows (default: the follower's own)")  # fmt: skip
    parser.add_argument("--malloc", choices=["default", "tuned", "both"], default="both",
                        help="glibc malloc settings of the server (see the docstring)")  # fmt: skip
    parser.add_argument("--phase", choices=["server"], help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def phase_server(args: argparse.Namespace) -> None:
    """One store's run in a process of its own: its RSS holds nothing of another run."""
    args.dir = tempfile.mkdtemp(prefix="follow_bench_")
    try:
        out = run_store(args, args.store, args.endpoint)
        out.update(memory_state(args))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    emit(out)


#: glibc malloc settings of a serving process (``--malloc tuned``), read at its start.
TUNED_MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}


def main() -> None:
    args = parse_args()
    if args.role == "trainer":
        return role_trainer(args)
    if args.phase == "server":
        return phase_server(args)
    if not marker_is_free(args.keys):
        raise SystemExit(f"the marker key {MARKER} is one of the data's keys")
    stores = ["local", "s3"] if args.store == "both" else [args.store]
    result: dict[str, Any] = {"keys": args.keys, "dim": args.dim, "deltas": args.deltas,
                              "interval_s": args.interval, "change": args.change,
                              "full_every": args.full_every,
                              "chunk_rows": args.chunk_rows}  # fmt: skip
    endpoint, stop_moto = "", None
    try:
        if "s3" in stores:
            from de_store.testing import servers

            endpoint, stop_moto = servers.start_moto_server(in_process=False)
            servers.create_bucket("s3", BUCKET, storage_options(endpoint))
        mallocs = ["default", "tuned"] if args.malloc == "both" else [args.malloc]
        for store, malloc in [(store, malloc) for store in stores for malloc in mallocs]:
            options = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                       if name not in ("store", "endpoint", "phase", "role", "root", "malloc")
                       and value is not None]  # fmt: skip
            where = ["--store", store, "--endpoint", endpoint if store == "s3" else ""]
            env = TUNED_MALLOC if malloc == "tuned" else {}
            name = store if malloc == "default" else f"{store}, malloc tuned"
            result[name] = harness.run_phase(__file__, "server", [*options, *where], env=env)
            report(name, result[name], args)
    finally:
        if stop_moto is not None:
            stop_moto()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
