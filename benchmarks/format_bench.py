"""Shard format throughput against raw references, on a local directory and on moto S3.

Writes and reads N rows (int64 keys, float32 values of dim D) with each format, and the
same bytes raw: locally, one unbuffered ``write`` of each array + fsync, and one
``readinto`` a new ``numpy.empty`` array (``numpy.fromfile`` reads 3-4x slower than that
here, which made a flattering reference); s3fs ``pipe`` and ``cat`` on S3. Local reads are
cold: every file, raw or format, is fsynced and then dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` before it is read. Format reads verify every crc32c
(``expected`` given), as a restore does.

MB/s count the logical data, N * (8 + 4 D) bytes, for every entry, so ratios compare times.
Each figure is the median of ``--repeat`` rounds; a round measures raw and every format one
after the other, so a shared machine's load shifts them alike. The raw local entry also
gives, for contrast, ``read_warm`` (the same read again, from the page cache) and
``read_stream`` (a cold read in 16 MiB chunks into one reused buffer: no new memory to
fault in, unlike ``read``). The last stdout line is one JSON object with every figure and
the ratios to raw (``read``).

Usage::

    python benchmarks/format_bench.py --keys 10000000 --dim 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from _harness import drop_cache, timed

from de_store.backends import Backend, open_backend
from de_store.formats import SchemaInfo, ShardInfo, batch_from_numpy, get_format

FORMATS = {"binary": {}, "arrow": {}, "parquet": {"compression": "none"}}


def batches(keys: np.ndarray, values: np.ndarray, rows: int) -> Iterator[pa.RecordBatch]:
    for start in range(0, len(keys), rows):
        yield batch_from_numpy(keys[start : start + rows], values[start : start + rows])


def raw_local(directory: str, keys: np.ndarray, values: np.ndarray) -> dict[str, float]:
    paths = [os.path.join(directory, f"raw-{part}") for part in ("keys", "values")]

    def write() -> None:
        for path, array in zip(paths, (keys, values), strict=True):
            with open(path, "wb", buffering=0) as f:
                f.write(array.reshape(-1).view(np.uint8).data)
                os.fsync(f.fileno())

    write_s, _ = timed(write)
    for path in paths:
        drop_cache(path)

    def read() -> list[np.ndarray]:
        arrays = [np.empty_like(keys), np.empty_like(values)]
        for path, array in zip(paths, arrays, strict=True):
            with open(path, "rb", buffering=0) as f:
                assert f.readinto(array.reshape(-1).view(np.uint8).data) == array.nbytes
        return arrays

    def read_stream() -> None:
        chunk = bytearray(16 << 20)
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(chunk):
                    pass

    read_s, arrays = timed(read)
    assert np.array_equal(arrays[0], keys)
    del arrays
    read_warm_s, _ = timed(read)
    for path in paths:
        drop_cache(path)
    read_stream_s, _ = timed(read_stream)
    for path in paths:
        os.unlink(path)
    return {
        "write_s": write_s,
        "read_s": read_s,
        "read_warm_s": read_warm_s,
        "read_stream_s": read_stream_s,
    }


def raw_s3(backend: Backend, keys: np.ndarray, values: np.ndarray) -> dict[str, float]:
    fs: Any = backend.fs  # type: ignore[attr-defined]
    root = backend.root  # type: ignore[attr-defined]
    paths = [f"{root}/raw-{part}" for part in ("keys", "values")]
    data = [keys.tobytes(), values.tobytes()]
    write_s, _ = timed(lambda: [fs.pipe_file(p, d) for p, d in zip(paths, data, strict=True)])
    read_s, got = timed(lambda: [fs.cat_file(p) for p in paths])
    assert got[0] == data[0]
    fs.rm(paths)
    return {"write_s": write_s, "read_s": read_s}


def run_format(
    backend: Backend, name: str, keys: np.ndarray, values: np.ndarray, buffer_size: int
) -> dict[str, float]:
    fmt = get_format(name, **FORMATS[name])
    path = f"bench-{uuid.uuid4().hex[:8]}{fmt.suffix}"
    schema = SchemaInfo("bench", values.shape[1])
    write_s, info = timed(
        lambda: fmt.write(
            backend,
            path,
            batches(keys, values, buffer_size),
            schema_info=schema,
            buffer_size=buffer_size,
        )
    )
    local = [backend.local_path(f.path) for f in info.files]
    for file in local:
        if file:
            drop_cache(file)
    read_s, rows = timed(lambda: read_all(fmt, backend, info, buffer_size))
    assert rows == len(keys), (name, rows)
    for file in info.files:
        backend.delete(file.path)
    return {"write_s": write_s, "read_s": read_s, "file_bytes": info.bytes}


def read_all(fmt: Any, backend: Backend, info: ShardInfo, buffer_size: int) -> int:
    return sum(
        b.num_rows for b in fmt.read(backend, info.path, expected=info, buffer_size=buffer_size)
    )


def mb_per_s(data_bytes: int, seconds: float) -> float:
    return round(data_bytes / seconds / 1e6, 1)


def summarise(data_bytes: int, figures: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend_name, entries in figures.items():
        raw = entries["raw"]
        for entry, f in entries.items():
            row = out.setdefault(entry, {}).setdefault(backend_name, {})
            for direction in ("write", "read", "read_warm", "read_stream"):
                if f"{direction}_s" not in f:
                    continue
                row[direction] = mb_per_s(data_bytes, f[f"{direction}_s"])
                if entry != "raw" and direction in ("write", "read"):
                    row[f"{direction}_vs_raw"] = round(
                        raw[f"{direction}_s"] / f[f"{direction}_s"], 2
                    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--buffer-size", type=int, default=262144, help="rows per part")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto S3 server")
    parser.add_argument("--dir", default=None, help="local directory (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; figures are medians")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    keys = rng.integers(-(1 << 62), 1 << 62, args.keys, dtype=np.int64)
    values = rng.standard_normal((args.keys, args.dim), dtype=np.float32)
    data_bytes = keys.nbytes + values.nbytes
    print(f"{args.keys} rows x dim {args.dim}: {data_bytes / 1e6:.0f} MB of keys and values")

    figures: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        backend = open_backend(directory)
        entries = {"raw": lambda: raw_local(directory, keys, values)}
        entries |= format_entries(backend, keys, values, args.buffer_size)
        figures["local"] = medians("local", entries, args.repeat)
    if not args.no_s3:
        figures["s3"] = bench_s3(keys, values, args.buffer_size, args.repeat)
    result = {
        "keys": args.keys,
        "dim": args.dim,
        "buffer_size": args.buffer_size,
        "data_mb": round(data_bytes / 1e6, 1),
        "repeat": args.repeat,
        "read": "cold (posix_fadvise DONTNEED)",
        "mb_per_s": summarise(data_bytes, figures),
    }
    print(json.dumps(result))


def format_entries(
    backend: Backend, keys: np.ndarray, values: np.ndarray, buffer_size: int
) -> dict[str, Callable[[], dict[str, float]]]:
    def entry(name: str) -> Callable[[], dict[str, float]]:
        return lambda: run_format(backend, name, keys, values, buffer_size)

    return {name: entry(name) for name in FORMATS}


def medians(
    where: str, entries: dict[str, Callable[[], dict[str, float]]], repeat: int
) -> dict[str, dict[str, float]]:
    """Run every entry once per round, ``repeat`` rounds; the median of each figure."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in entries}
    for round_ in range(repeat):
        for name, run in entries.items():
            runs[name].append(run())
            print(where, round_, name, runs[name][-1], flush=True)
    return {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }


def bench_s3(
    keys: np.ndarray, values: np.ndarray, buffer_size: int, repeat: int
) -> dict[str, dict[str, float]]:
    from de_store.testing import servers

    endpoint, stop = servers.start_moto_server(in_process=False)
    try:
        options = servers.s3_storage_options(endpoint)
        servers.create_bucket("s3", "bench", options)
        backend = open_backend("s3://bench/shards", options)
        entries = {"raw": lambda: raw_s3(backend, keys, values)}
        entries |= format_entries(backend, keys, values, buffer_size)
        return medians("s3", entries, repeat)
    finally:
        stop()


if __name__ == "__main__":
    main()
