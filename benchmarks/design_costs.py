"""The costs behind design choices the code makes, each against the alternative it avoids.

Usage::

    python benchmarks/design_costs.py --keys 10000000 --dim 16

- ``parquet``: one Parquet file of N rows (int64 key, ``fixed_size_list`` of D float32)
  written by Arrow's writer as the format configures it, by de_store's plain writer
  (``formats/_plain_parquet.py``), and by Arrow's writer with the values as D plain
  columns (no repetition or definition levels). Row groups of 2**20 rows, into a file in
  a temporary folder (the page cache; not fsynced).
- ``copy_on_read``: seconds per GB of assigning an [N, D] float32 tensor to a variable
  that ``tf.gather`` has put in copy-on-read mode, and of the same assignment after
  ``DisableCopyOnRead`` (``de_store.tables._variables.replace``).
- ``gather_rows``: ``np.take(values, order, axis=0)`` against ``values[order]`` for a
  random order of the N rows (``de_store.checkpoint.variable_rows.ShardRows.take``).
- ``bucket_order``: the bucket of N keys by ``de_store.checkpoint.buckets.int_floormod``
  and by ``np.mod``; the stable order of N bucket ids below 720 and below 5040 by Arrow's
  ``array_sort_indices`` (a counting sort up to 4096 values, comparisons above) and by
  numpy's radix sort of them as uint16 (``buckets.stable_order``).
- ``first_insert``: a fresh process creates a ``HashTable`` and inserts one batch of
  ``STEP_BATCH`` keys (a training step's: below ``_kernels.OP_BY_OP_MIN_KEYS``, such a call
  always runs the traced insert kernel, which a bulk call of a new process does not wait
  for), with de_store's cache directory (a new temporary folder) empty,
  then warm (kernels and XLA compiles kept by the first process), then warm with Grappler
  left on for the kernels' eager calls (``de_store.tables._locking.unoptimized_calls`` not
  used; after one such process, whose XLA compiles are kept too). The reference is the
  same insert into a new table in the same process (``new_table_again_s``, best of 2).
  Each figure is the best of ``--repeat`` rounds of these four processes.
- ``autograph``: tracing TensorFlow's ``AsyncCheckpointHelper._copy_to_cpu`` over D
  variables with autograph (as TensorFlow declares it) and without (as
  ``de_store.saver.tf_compat.trace_async_copies_without_autograph`` has it traced).
- ``package_versions``: ``importlib.metadata.version`` of the five packages a manifest
  names, the first time in a process and again, against the cached
  ``de_store.checkpoint.manifest.library_versions``.

Memory state: a timed step that makes an array, a tensor or a file puts it in memory new
to the process, first touched inside the timing, as the code's own calls do (on these
virtual machines first-touched memory costs several times more than reused memory).
Each figure is the best of ``--repeat`` rounds (default 3). Each part's figures are
printed as one line; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _harness import FILL_BATCH, emit, rows, run_phase, timed

PACKAGES = ("de_store", "tensorflow", "pyarrow", "fsspec", "numpy")
#: Keys of the first insert: a training step's batch, which runs the traced kernel.
STEP_BATCH = 4096
#: The insert phase's processes in one cache folder, in turn: their extra options and the
#: name of their figures (none: a process run to fill the cache for the next one).
RUNS = (
    ([], "cache_empty"),
    ([], "cache_warm"),
    (["--grappler"], None),
    (["--grappler"], "cache_warm_grappler"),
)


def best(repeat: int, fn: Callable[[], Any]) -> float:
    """The least seconds ``fn()`` took in ``repeat`` calls."""
    return min(timed(fn)[0] for _ in range(repeat))


def parquet_writers(keys: int, dim: int, repeat: int) -> dict[str, float]:
    from de_store.formats import batch_from_numpy
    from de_store.formats._plain_parquet import PlainParquetWriter

    batches = [batch_from_numpy(k, v) for k, v in rows(keys, dim)]
    split = [  # the values as ``dim`` plain float32 columns
        pa.RecordBatch.from_arrays(
            [b.column(0), *(b.column(1).flatten().to_numpy()[i::dim] for i in range(dim))],
            ["key", *(f"value_{i}" for i in range(dim))],
        )
        for b in batches
    ]
    path = os.path.join(tempfile.mkdtemp(prefix="de_store_costs_"), "costs.parquet")

    def arrow(parts: list[pa.RecordBatch]) -> None:
        options = {"compression": "none", "use_dictionary": False, "write_statistics": ["key"]}
        with pq.ParquetWriter(pa.OSFile(path, "wb"), parts[0].schema, **options) as writer:
            for part in parts:
                writer.write_batch(part, row_group_size=part.num_rows)

    def plain() -> None:
        with pa.OSFile(path, "wb") as sink:
            writer = PlainParquetWriter(sink, batches[0].schema, ["key"])
            for batch in batches:
                writer.write_batch(batch)
            writer.close()

    figures = {
        "arrow_fixed_size_list_s": best(repeat, lambda: arrow(batches)),
        "plain_writer_s": best(repeat, plain),
        "arrow_plain_columns_s": best(repeat, lambda: arrow(split)),
    }
    shutil.rmtree(os.path.dirname(path))
    return figures


def bucket_order(keys: int, repeat: int) -> dict[str, float]:
    import pyarrow.compute as pc

    from de_store.checkpoint.buckets import int_floormod

    ids = np.concatenate([k for k, _ in rows(keys, 1)])
    narrow, wide = int_floormod(ids, 720), int_floormod(ids, 5040)

    def radix(buckets: np.ndarray) -> np.ndarray:
        return np.argsort(buckets.astype(np.uint16), kind="stable")

    return {
        "int_floormod_s": best(repeat, lambda: int_floormod(ids, 720)),
        "np_mod_s": best(repeat, lambda: np.mod(ids, 720)),
        "arrow_sort_720_s": best(repeat, lambda: pc.array_sort_indices(pa.array(narrow))),
        "numpy_radix_720_s": best(repeat, lambda: radix(narrow)),
        "arrow_sort_5040_s": best(repeat, lambda: pc.array_sort_indices(pa.array(wide))),
        "numpy_radix_5040_s": best(repeat, lambda: radix(wide)),
    }


def copy_on_read(keys: int, dim: int, repeat: int) -> dict[str, float]:
    import tensorflow as tf

    var = tf.Variable(tf.zeros([keys, dim]))
    gigabytes = keys * dim * 4 / 1e9

    def assign(disable: bool) -> float:
        value = tf.random.normal([keys, dim])  # a new buffer, not the variable's
        tf.gather(var, [0]).numpy()  # copy-on-read mode on
        if disable:
            tf.raw_ops.DisableCopyOnRead(resource=var.handle)
        start = time.perf_counter()
        var.assign(value)
        var[0, 0].numpy()  # wait for it
        return time.perf_counter() - start

    with_copy = min(assign(False) for _ in range(repeat))
    without = min(assign(True) for _ in range(repeat))
    return {"copy_s_per_gb": with_copy / gigabytes, "disabled_s_per_gb": without / gigabytes}


def gather_rows(keys: int, dim: int, repeat: int) -> dict[str, float]:
    values = np.concatenate([v for _, v in rows(keys, dim)])
    order = np.random.default_rng(0).permutation(keys)
    return {
        "np_take_s": best(repeat, lambda: np.take(values, order, axis=0)),
        "fancy_index_s": best(repeat, lambda: values[order]),
    }


def autograph(dim: int, repeat: int) -> dict[str, float]:
    import tensorflow as tf
    from tensorflow.python.checkpoint import async_checkpoint_helper as helper

    body = helper.AsyncCheckpointHelper._copy_to_cpu.python_function
    variables = [tf.Variable(tf.zeros([16, dim])) for _ in range(dim)]

    class Copied:  # what ``_copy_to_cpu`` calls on each trackable
        def __init__(self, var: tf.Variable) -> None:
            self.var = var

        def _copy_trackable_to_cpu(self, object_map: dict) -> None:
            object_map[self] = tf.identity(self.var)

    class Helper:
        def __init__(self) -> None:
            self._saveable_trackables = [Copied(v) for v in variables]
            self._tpu_embedding_objects: list = []
            self._object_map: dict = {}

    def trace(convert: bool) -> None:
        tf.function(body.__get__(Helper()), autograph=convert).get_concrete_function()

    trace(False)  # the process's first trace pays for more than this function
    # autograph keeps what it converted: the first conversion is the one a process pays
    first = timed(lambda: trace(True))[0]
    return {
        "without_autograph_s": best(repeat, lambda: trace(False)),
        "with_autograph_first_s": first,
        "with_autograph_again_s": best(repeat, lambda: trace(True)),
    }


def package_versions() -> dict[str, float]:
    from de_store.checkpoint.manifest import library_versions

    def read_all() -> None:
        for name in PACKAGES:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                importlib.metadata.version(name)

    library_versions()
    first = timed(read_all)[0] / len(PACKAGES)
    again = best(5, read_all) / len(PACKAGES)
    return {
        "first_ms_per_package": first * 1e3,
        "again_ms_per_package": again * 1e3,
        "cached_us": best(5, library_versions) * 1e6,
    }


def insert_phase(batch: int, dim: int, grappler: bool) -> None:
    """The ``first_insert`` phase, in a fresh process: emits its figures."""
    import tensorflow as tf

    from de_store.tables import HashTable, _kernels

    if grappler:
        _kernels.unoptimized_calls = contextlib.nullcontext  # type: ignore[assignment]
    keys, values = next(rows(batch, dim))
    batch_tensors = tf.constant(keys), tf.constant(values)

    def fill() -> int:
        table = HashTable(tf.int64, tf.float32, dim, name="costs")
        table.insert(*batch_tensors)
        return int(table.size())

    first_s, _ = timed(fill)
    emit({"first_insert_s": first_s, "new_table_again_s": best(2, fill)})


def first_insert(dim: int, batch: int, repeat: int) -> dict[str, dict[str, float]]:
    """The insert phase in fresh processes, ``repeat`` rounds each with a new cache folder."""
    options = ["--dim", str(dim), "--batch", str(batch)]
    rounds = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="de_store_cache_") as cache:
            env = {"DE_STORE_CACHE_DIR": cache}
            runs = {
                name: run_phase(__file__, "insert", options + extra, env=env)
                for extra, name in RUNS
            }
        rounds.append({name: figures for name, figures in runs.items() if name})
    return {run: {k: min(r[run][k] for r in rounds) for k in rounds[0][run]} for run in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--phase", choices=["insert"])
    parser.add_argument("--batch", type=int, default=FILL_BATCH)
    parser.add_argument("--grappler", action="store_true")
    args = parser.parse_args()
    if args.phase == "insert":
        insert_phase(args.batch, args.dim, args.grappler)
        return
    keys, dim, repeat = args.keys, args.dim, args.repeat
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "first_insert": lambda: first_insert(dim, min(keys, STEP_BATCH), repeat),
        "parquet": lambda: parquet_writers(keys, dim, repeat),
        "gather_rows": lambda: gather_rows(keys, dim, repeat),
        "bucket_order": lambda: bucket_order(keys, repeat),
        "copy_on_read": lambda: copy_on_read(keys, dim, repeat),
        "autograph": lambda: autograph(dim, repeat),
        "package_versions": package_versions,
    }
    figures: dict[str, Any] = {"keys": keys, "dim": dim, "repeat": repeat}
    for name, part in parts.items():
        figures[name] = part()
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
