"""Bytes, save and restore time, and error of each shard compression and value precision.

One float32 table (``--keys`` x ``--dim``, default 1M x 16) is saved with ``de_store.save``
into a local temporary folder in the default format (``--format``, parquet) once per
variant: float32 uncompressed (the reference), zstd and lz4; bfloat16, float16 and int8
values, each uncompressed and with zstd. For each variant it prints:

* ``value_bytes``: the bytes of the value column (int8: with its float16 scales), apart
  from the key bytes (Parquet: the column chunks' sizes in the file's metadata; Arrow:
  the shard's bytes less those of a file of its keys alone, written the same way);
  ``key_bytes`` and ``total_bytes`` (every shard file);
* ``save_s``: the best of ``--repeat`` blocking saves (snapshot, write, fsync, commit),
  taken in rounds that save every variant once in turn, after one untimed save
  (``save_rounds_s``: every round's);
* ``restore_s``: ``de_store.restore`` in a fresh process, the files evicted from the page
  cache first, after one untimed restore of the reference in that process (so every
  variant finds the table kernels traced);
* ``max_abs_error`` / ``mean_abs_error``: of every restored value against the saved one.

Ratios are against the float32 uncompressed save of the same run: ``save_speed`` best
over best, ``save_speed_paired`` the median over the rounds of each round's uncompressed
save over the variant's save of the same round (the two a few seconds apart: what the
machine's state changes between rounds moves both). Targets (issue 37): a
zstd save at 0.8x or more of the uncompressed save's speed, bfloat16 values in half the
bytes, int8 values in at most 0.3x. The zstd save's floor on this machine: ``zstd_compress_s``
is zstd (level 1, as the saves use it) compressing the rows' key and value bytes in
memory, in one thread, the best of three (its CPU time too); ``save_cpu_s`` the CPU time
(every thread's) of the uncompressed save timed ``save_s``; a zstd save does both, so it
takes at least their sum spread evenly over the machine's cores (``cores``), and no less
than the uncompressed save: ``zstd_floor_save_s``. ``zstd_floor_save_speed`` is the
uncompressed save's time over that floor. Work spread over the cores goes no faster than
the cores allow together: ``zstd_compress_parallel_s`` is the same compression in pieces of
4 MiB on ``cores`` threads at once, and ``zstd_parallel_speedup`` its speed-up over one
thread; ``zstd_measured_floor_save_s`` is the sum spread over the cores at that speed-up
(``zstd_measured_floor_save_speed``). ``zstd_levels``: the value bytes compressed whole
in one thread at levels 1, -1 and -5 (seconds, the best of three, and compressed over raw
bytes): what zstd saves on float rows comes from its entropy coding of the literals, which
its negative (fast) levels leave out, so no level below 1 is both faster and smaller.

Those floors are sums; the plainest pair of writes measures one. ``plain_write_s``: the
rows' key and value bytes copied, 4 MiB at a time, into one page-aligned buffer and
written straight to the disk (``O_DIRECT``, one file, fsync at the end);
``plain_zstd_write_s``: the same bytes compressed (zstd level 1) in pieces of 2 MiB on
``cores`` threads, all pieces handed to the threads at once, each written in its turn
the same way. Both the best of ``--repeat`` rounds (``_cpu_s``: that round's CPU time),
taken in turn after the saves;
``zstd_plain_write_speed`` is the first over the second (``_paired``: the median of the
rounds' ratios): what this machine allows a zstd save against an uncompressed one when
nothing but the bytes is handled (no checksum, no Parquet, no table).

``codec_cores``: zstd saves with each codec thread kept to its own share of the cores, as
de_store runs them (``apart_s``), against the same saves with the codec threads free to
share a core (``shared_s``, at the same lower priority), a save of each in turn per
round, the best of ``--repeat`` rounds (``_rounds_s``: every round's); the printed line
gives how many times as fast the first ran, best over best and paired.

``part_sizes``: uncompressed and zstd saves in parts of 65,536 rows (``rows_65536``) and
in the parts de_store chooses when not told (``chosen``, about 16 MiB each:
``chosen_rows`` rows), each of the four in turn per round, the best of ``--repeat``
rounds (``_rounds_s``: every round's); the printed line gives each size's zstd save
speed against its uncompressed save, best over best and paired. The variants above are
saved in the chosen parts.

Beside a training loop: ``train_step_alone_ms`` is the mean time of a training-like step
(a ``tf.function`` of eight products of a 384 x 384 matrix, on TensorFlow's threads),
the best of three runs of 50; for an uncompressed and a zstd async save
(``beside_training``), ``train_step_beside_async_ms`` is a step's mean time while the
save runs, steps called one after the other from its call until it has committed, and
``async_save_beside_training_s`` the save's time from its call to its commit, both the
median of ``--repeat`` rounds: what an async save costs the steps beside it, and how
long it takes when it shares the cores with them.

The rows stand in for trained embeddings (not constant rows): each row is a correlated
Gaussian (standard normals times a random ``dim x dim`` mixing matrix, so dims co-vary as
trained ones do), scaled by a row norm drawn log-normally (median 0.05, sigma 1: rows of
frequent ids move far from their initial values, rare ones stay near them, about two
decades apart). Keys are unique int64 spread over the whole range.

    python benchmarks/bytes_bench.py --keys 1000000 --dim 16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness

#: name -> (compression, value_precision); the first is the reference.
VARIANTS: dict[str, tuple[str, str | None]] = {
    "float32": ("none", None),
    "float32_zstd": ("zstd", None),
    "float32_lz4": ("lz4", None),
    "bfloat16": ("none", "bfloat16"),
    "bfloat16_zstd": ("zstd", "bfloat16"),
    "float16": ("none", "float16"),
    "float16_zstd": ("zstd", "float16"),
    "int8": ("none", "int8"),
    "int8_zstd": ("zstd", "int8"),
}
REFERENCE = "float32"


def trained_like_rows(keys: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and rows standing in for trained embeddings (see the module's docstring)."""
    rng = np.random.default_rng(harness.SEED)
    ids = np.arange(keys, dtype=np.int64) * np.int64(-7046029254386353131)
    mixing = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
    norms = np.exp(rng.normal(np.log(0.05), 1.0, (keys, 1))).astype(np.float32)
    values = rng.standard_normal((keys, dim), dtype=np.float32) @ mixing
    return ids, values * norms


def make_variable(tf: Any, de_store: Any, args: argparse.Namespace) -> Any:
    return de_store.get_variable(
        "embedding", key_dtype=tf.int64, value_dtype=tf.float32, dim=args.dim,
        init_size=args.keys, kv_creator=de_store.HashTableCreator(),
    )  # fmt: skip


# --- phase: save (every variant, one process) ------------------------------------------
def phase_save(args: argparse.Namespace) -> None:
    import tensorflow as tf

    import de_store

    variable = make_variable(tf, de_store, args)
    keys, values = trained_like_rows(args.keys, args.dim)
    variable.upsert(keys, values)
    save = functools.partial(de_store.save, [variable], blocking=True, format=args.format)
    save(os.path.join(args.dir, "warm-up"))  # traces the export: no variant pays it
    shutil.rmtree(os.path.join(args.dir, "warm-up"))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for attempt in range(args.repeat):  # each round saves every variant once, in turn
        for name, (compression, precision) in VARIANTS.items():
            url = os.path.join(args.dir, name if attempt == 0 else f"{name}-again")
            cpu = time.process_time()
            seconds, _ = harness.timed(
                lambda u=url, c=compression, p=precision: save(u, compression=c, value_precision=p)
            )
            times[name].append((seconds, time.process_time() - cpu))
            if attempt:
                shutil.rmtree(url)
    out: dict[str, Any] = {}
    for name in VARIANTS:
        best, cpu_s = min(times[name])
        out[name] = {"save_s": best, "save_cpu_s": cpu_s,
                     "save_rounds_s": [seconds for seconds, _ in times[name]]}  # fmt: skip
        out[name].update(shard_bytes(os.path.join(args.dir, name), args))
    out["zstd_compress_s"] = zstd_compress_s(keys, values)
    out["zstd_compress_parallel_s"] = zstd_compress_s(keys, values, os.cpu_count() or 1)
    out["zstd_levels"] = zstd_levels(values)
    out.update(plain_writes(os.path.join(args.dir, "plain"), keys, values, args.repeat))
    out["codec_cores"] = codec_cores(save, args)
    out["part_sizes"] = part_sizes(save, args)
    out.update(beside_training(tf, de_store, variable, args))
    harness.emit(out)


def codec_cores(save: Any, args: argparse.Namespace) -> dict[str, Any]:
    """zstd saves with each codec thread kept to its own share of the cores, as de_store
    runs them (``apart``), and with the same threads, at the same priority, free to share
    a core (``shared``: a pool of its own swapped in for those saves), a save of each in
    turn per round: the best of ``--repeat`` rounds and every round's time."""
    from de_store._threads import LazyPool
    from de_store.formats import _plain_parquet

    apart = _plain_parquet._CODEC_POOL
    shared = LazyPool(
        _plain_parquet._CODEC_THREADS, "de_store-codec-shared", nice=_plain_parquet.CODEC_NICE
    )
    times: dict[str, list[float]] = {"apart": [], "shared": []}
    try:
        for attempt in range(args.repeat + 1):  # the first round starts the shared threads
            for name, pool in (("apart", apart), ("shared", shared)):
                _plain_parquet._CODEC_POOL = pool
                url = os.path.join(args.dir, f"codec-{name}")
                seconds, _ = harness.timed(lambda u=url: save(u, compression="zstd"))
                if attempt:
                    times[name].append(seconds)
                shutil.rmtree(url)
    finally:
        _plain_parquet._CODEC_POOL = apart
    return {
        **{f"{name}_s": min(rounds) for name, rounds in times.items()},
        **{f"{name}_rounds_s": rounds for name, rounds in times.items()},
    }


#: The part sizes ``part_sizes`` compares: name -> ``buffer_size`` (None: de_store's choice).
PART_SIZES = {"rows_65536": 65536, "chosen": None}


def part_sizes(save: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Uncompressed and zstd saves in parts of 65,536 rows and in the parts de_store
    chooses (``FileSystemSaver(buffer_size=None)``: about 16 MiB each), a save of each
    in turn per round: the best of ``--repeat`` rounds and every round's time, by
    ``{size}_{compression}``, and the rows of a chosen part (``chosen_rows``)."""
    from de_store.formats.base import SchemaInfo, part_rows

    times: dict[str, list[float]] = {
        f"{size}_{compression}": [] for size in PART_SIZES for compression in ("none", "zstd")
    }
    for _ in range(args.repeat):
        for size, buffer_size in PART_SIZES.items():
            for compression in ("none", "zstd"):
                url = os.path.join(args.dir, f"parts-{size}-{compression}")
                seconds, _ = harness.timed(
                    lambda u=url, c=compression, b=buffer_size: save(
                        u, compression=c, buffer_size=b
                    )
                )
                times[f"{size}_{compression}"].append(seconds)
                shutil.rmtree(url)
    return {
        "chosen_rows": part_rows(SchemaInfo("bytes_bench", args.dim)),
        **{f"{name}_s": min(rounds) for name, rounds in times.items()},
        **{f"{name}_rounds_s": rounds for name, rounds in times.items()},
    }


#: The async saves timed beside a training-like loop: name -> compression.
BESIDE_TRAINING = {"float32": "none", "float32_zstd": "zstd"}


def beside_training(tf: Any, de_store: Any, variable: Any, args: argparse.Namespace) -> dict:
    """``train_step_alone_ms`` and, per :data:`BESIDE_TRAINING` save, the median over
    ``--repeat`` rounds of a step's mean time while an async save runs
    (``train_step_beside_async_ms``) and of the save's time from its call to its commit
    (``async_save_beside_training_s``); see the module's docstring."""
    weights = tf.Variable(tf.random.stateless_normal([TRAIN_WIDTH, TRAIN_WIDTH], seed=[1, 2]))

    @tf.function
    def step() -> Any:
        out = weights
        for _ in range(TRAIN_LAYERS):
            out = tf.tanh(tf.matmul(out, weights) * 0.01)
        return tf.reduce_sum(out)

    for _ in range(20):  # traced, and the thread pools started
        step().numpy()
    alone = min(harness.timed(lambda: [step().numpy() for _ in range(50)])[0] for _ in range(3))
    out: dict[str, Any] = {"train_step_alone_ms": alone / 50 * 1e3}
    for name, compression in BESIDE_TRAINING.items():
        steps_ms, saves_s = [], []
        for attempt in range(args.repeat):
            url = os.path.join(args.dir, f"{name}-beside-training-{attempt}")
            start = time.perf_counter()
            pending = de_store.save([variable], url, blocking=False, format=args.format,
                                    compression=compression)  # fmt: skip
            stepping, steps = time.perf_counter(), 0
            while not pending.done():
                step().numpy()
                steps += 1
            ended = time.perf_counter()
            pending.result()
            saves_s.append(ended - start)
            steps_ms.append((ended - stepping) / max(steps, 1) * 1e3)
            shutil.rmtree(url)
        out[name] = {"train_step_beside_async_ms": statistics.median(steps_ms),
                     "async_save_beside_training_s": statistics.median(saves_s)}  # fmt: skip
    return {"beside_training": out}


#: The training-like step: ``TRAIN_LAYERS`` products of a ``TRAIN_WIDTH`` square matrix.
TRAIN_WIDTH, TRAIN_LAYERS = 384, 8


#: The zstd levels ``zstd_levels`` compares: the saves' level and two fast ones.
LEVELS = (1, -1, -5)


def zstd_levels(values: np.ndarray) -> dict[str, dict[str, float]]:
    """Per level of :data:`LEVELS`: seconds to compress ``values`` whole in one thread
    (the best of three) and the compressed bytes over the raw ones."""
    import pyarrow as pa

    data = memoryview(values).cast("B")
    out = {}
    for level in LEVELS:
        codec = pa.Codec("zstd", level)
        seconds = min(harness.timed(lambda c=codec: c.compress(data))[0] for _ in range(3))
        out[str(level)] = {"s": seconds, "ratio": len(codec.compress(data)) / data.nbytes}
    return out


#: Bytes per piece of the parallel compression (about a part's value page at dim 16).
PIECE_BYTES = 4 << 20


def zstd_compress_s(keys: np.ndarray, values: np.ndarray, threads: int = 1) -> float:
    """Seconds zstd level 1 takes to compress ``keys`` and ``values``, the best of three:
    whole in one thread (its CPU time as well: nothing else runs), or in pieces of
    :data:`PIECE_BYTES` on ``threads`` threads at once."""
    import concurrent.futures

    import pyarrow as pa

    codec = pa.Codec("zstd", 1)
    data = [memoryview(keys).cast("B"), memoryview(values).cast("B")]
    if threads == 1:
        return min(harness.timed(lambda: [codec.compress(d) for d in data])[0] for _ in range(3))
    pieces = [d[i : i + PIECE_BYTES] for d in data for i in range(0, d.nbytes, PIECE_BYTES)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(codec.compress, pieces[:threads]))  # the threads started
        return min(
            harness.timed(lambda: list(pool.map(codec.compress, pieces)))[0] for _ in range(3)
        )


#: Bytes of the page-aligned buffer the plainest writes copy their bytes into, and of the
#: pieces the plainest zstd write compresses.
PLAIN_BUFFER_BYTES = 4 << 20
PLAIN_PIECE_BYTES = 2 << 20


def plain_writes(path: str, keys: np.ndarray, values: np.ndarray, rounds: int) -> dict[str, Any]:
    """``plain_write_s`` and ``plain_zstd_write_s`` (see the module's docstring), the best
    of ``rounds`` rounds each and that round's CPU time (``_cpu_s``: every thread's),
    every round's time too, and the zstd file's bytes."""
    import concurrent.futures
    import mmap

    import pyarrow as pa

    codec = pa.Codec("zstd", 1)
    data = [memoryview(keys).cast("B"), memoryview(values.reshape(-1)).cast("B")]
    buffer = np.frombuffer(mmap.mmap(-1, PLAIN_BUFFER_BYTES), np.uint8)
    buffer[:] = 0  # touched before any timing

    def pieces(size: int) -> Any:
        return (d[i : i + size] for d in data for i in range(0, d.nbytes, size))

    def compress(piece: memoryview) -> Any:
        return codec.compress(piece, asbytes=False)

    def write(stream: Any) -> int:
        writer = harness.DirectWriter(path, buffer)
        try:
            for piece in stream:
                writer.write(piece)
        finally:
            writer.close()
        return writer.size

    times: dict[str, list[tuple[float, float]]] = {"plain_write_s": [], "plain_zstd_write_s": []}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(compress, list(pieces(PLAIN_PIECE_BYTES))[:8]))  # the threads started
        for _ in range(rounds):
            cpu = time.process_time()
            seconds, _ = harness.timed(lambda: write(pieces(PLAIN_BUFFER_BYTES)))
            times["plain_write_s"].append((seconds, time.process_time() - cpu))
            os.remove(path)
            cpu = time.process_time()
            seconds, zstd_bytes = harness.timed(
                lambda: write(pool.map(compress, pieces(PLAIN_PIECE_BYTES)))
            )
            times["plain_zstd_write_s"].append((seconds, time.process_time() - cpu))
            os.remove(path)
    out: dict[str, Any] = {}
    for name, rounds_s in times.items():
        out[name], out[f"{name[:-2]}_cpu_s"] = min(rounds_s)
        out[f"{name[:-2]}_rounds_s"] = [seconds for seconds, _ in rounds_s]
    out["plain_zstd_bytes"] = zstd_bytes
    return out


def shard_bytes(url: str, args: argparse.Namespace) -> dict[str, int]:
    """``total_bytes`` of a checkpoint's shard files, and their ``key_bytes`` and
    ``value_bytes`` (see the module's docstring)."""
    (manifest,) = [f for f in os.listdir(url) if f.startswith("manifest-")]
    with open(os.path.join(url, manifest)) as f:
        entry = json.load(f)["variables"]["embedding"]
    paths = [
        os.path.join(url, file["path"]) for s in entry["shards"] for file in s["info"]["files"]
    ]
    total = sum(os.path.getsize(p) for p in paths)
    key = sum(_key_bytes(p, args.format, entry.get("compression", "none")) for p in paths)
    if args.format == "parquet":
        value = sum(_parquet_column_bytes(p, ("value", "value_scale")) for p in paths)
    else:
        value = total - key
    return {"total_bytes": total, "key_bytes": key, "value_bytes": value}


def _parquet_column_bytes(path: str, columns: tuple[str, ...]) -> int:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    total = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for j in range(row_group.num_columns):
            chunk = row_group.column(j)
            if chunk.path_in_schema.split(".")[0] in columns:
                total += chunk.total_compressed_size
    return total


def _key_bytes(path: str, format_name: str, compression: str) -> int:
    """The bytes of the key column of a shard: Parquet's column chunks; for Arrow, a file
    of the shard's keys alone, written with the same codec and record batches."""
    if format_name == "parquet":
        return _parquet_column_bytes(path, ("key",))
    import pyarrow as pa

    reader = pa.ipc.open_file(pa.memory_map(path))
    codec = None if compression == "none" else compression
    sink = pa.BufferOutputStream()
    schema = pa.schema([reader.schema.field("key")])
    with pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as w:
        for i in range(reader.num_record_batches):
            w.write_batch(reader.get_batch(i).select(["key"]))
    return int(sink.getvalue().size)


# --- phase: restore (a fresh process) ---------------------------------------------------
def phase_restore(args: argparse.Namespace) -> None:
    import tensorflow as tf

    import de_store

    variable = make_variable(tf, de_store, args)
    de_store.restore([variable], os.path.join(args.dir, REFERENCE))  # traces the kernels
    harness.drop_cache(os.path.join(args.dir, args.variant))
    url = os.path.join(args.dir, args.variant)
    seconds, _ = harness.timed(lambda: de_store.restore([variable], url))
    keys, values = trained_like_rows(args.keys, args.dim)
    found, exists = variable.lookup(keys, return_exists=True)
    error = np.abs(found.numpy() - values)
    harness.emit({
        "restore_s": seconds,
        "restored_all": bool(np.all(exists.numpy())) and int(variable.size()) == args.keys,
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
    })  # fmt: skip


# --- driver -----------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, variant: str = REFERENCE) -> dict[str, Any]:
    options = ["--keys", str(args.keys), "--dim", str(args.dim), "--format", args.format]
    options += ["--dir", args.dir, "--variant", variant, "--repeat", str(args.repeat)]
    cache = {"DE_STORE_CACHE_DIR": os.path.join(args.dir, "cache")}
    return harness.run_phase(__file__, phase, options, env=cache)


def paired_speed(reference: list[float], variant: list[float]) -> float:
    """The median over the rounds of the reference's save time over the variant's."""
    return float(np.median(np.divide(reference, variant)))


def ratios(result: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant against the float32 uncompressed save of the same run."""
    ref = result[REFERENCE]
    return {
        name: {
            "value_bytes": r["value_bytes"] / ref["value_bytes"],
            "total_bytes": r["total_bytes"] / ref["total_bytes"],
            "save_speed": ref["save_s"] / r["save_s"],
            "save_speed_paired": paired_speed(ref["save_rounds_s"], r["save_rounds_s"]),
            "restore_speed": ref["restore_s"] / r["restore_s"],
        }
        for name, r in result.items()
    }


def print_table(result: dict[str, dict[str, Any]], rel: dict[str, dict[str, float]]) -> None:
    print(f"{'variant':14} {'value MB':>9} {'x f32':>6} {'key MB':>7} {'save s':>7} "
          f"{'speed':>6} {'paired':>6} {'restore s':>9} {'speed':>6} {'max err':>9} "
          f"{'mean err':>9}")  # fmt: skip
    for name, r in result.items():
        x = rel[name]
        print(f"{name:14} {r['value_bytes'] / 1e6:9.2f} {x['value_bytes']:6.3f} "
              f"{r['key_bytes'] / 1e6:7.2f} {r['save_s']:7.3f} {x['save_speed']:6.2f} "
              f"{x['save_speed_paired']:6.2f} "
              f"{r['restore_s']:9.3f} {x['restore_speed']:6.2f} {r['max_abs_error']:9.2e} "
              f"{r['mean_abs_error']:9.2e}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--format", default="parquet", choices=["parquet", "arrow"])
    parser.add_argument("--repeat", type=int, default=3, help="saves per variant (the best)")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=REFERENCE, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        {"save": phase_save, "restore": phase_restore}[args.phase](args)
        return
    args.dir = tempfile.mkdtemp(prefix="de_store_bytes_bench_", dir="/tmp")
    try:
        result: dict[str, Any] = run_phase(args, "save")
        compress_s = result.pop("zstd_compress_s")
        parallel_s = result.pop("zstd_compress_parallel_s")
        levels = result.pop("zstd_levels")
        plain = {name: result.pop(name) for name in list(result) if name.startswith("plain_")}
        training = result.pop("beside_training")
        cores_ab = result.pop("codec_cores")
        parts_ab = result.pop("part_sizes")
        for name in VARIANTS:
            result[name].update(run_phase(args, "restore", name))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    rel = ratios(result)
    print_table(result, rel)
    reference_s, reference_cpu_s = result[REFERENCE]["save_s"], result[REFERENCE]["save_cpu_s"]
    cores = os.cpu_count() or 1
    floor_s = max(reference_s, (reference_cpu_s + compress_s) / cores)
    speedup = compress_s / parallel_s
    measured_floor_s = max(reference_s, (reference_cpu_s + compress_s) / speedup)
    print(
        f"zstd compression of the same bytes, one thread: {compress_s:.3f} s; the uncompressed "
        f"save used {reference_cpu_s:.3f} s of CPU; both spread over {cores} cores: "
        f"{floor_s:.3f} s, a zstd save's floor (speed {reference_s / floor_s:.2f}); "
        f"the same compression on {cores} threads: {parallel_s:.3f} s ({speedup:.2f}x one "
        f"thread), the sum at that speed-up {measured_floor_s:.3f} s "
        f"(speed {reference_s / measured_floor_s:.2f})",
        flush=True,
    )
    print("zstd on the value bytes, one thread, by level: " + "; ".join(
        f"{level}: {f['s']:.3f} s, {f['ratio']:.3f}x the bytes" for level, f in levels.items()
    ), flush=True)  # fmt: skip
    plain_speed = plain["plain_write_s"] / plain["plain_zstd_write_s"]
    plain_paired = paired_speed(plain["plain_write_rounds_s"], plain["plain_zstd_write_rounds_s"])
    print(
        f"the plainest writes of the same bytes straight to the disk: uncompressed "
        f"{plain['plain_write_s']:.3f} s ({plain['plain_write_cpu_s']:.3f} s of CPU), zstd "
        f"on {cores} threads {plain['plain_zstd_write_s']:.3f} s "
        f"({plain['plain_zstd_write_cpu_s']:.3f} s of CPU, "
        f"{plain['plain_zstd_bytes'] / 1e6:.2f} MB): speed {plain_speed:.2f} "
        f"(paired {plain_paired:.2f})",
        flush=True,
    )
    print(
        f"zstd saves with each codec thread on its own share of the cores: "
        f"{cores_ab['apart_s']:.3f} s; free to share a core: {cores_ab['shared_s']:.3f} s "
        f"(the first {cores_ab['shared_s'] / cores_ab['apart_s']:.2f}x as fast, paired "
        f"{paired_speed(cores_ab['shared_rounds_s'], cores_ab['apart_rounds_s']):.2f}x)",
        flush=True,
    )
    print("; ".join(
        f"parts of {'65,536' if size == 'rows_65536' else format(parts_ab['chosen_rows'], ',')} "
        f"rows: uncompressed {parts_ab[f'{size}_none_s']:.3f} s, zstd "
        f"{parts_ab[f'{size}_zstd_s']:.3f} s (speed "
        f"{parts_ab[f'{size}_none_s'] / parts_ab[f'{size}_zstd_s']:.2f}, paired "
        f"{paired_speed(parts_ab[f'{size}_none_rounds_s'], parts_ab[f'{size}_zstd_rounds_s']):.2f})"
        for size in PART_SIZES
    ), flush=True)  # fmt: skip
    alone_ms = training["train_step_alone_ms"]
    print(f"a training-like step alone: {alone_ms:.2f} ms; beside an async save: " + "; ".join(
        f"{name} {t['train_step_beside_async_ms']:.2f} ms "
        f"({t['train_step_beside_async_ms'] / alone_ms:.2f}x), the save "
        f"{t['async_save_beside_training_s']:.3f} s" for name, t in training.items()
        if name in BESIDE_TRAINING
    ), flush=True)  # fmt: skip
    targets = {
        "zstd_save_speed": rel["float32_zstd"]["save_speed"],
        "zstd_save_speed_paired": rel["float32_zstd"]["save_speed_paired"],
        "zstd_floor_save_speed": reference_s / floor_s,
        "zstd_measured_floor_save_speed": reference_s / measured_floor_s,
        "zstd_plain_write_speed": plain_speed,
        "zstd_plain_write_speed_paired": plain_paired,
        "bfloat16_value_bytes": rel["bfloat16"]["value_bytes"],
        "int8_value_bytes": rel["int8"]["value_bytes"],
    }
    summary = {"keys": args.keys, "dim": args.dim, "format": args.format,
               "zstd_compress_s": compress_s, "cores": cores, "zstd_floor_save_s": floor_s,
               "zstd_compress_parallel_s": parallel_s, "zstd_parallel_speedup": speedup,
               "zstd_measured_floor_save_s": measured_floor_s, "zstd_levels": levels,
               **plain, "codec_cores": cores_ab, "part_sizes": parts_ab,
               "beside_training": training,
               "targets": targets,
               "targets_met": {"zstd_save_speed": targets["zstd_save_speed"] >= 0.8,
                               "bfloat16_value_bytes": targets["bfloat16_value_bytes"] <= 0.5,
                               "int8_value_bytes": targets["int8_value_bytes"] <= 0.3},
               "variants": result, "ratios": rel}  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
