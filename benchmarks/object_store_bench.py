"""Saves and restores on object stores, against the plainest client calls moving the same bytes.

Measures, through the user path (``de_store.get_variable`` with a ``HashTableCreator`` whose
``FileSystemSaver(save_path="s3://..." or "gs://...")`` holds the KV data, and
``tf.train.Checkpoint.write`` / ``read``; TensorFlow's own small bundle goes to a local
temporary folder), against a moto S3 server and a gcp-storage-emulator, each started here
in a subprocess of its own on 127.0.0.1 and a free port (so that neither shares the GIL of
the process it serves):

* ``save_s``: ``Checkpoint.write`` of a table of ``--keys`` x ``--dim`` float32 rows (one
  process, the best of ``--rounds``, each to a checkpoint of its own) after a first save
  (``save_first_s``, which traces the export kernels); ``plain_put_s``: in each round, right
  before the save (odd rounds) or right after it (even rounds), a new ``s3fs`` / ``gcsfs``
  filesystem puts files of the same sizes as the committed checkpoint holds (its shards,
  the rank manifest, the manifest and the commit record), as many, with one
  ``fs.pipe({path: bytes})`` (the client sends them side by side), deleted at the end of
  the round (the servers keep what they store in memory, and slow down as it grows);
  ``plain_stream_s``: then, the same files written one after the other, each through the
  client's own file object (``fs.open(path, "wb", block_size=16 MiB)``): the plainest
  upload of an object whose size is not known when it starts, as a shard's is (a multipart
  upload on S3, a resumable one on GCS; its requests go through the clients' file objects,
  which this run does not count); ``plain_parts_s``: then the same files put whole again,
  each over ``2 x 16 MiB`` (S3) or 16 MiB (GCS) in parts of 16 MiB by the client's own
  ``fs.pipe(..., chunksize=16 MiB)`` (S3: a multipart upload, its parts sent side by side,
  then completed; GCS: a resumable session, its chunks one after the other), the
  plainest upload of the same bytes in the parts a shard's streamed upload sends, where
  the server's work per part and its assembly of the parts count as they count for a
  save (deleted before the API save that follows). Each
  save's requests include the orphan search a ``tf.train.Checkpoint`` save makes in its
  root, which reads every committed checkpoint there: ``save_requests_rounds`` gives the
  count of each round, whose root holds one checkpoint more than the round before;
  ``api_save_s``: after each, ``de_store.save(..., blocking=True)`` of the same table into
  a root of its own, which makes no such search (deleted at the end of the round);
* ``restore_s``: ``Checkpoint.read`` in a fresh process (the variable, created empty,
  restores as a user's would after a restart; ``import tensorflow`` is not timed), the best
  of ``--rounds`` processes after a first one (``restore_first_s``, which traces the load
  kernels; later processes load them from de_store's cache, a folder this run starts
  empty); ``plain_get_s``: right before it in the same process, a new filesystem reads
  every file of the checkpoint with one ``fs.cat([paths])``. Each restore is checked: the
  table holds ``--keys`` rows, and the first 1,000 rows of every fill batch equal the
  rows saved;
* ``requests``: the requests each side made, counted at the client's one request method
  (``S3FileSystem._call_s3``, ``GCSFileSystem._call``, wrapped in every process of the run),
  and at ``aiohttp.ClientSession.get`` of a GCS media URL (de_store's streamed reads of
  GCS objects), by method;
* ``local``: the same saves and fresh-process restores on a local folder: what a restore
  costs besides the network (reading the file from the page cache, checking, parsing,
  indexing and loading the table).

``ratios`` gives save / plain put and restore / plain get per store (the best of each
side), restore / max(plain get, local restore): a restore that overlapped its download
with all of its local work would take that maximum, and ``*_paired``: the median over the
rounds of each round's ratio (the save over the put of its round, the restore over the get
of its process), which no drift of the server's speed over the run tilts. Figures on a
shared machine are noisy: compare ratios from the same run.

Usage::

    python benchmarks/object_store_bench.py --keys 1000000 --dim 16

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs loads

import numpy as np
from _harness import emit, rows, run_phase, sample_rows, timed

BUCKET = "bench"
#: Block size of the plain streamed upload: de_store's part and chunk size on S3 and GCS.
STREAM_BLOCK = 16 << 20
VARIABLE = "embedding"
STORES = ("s3", "gs")


# --- servers (main process) ------------------------------------------------------------------
def start_servers() -> tuple[dict[str, str], Callable[[], None]]:
    """A moto S3 server and a gcp-storage-emulator in subprocesses: endpoints and a stop."""
    from de_store.testing import servers

    s3_endpoint, stop_moto = servers.start_moto_server(in_process=False)
    try:
        port = servers.free_port()
        command = [sys.executable, "-m", "gcp_storage_emulator", "start", "-H", "127.0.0.1",
                   "--port", str(port), "--in-memory", "-q"]  # fmt: skip
        # started and stopped as start_moto_server(in_process=False) starts moto
        gs_endpoint, stop_emulator = servers._start_subprocess(
            command, f"http://127.0.0.1:{port}", "/"
        )
    except BaseException:
        stop_moto()
        raise

    def stop() -> None:
        stop_moto()
        stop_emulator()

    try:
        for store, endpoint in (("s3", s3_endpoint), ("gs", gs_endpoint)):
            servers.create_bucket(store, BUCKET, storage_options(store, endpoint))
    except BaseException:
        stop()
        raise
    return {"s3": s3_endpoint, "gs": gs_endpoint}, stop


def storage_options(store: str, endpoint: str) -> dict[str, Any]:
    from de_store.testing import servers

    if store == "s3":
        return servers.s3_storage_options(endpoint)
    return servers.gcs_storage_options(endpoint)


# --- requests, counted at each client's one request method ------------------------------------
REQUESTS: collections.Counter[str] = collections.Counter()
_REQUESTS_LOCK = threading.Lock()


def count_requests() -> None:
    """Count every request s3fs and gcsfs make in this process into ``REQUESTS``, by method."""
    import aiohttp
    import gcsfs
    import s3fs

    call_s3 = s3fs.S3FileSystem._call_s3
    call_gcs = gcsfs.GCSFileSystem._call

    async def counted_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        _count(method)
        return await call_s3(self, method, *args, **kwargs)

    async def counted_gcs(self: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        _count(f"{method} {_gcs_kind(path, kwargs)}")
        return await call_gcs(self, method, path, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted_s3
    gcsfs.GCSFileSystem._call = counted_gcs

    # de_store's streamed reads of GCS objects GET the media URL through gcsfs's session
    # (backends/gcs.py), not through ``_call``.
    session_get = aiohttp.ClientSession.get

    def counted_get(self: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        if "/download/storage/v1/" in str(url):
            _count("GET object")
        return session_get(self, url, *args, **kwargs)

    aiohttp.ClientSession.get = counted_get  # type: ignore[method-assign]


def _gcs_kind(path: str, kwargs: dict[str, Any]) -> str:
    if "uploadType" in kwargs:
        return f"upload({kwargs['uploadType']})"
    if "upload" in path:
        return "upload(chunk)"
    if path.endswith("/o") or "/o?" in path:
        return "list"
    return "object" if "/o/" in path else path.split("/")[0]


def _count(method: str) -> None:
    with _REQUESTS_LOCK:
        REQUESTS[method] += 1


def counted(fn: Callable[[], Any]) -> tuple[float, dict[str, int], Any]:
    """Seconds ``fn()`` took, the requests it made by method, and its result."""
    with _REQUESTS_LOCK:
        REQUESTS.clear()
    seconds, result = timed(fn)
    with _REQUESTS_LOCK:
        made = dict(sorted(REQUESTS.items()))
    return seconds, made, result


def new_fs(store: str, endpoint: str) -> Any:
    """A filesystem of its own (no instance shared with de_store's)."""
    import fsspec

    return fsspec.filesystem(store, skip_instance_cache=True, **storage_options(store, endpoint))


# --- the table -----------------------------------------------------------------------------
def make_variable(args: argparse.Namespace, save_path: str, options: dict[str, Any]) -> Any:
    import tensorflow as tf

    import de_store

    saver = de_store.FileSystemSaver(save_path=save_path, storage_options=options)
    return de_store.get_variable(
        VARIABLE,
        key_dtype=tf.int64,
        value_dtype=tf.float32,
        dim=args.dim,
        init_size=args.keys,
        kv_creator=de_store.HashTableCreator(saver=saver),
    )


def checkpoint_files(store: str, endpoint: str, root: str) -> dict[str, int]:
    """Every object under ``root`` (``bucket/prefix``) and its size."""
    found = new_fs(store, endpoint).find(root, detail=True)
    return {path: int(info["size"]) for path, info in sorted(found.items())}


def fill(variable: Any, args: argparse.Namespace) -> None:
    for batch_keys, batch_values in rows(args.keys, args.dim):
        variable.upsert(batch_keys, batch_values)


def tf_prefix(args: argparse.Namespace, index: int) -> str:
    return os.path.join(args.tf_dir, f"ckpt-{index}")


def kv_root(args: argparse.Namespace, index: int) -> str:
    """``bucket/prefix`` of checkpoint ``index``'s KV data (``save_path`` has no protocol)."""
    return f"{args.save_path.split('://', 1)[-1]}/ckpt-{index}"


# --- phase: save (one process: fill, a first save, then plain put and save, alternated) ------
def phase_save(args: argparse.Namespace) -> None:
    count_requests()
    import tensorflow as tf

    local = args.store == "local"
    options = {} if local else storage_options(args.store, args.endpoint)
    variable = make_variable(args, args.save_path, options)
    fill(variable, args)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    out: dict[str, Any] = {"save_first_s": timed(lambda: checkpoint.write(tf_prefix(args, 0)))[0]}
    saves, puts, api_saves, streams, parts = [], [], [], [], []
    files = {} if local else checkpoint_files(args.store, args.endpoint, kv_root(args, 0))
    base = kv_root(args, 0) + "/"
    payloads = {path[len(base) :]: np.random.bytes(size) for path, size in files.items()}
    for index in range(1, args.rounds + 1):
        put_first, put = index % 2 == 1, None  # the put first in odd rounds, second in even
        if not local and put_first:
            put = counted(lambda index=index: plain_put(args, payloads, index))
        saves.append(counted(lambda index=index: checkpoint.write(tf_prefix(args, index))))
        if not local and not put_first:
            put = counted(lambda index=index: plain_put(args, payloads, index))
        if not local:
            fs = new_fs(args.store, args.endpoint)
            fs.rm(f"{BUCKET}/plain-{index}", recursive=True)
            streams.append(counted(lambda index=index: plain_stream(args, payloads, index)))
            new_fs(args.store, args.endpoint).rm(f"{BUCKET}/plain-{index}", recursive=True)
            parts.append(counted(lambda index=index: plain_parts(args, payloads, index)))
            # The server holds what it held for the save of this round when the API save
            # starts (it slows down as it holds more).
            new_fs(args.store, args.endpoint).rm(f"{BUCKET}/plain-{index}", recursive=True)
        url = f"{args.save_path}-api/ckpt-{index}"  # a root of their own: no orphan search
        api_saves.append(counted(lambda url=url: api_save(variable, url, options)))
        if put is not None:
            puts.append(put)
            fs = new_fs(args.store, args.endpoint)  # the server keeps only the saves' bytes
            fs.rm(url.split("://", 1)[1], recursive=True)
    best = min(saves, key=lambda s: s[0])
    out["save_s"], out["save_requests"] = best[0], best[1]
    out["save_requests_rounds"] = [sum(made.values()) for _, made, _ in saves]
    best = min(api_saves, key=lambda s: s[0])
    out["api_save_s"], out["api_save_requests"] = best[0], best[1]
    if puts:
        out["plain_put_s"], out["plain_put_requests"] = min(s for s, _, _ in puts), puts[0][1]
        out["files"] = {path[len(base) :]: size for path, size in files.items()}
        out["save_rounds_s"] = [s for s, _, _ in saves]
        out["plain_put_rounds_s"] = [s for s, _, _ in puts]
        out["api_save_rounds_s"] = [s for s, _, _ in api_saves]
        out["plain_stream_s"] = min(s for s, _, _ in streams)
        out["plain_stream_rounds_s"] = [s for s, _, _ in streams]
        out["plain_parts_s"], out["plain_parts_requests"] = min(s for s, _, _ in parts), parts[0][1]
        out["plain_parts_rounds_s"] = [s for s, _, _ in parts]
    emit(out)


def api_save(variable: Any, url: str, options: dict[str, Any]) -> None:
    import de_store

    de_store.save([variable], url, storage_options=options, blocking=True)


def plain_put(args: argparse.Namespace, payloads: dict[str, bytes], index: int) -> None:
    """A new filesystem puts ``payloads`` under ``plain-<index>/`` in one call."""
    fs = new_fs(args.store, args.endpoint)
    fs.pipe({f"{BUCKET}/plain-{index}/{rel}": data for rel, data in payloads.items()})


def plain_stream(args: argparse.Namespace, payloads: dict[str, bytes], index: int) -> None:
    """A new filesystem writes each of ``payloads`` under ``plain-<index>/`` through its own
    file object, one after the other, in blocks of ``STREAM_BLOCK`` bytes: the client's own
    upload of an object whose size is not known when it starts (a multipart upload on S3,
    a resumable one on GCS, for objects over one block)."""
    fs = new_fs(args.store, args.endpoint)
    for rel, data in payloads.items():
        with fs.open(f"{BUCKET}/plain-{index}/{rel}", "wb", block_size=STREAM_BLOCK) as file:
            file.write(data)


def plain_parts(args: argparse.Namespace, payloads: dict[str, bytes], index: int) -> None:
    """A new filesystem puts ``payloads`` under ``plain-<index>/`` in one call, objects over
    the client's threshold in parts of ``STREAM_BLOCK`` bytes (S3: a multipart upload, its
    parts concurrent; GCS: a resumable session)."""
    fs = new_fs(args.store, args.endpoint)
    fs.pipe(
        {f"{BUCKET}/plain-{index}/{rel}": data for rel, data in payloads.items()},
        chunksize=STREAM_BLOCK,
    )


# --- phase: restore (a fresh process: plain get, then the restore) ---------------------------
def phase_restore(args: argparse.Namespace) -> None:
    count_requests()
    import tensorflow as tf

    local = args.store == "local"
    out: dict[str, Any] = {}
    if not local:
        paths = list(checkpoint_files(args.store, args.endpoint, kv_root(args, args.index)))
        get_s, get_requests, got = counted(lambda: new_fs(args.store, args.endpoint).cat(paths))
        out.update(plain_get_s=get_s, plain_get_requests=get_requests)
        out["plain_get_bytes"] = sum(len(data) for data in got.values())
    options = {} if local else storage_options(args.store, args.endpoint)
    variable = make_variable(args, args.save_path, options)
    checkpoint = tf.train.Checkpoint(embedding=variable)
    seconds, made, status = counted(lambda: checkpoint.read(tf_prefix(args, args.index)))
    status.assert_consumed()
    out.update(restore_s=seconds, restore_requests=made)
    check_restored(variable, args)
    emit(out)


def check_restored(variable: Any, args: argparse.Namespace) -> None:
    """The table holds ``--keys`` rows, and sampled rows equal the rows saved."""
    if int(variable.size()) != args.keys:
        raise AssertionError(f"restored {int(variable.size())} rows, expected {args.keys}")
    keys, values = sample_rows(args.keys, args.dim)
    found = variable.lookup(keys).numpy()
    if not np.array_equal(found, values):
        wrong = int(np.sum(np.any(found != values, axis=1)))
        raise AssertionError(f"{wrong} of {len(keys)} sampled rows differ after the restore")


# --- main ------------------------------------------------------------------------------------
def run_store(args: argparse.Namespace, store: str, endpoint: str, env: dict[str, str]) -> dict:
    """The save phase, then ``rounds + 1`` restore processes, for one store."""
    if store == "local":
        save_path = os.path.join(args.dir, "local-kv")
    else:
        save_path = f"{store}://{BUCKET}/run"
    tf_dir = os.path.join(args.dir, f"tf-{store}")
    common = ["--store", store, "--endpoint", endpoint, "--save-path", save_path,
              "--tf-dir", tf_dir, "--keys", str(args.keys), "--dim", str(args.dim),
              "--rounds", str(args.rounds)]  # fmt: skip
    out = run_phase(__file__, "save", common, env=env)
    restores = [
        run_phase(__file__, "restore", [*common, "--index", str(1 + i % args.rounds)], env=env)
        for i in range(args.rounds + 1)
    ]
    out["restore_first_s"] = restores[0]["restore_s"]
    best = min(restores[1:], key=lambda r: r["restore_s"])
    out.update(best)
    out["restore_rounds_s"] = [r["restore_s"] for r in restores]
    if store != "local":
        out["plain_get_s"] = min(r["plain_get_s"] for r in restores)
        out["plain_get_rounds_s"] = [r["plain_get_s"] for r in restores]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="timed saves and restores")
    parser.add_argument("--stores", default="s3,gs", help="comma-separated: s3, gs")
    parser.add_argument("--phase", choices=["save", "restore"], help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--save-path", help=argparse.SUPPRESS)
    parser.add_argument("--tf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "save":
        return phase_save(args)
    if args.phase == "restore":
        return phase_restore(args)
    stores = [s for s in args.stores.split(",") if s]
    bad = sorted(set(stores) - set(STORES))
    if bad:
        parser.error(f"--stores: unknown {bad}; known: {list(STORES)}")
    args.dir = tempfile.mkdtemp(prefix="object_store_bench_")
    env = {"DE_STORE_CACHE_DIR": os.path.join(args.dir, "cache"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    endpoints, stop = start_servers()
    try:
        result: dict[str, Any] = {"keys": args.keys, "dim": args.dim, "rounds": args.rounds}
        for store in stores:
            result[store] = run_store(args, store, endpoints[store], env)
        result["local"] = run_store(args, "local", "", env)
    finally:
        stop()
        shutil.rmtree(args.dir, ignore_errors=True)
    result["ratios"] = ratios(result, stores)
    report(result, stores)
    print(json.dumps(result))


def ratios(result: dict[str, Any], stores: list[str]) -> dict[str, float]:
    out = {}
    for store in stores:
        figures = result[store]
        floor = max(figures["plain_get_s"], result["local"]["restore_s"])
        out[f"{store}_save_vs_plain_put"] = figures["save_s"] / figures["plain_put_s"]
        out[f"{store}_restore_vs_plain_get"] = figures["restore_s"] / figures["plain_get_s"]
        out[f"{store}_restore_vs_max_get_local_restore"] = figures["restore_s"] / floor
        # each round's figure over the plain call of the same round (the same process for
        # restores), the median over the rounds
        paired = {
            "save_vs_plain_put": ("save_rounds_s", "plain_put_rounds_s", 0),
            "api_save_vs_plain_put": ("api_save_rounds_s", "plain_put_rounds_s", 0),
            "save_vs_plain_stream": ("save_rounds_s", "plain_stream_rounds_s", 0),
            "plain_stream_vs_plain_put": ("plain_stream_rounds_s", "plain_put_rounds_s", 0),
            "save_vs_plain_parts": ("save_rounds_s", "plain_parts_rounds_s", 0),
            "api_save_vs_plain_parts": ("api_save_rounds_s", "plain_parts_rounds_s", 0),
            "plain_parts_vs_plain_put": ("plain_parts_rounds_s", "plain_put_rounds_s", 0),
            "restore_vs_plain_get": ("restore_rounds_s", "plain_get_rounds_s", 1),
        }
        for name, (mine, theirs, skip) in paired.items():
            pairs = zip(figures[mine][skip:], figures[theirs][skip:], strict=True)
            out[f"{store}_{name}_paired"] = float(np.median([a / b for a, b in pairs]))
    return out


def report(result: dict[str, Any], stores: list[str]) -> None:
    local = result["local"]
    print(f"{result['keys']:,} x {result['dim']} float32, best of {result['rounds']}")
    print(f"local disk: save {local['save_s']:.3f} s, fresh restore {local['restore_s']:.3f} s")
    for store in stores:
        f = result[store]
        sizes = ", ".join(f"{path} {size:,} B" for path, size in f["files"].items())
        print(f"{store}: {len(f['files'])} files ({sizes})")
        for side, plain in (("save", "plain_put"), ("restore", "plain_get")):
            mine, theirs = f[f"{side}_requests"], f[f"{plain}_requests"]
            print(
                f"  {side} {f[f'{side}_s']:.3f} s, {sum(mine.values())} requests {mine}\n"
                f"  {plain} {f[f'{plain}_s']:.3f} s, {sum(theirs.values())} requests {theirs}\n"
                f"  ratio {f[f'{side}_s'] / f[f'{plain}_s']:.2f}x"
            )
        print(f"  plain_stream {f['plain_stream_s']:.3f} s")
        made = f["plain_parts_requests"]
        print(f"  plain_parts {f['plain_parts_s']:.3f} s, {sum(made.values())} requests {made}")
        print(f"  requests of each save round: {f['save_requests_rounds']}")
        api = f["api_save_requests"]
        print(f"  de_store.save {f['api_save_s']:.3f} s, {sum(api.values())} requests {api}")
        floor = result["ratios"][f"{store}_restore_vs_max_get_local_restore"]
        print(f"  restore / max(plain get, local restore) {floor:.2f}x")
        paired = ", ".join(
            f"{name} {result['ratios'][f'{store}_{name}_paired']:.2f}x"
            for name in (
                "save_vs_plain_put",
                "api_save_vs_plain_put",
                "save_vs_plain_stream",
                "plain_stream_vs_plain_put",
                "save_vs_plain_parts",
                "api_save_vs_plain_parts",
                "plain_parts_vs_plain_put",
                "restore_vs_plain_get",
            )
        )
        print(f"  median of each round's ratio (same round, same process): {paired}")


if __name__ == "__main__":
    main()
