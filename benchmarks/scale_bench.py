"""How checkpoints scale with the number of processes: simulated ranks, each a process.

For each backend (a local folder; a moto S3 server in a subprocess) and each rank count
``R`` of ``--ranks``, ``R`` processes save one Variable of ``--keys-per-rank`` keys each
through ``de_store.save`` (the multi-process path: ``StorageBarrier``, rank manifests,
rank 0 merges and commits). Rank 0 times, inside its own save:

* ``merge_s``: ``merge_rank_manifests`` over the ``R`` rank manifests;
* ``commit_s``: from the barrier to the committed checkpoint (read the ``R`` rank
  manifests, merge, write and commit the manifest).

Then each checkpoint of ``--restore-from`` ranks is restored by ``M`` processes for each
``M`` of ``--restore-into``; every rank counts the bytes its backend read
(``Backend.stats.bytes_read``) and the JSON gives the largest share of the checkpoint's
shard bytes one rank read, next to the bound ``1/M + 10%``.

Last, the merge alone is timed in this process on ``R`` copies of a real rank manifest,
for ``--merge-ranks`` (up to thousands of ranks), with the merged manifest's size.

Usage::

    python benchmarks/scale_bench.py --ranks 1,2,4,8,16,32,64

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

BUCKET = "scale-bench"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8,16,32,64")
    parser.add_argument("--restore-from", default="4,64")
    parser.add_argument("--restore-into", default="1,3,4,12,16")
    parser.add_argument("--merge-ranks", default="64,256,1024,4096")
    parser.add_argument("--keys-per-rank", type=int, default=130_000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# -- one rank (a process) -----------------------------------------------------------------
# A rank drives the saver's data path below the tables directly (numpy rows -> shard
# format -> backend -> rank manifest -> barrier -> merge -> commit, and the reads back):
# it imports no TensorFlow, so 64 of them fit on a small machine.
def _save_rank(url: str, size: int, rank: int, keys: int, dim: int, options: dict) -> dict:
    import numpy as np

    from de_store.backends import open_location
    from de_store.checkpoint.manifest import ColumnSpec
    from de_store.checkpoint.topology import Topology
    from de_store.checkpoint.variable_rows import ShardRows, VariableRows
    from de_store.saver import core

    timings: dict[str, Any] = {}
    merge, merge_and_commit = core.merge_rank_manifests, core._merge_and_commit

    def timed_merge(ranks: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = merge(ranks, **kwargs)
        timings["merge_s"] = time.perf_counter() - start
        timings["rank_manifest"] = core.to_json(ranks[0]).decode()
        return result

    def timed_commit(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = merge_and_commit(*args, **kwargs)
        timings["commit_s"] = time.perf_counter() - start
        return result

    core.merge_rank_manifests, core._merge_and_commit = timed_merge, timed_commit
    ids = np.arange(rank, keys * size, size, dtype=np.int64)
    values = np.ones((len(ids), dim), np.float32) * (ids % 97)[:, None].astype(np.float32)
    rows = VariableRows(
        name="emb", key_dtype="int64", value_dtype="float32", dim=dim,
        columns={"value": ColumnSpec("float32", dim)}, shards=[ShardRows(ids, {"value": values})],
    )  # fmt: skip
    backend, name = open_location(url, options)
    io = core.IOOptions(barrier_timeout_s=900)
    start = time.perf_counter()
    core.save_checkpoint([rows], backend, name, Topology(size, rank), io)
    timings["save_s"] = time.perf_counter() - start
    return timings


def _restore_rank(url: str, size: int, rank: int, dim: int, options: dict) -> dict:
    from de_store.backends import open_location
    from de_store.checkpoint.commit import read_manifest
    from de_store.checkpoint.topology import Topology
    from de_store.progress import progress_for
    from de_store.saver import core, restore_read

    backend, name = open_location(url, options)
    _, manifest = read_manifest(backend, name)
    entry = manifest.variables["emb"]
    with progress_for(entry.rows, "restore", quiet=True, unit="rows") as bar:
        rows, _ = restore_read.read_link(
            backend.sub(name), entry, Topology(size, rank), core.IOOptions(), bar
        )
    return {
        "bytes_read": backend.stats.bytes_read,
        "shard_bytes": entry.bytes,
        "rows": sum(len(shard.keys) for _, shard in rows),
        "total_rows": entry.rows,
    }


def _worker(argv: list[str]) -> None:
    mode, url, size, rank, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    dim, options = int(argv[5]), json.loads(argv[6])
    if mode == "save":
        result = _save_rank(url, size, rank, int(argv[7]), dim, options)
    else:
        result = _restore_rank(url, size, rank, dim, options)
    with open(out, "w") as file:
        json.dump(result, file)


# -- the driver ---------------------------------------------------------------------------
def _run_ranks(mode: str, url: str, count: int, work: str, dim: int, options: dict,
               *extra: str) -> list[dict]:  # fmt: skip
    env = dict(os.environ)
    outs = [
        os.path.join(work, f"{mode}-{count}-{r}-{time.monotonic_ns()}.json") for r in range(count)
    ]

    def command(rank: int) -> list[str]:
        return [sys.executable, __file__, "--worker", mode, url, str(count), str(rank),
                outs[rank], str(dim), json.dumps(options), *extra]  # fmt: skip

    procs = [
        subprocess.Popen(command(r), env=env, stderr=subprocess.PIPE, text=True)
        for r in range(count)
    ]
    errors = [proc.communicate()[1] for proc in procs]
    for proc, error in zip(procs, errors, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a {mode} rank of {count} failed:\n{error[-3000:]}")
    results = []
    for out in outs:
        with open(out) as file:
            results.append(json.load(file))
    return results


def _backend_figures(name: str, root: str, options: dict, args: argparse.Namespace,
                     work: str) -> tuple[dict, str | None]:  # fmt: skip
    saves, manifest_json = {}, None
    for count in _ints(args.ranks):
        start = time.perf_counter()
        ranks = _run_ranks("save", f"{root}/r{count}", count, work, args.dim, options,
                           str(args.keys_per_rank))  # fmt: skip
        chief = ranks[0]
        saves[count] = {
            "merge_s": round(chief.get("merge_s", 0.0), 5),
            "commit_s": round(chief["commit_s"], 4),
            "rank0_save_s": round(chief["save_s"], 3),
            "wall_s": round(time.perf_counter() - start, 2),
        }
        manifest_json = chief.get("rank_manifest") or manifest_json
        print(f"{name}: {count} ranks saved: {saves[count]}", flush=True)
    restores = {}
    for saved in _ints(args.restore_from):
        if saved not in saves:
            continue
        for into in _ints(args.restore_into):
            ranks = _run_ranks("restore", f"{root}/r{saved}", into, work, args.dim, options)
            total = ranks[0]["shard_bytes"]
            share = max(r["bytes_read"] for r in ranks) / total
            restores[f"{saved}->{into}"] = {
                "max_rank_read_share": round(share, 4),
                "bound": round(1 / into + 0.1, 4),
                "within_bound": share <= 1 / into + 0.1,
                "rows_ok": sum(r["rows"] for r in ranks) == ranks[0]["total_rows"],
            }
            print(f"{name}: {saved} ranks restored into {into}: {restores[f'{saved}->{into}']}",
                  flush=True)  # fmt: skip
    return {"saves": saves, "restores": restores}, manifest_json


def _merge_figures(manifest_json: str, counts: list[int]) -> dict:
    from de_store.checkpoint.manifest import merge_rank_manifests, rank_manifest_from_json, to_json

    one = rank_manifest_from_json(manifest_json.encode(), "rank 0")
    figures = {}
    for count in counts:
        ranks = [dataclasses.replace(one, rank=r, proc_size=count) for r in range(count)]
        start = time.perf_counter()
        merged = merge_rank_manifests(ranks)
        merge_s = time.perf_counter() - start
        figures[count] = {
            "merge_s": round(merge_s, 4),
            "manifest_bytes": len(to_json(merged)),
            "manifest_bytes_per_rank": round(len(to_json(merged)) / count, 1),
        }
        print(f"merge of {count} rank manifests: {figures[count]}", flush=True)
    return figures


def main() -> None:
    args = _args()
    if args.worker:
        _worker(args.worker)
        return
    from de_store.testing import servers

    result: dict[str, Any] = {"keys_per_rank": args.keys_per_rank, "dim": args.dim}
    manifest_json = None
    with tempfile.TemporaryDirectory() as work:
        for name in args.backends.split(","):
            if name == "local":
                figures, manifest_json = _backend_figures(
                    name, os.path.join(work, "ckpts"), {}, args, work
                )
            else:
                endpoint, stop = servers.start_moto_server(in_process=False)
                try:
                    options = servers.s3_storage_options(endpoint)
                    import s3fs

                    s3fs.S3FileSystem(**options).mkdir(BUCKET)
                    figures, found = _backend_figures(name, f"s3://{BUCKET}", options, args, work)
                    manifest_json = manifest_json or found
                finally:
                    stop()
            result[name] = figures
    if manifest_json:
        result["merge_in_process"] = _merge_figures(manifest_json, _ints(args.merge_ranks))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
