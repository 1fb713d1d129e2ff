"""The kernel cache: a process that finds a table's kernels on disk runs them without
tracing, with the same results; a damaged entry is ignored; ``off`` writes nothing;
TensorFlow's settings (``TF_XLA_FLAGS``) are left as the user set them.

Each case runs real processes: the cache is read when a process first runs a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Upserts with repeated and present keys, accums, removals, lookups of present and missing
# keys, and an export: every eager kernel a training run and a checkpoint use.
SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    import numpy as np
    import tensorflow as tf
    from de_store.tables import HashTable, _kernels

    # A bulk call's kernel is traced in the background once op-by-op calls took this
    # long: never here, so that the entries a run writes do not depend on its speed.
    _kernels.TRACE_AFTER_S = float("inf")
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
    logging.getLogger("de_store").setLevel(logging.DEBUG)
    fixed = os.environ["FIXED_SHAPES"] == "1"
    table = HashTable(key_dtype=tf.int64, dim=3, value_dtype=tf.float32, fixed_shapes=fixed)
    rng = np.random.default_rng(7)
    for n in (5, 40_000, 3):  # small batches probe in the graph loop, big ones compiled
        keys = rng.integers(0, 2 * n, n)  # repeats, and keys present from the last batch
        table.insert(tf.constant(keys), tf.constant(rng.normal(size=(n, 3)), tf.float32))
    table.accum(tf.constant([1, 2, 10**12]), tf.ones([3, 3]))
    table.remove(tf.constant([2, 3, 10**13]))
    values, found = table.lookup(tf.constant([1, 2, 4, 10**12, -5]))
    keys, rows = table.export_all()
    order = np.argsort(keys.numpy())
    print(json.dumps({
        "size": int(table.size()),
        "lookup": values.numpy().tolist(),
        "found": found.numpy().tolist(),
        "keys": keys.numpy()[order].tolist(),
        "rows": rows.numpy()[order].round(6).tolist(),
        "xla_flags": os.environ.get("TF_XLA_FLAGS", ""),
    }))
    """
)


def _run(tmp_path: Path, cache: str, fixed_shapes: bool = False) -> tuple[dict, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env["DE_STORE_CACHE_DIR"] = cache
    env["FIXED_SHAPES"] = str(int(fixed_shapes))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _kernel_lines(log: str, what: str) -> list[str]:
    return sorted(
        line.split()[1] for line in log.splitlines() if line.startswith("kernel ") and what in line
    )


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["growable", "fixed_shapes"])
def test_a_later_process_runs_the_cached_kernels_with_the_same_results(tmp_path, fixed_shapes):
    cache = tmp_path / "cache"
    first, first_log = _run(tmp_path, str(cache), fixed_shapes)
    written = _kernel_lines(first_log, "traced and written")
    assert {"insert", "lookup", "remove", "accum_insert"} <= set(written)
    # A save's bulk step runs op by op, traced only once its calls took TRACE_AFTER_S;
    # a fixed-shape table's kernels are always traced.
    assert ("export_all" in written) == fixed_shapes
    entries = sorted(p.name for p in (cache / "kernels").iterdir())
    assert len(entries) == len(written)

    second, second_log = _run(tmp_path, str(cache), fixed_shapes)
    assert _kernel_lines(second_log, "traced and written") == []
    assert _kernel_lines(second_log, "loaded from") == written
    assert second == first
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == entries
    assert first["xla_flags"] == ""  # TensorFlow's own settings are left as they were
    assert sorted(p.name for p in cache.iterdir()) == ["kernels"]
    assert "Error parsing" not in second_log


# Big eager upserts: their races run as TensorFlow ops while XLA compiles them in the
# background, then compiled (``de_store.tables._xla``), the compiled function read from
# the cache or traced and written there.
BULK = textwrap.dedent(
    """
    import json, logging, sys
    import numpy as np
    import tensorflow as tf
    from de_store.tables import HashTable, _kernels, _xla

    _kernels.TRACE_AFTER_S = float("inf")  # the bulk calls run op by op, however long
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
    logging.getLogger("de_store").setLevel(logging.DEBUG)
    table = HashTable(key_dtype=tf.int64, dim=2, value_dtype=tf.float32)
    keys = np.arange(200_000, dtype=np.int64) * 7919 - 10**9
    values = np.stack([keys % 1000, keys % 7], axis=1).astype(np.float32)
    for part in (slice(0, 100_000), slice(100_000, None)):
        table.insert(tf.constant(keys[part]), tf.constant(values[part]))
        _xla.wait_for_compiles()  # the second batch races compiled
    found, exists = table.lookup(tf.constant(keys))
    print(json.dumps({
        "size": int(table.size()),
        "all_found": bool(np.all(exists.numpy())),
        "equal": bool(np.array_equal(found.numpy(), values)),
    }))
    """
)


def test_a_later_process_reads_the_compiled_races_instead_of_tracing_them(tmp_path):
    script = tmp_path / "bulk.py"
    script.write_text(BULK)
    env = {**os.environ, "DE_STORE_CACHE_DIR": str(tmp_path / "cache")}
    logs, results = [], []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        logs.append([line for line in done.stderr.splitlines() if "kernel compiled" in line])
    assert results[0] == results[1] == {"size": 200_000, "all_found": True, "equal": True}
    traced = sorted(line.split(" traced and written")[0] for line in logs[0])
    loaded = sorted(line.split(" loaded from ")[0] for line in logs[1])
    compiled = [  # the race of inserts, the first probes of lookups
        "kernel compiled de_store.tables._index._race_from [('serial', True)]",
        "kernel compiled de_store.tables._index.first_probes []",
    ]
    assert traced == loaded == compiled
    assert all(" loaded from " in line for line in logs[1])


def test_a_damaged_entry_is_traced_again_and_rewritten(tmp_path):
    cache = tmp_path / "cache"
    expected, _ = _run(tmp_path, str(cache))
    entries = sorted((cache / "kernels").iterdir())
    flipped = bytearray(entries[0].read_bytes())
    flipped[-10] ^= 0xFF  # in the functions: no longer their checksum
    entries[0].write_bytes(bytes(flipped))
    entries[1].write_bytes(b"not an entry")

    got, log = _run(tmp_path, str(cache))
    assert got == expected
    ignored = [line.split()[3] for line in log.splitlines() if " ignored: " in line]
    assert sorted(ignored) == [str(entries[0]), str(entries[1])]  # each read once
    assert len(_kernel_lines(log, "traced and written")) == 2

    again, log = _run(tmp_path, str(cache))  # the entries written anew serve
    assert again == expected
    assert _kernel_lines(log, "traced and written") == []


def test_a_users_xla_flags_are_left_as_they_are(tmp_path):
    script = tmp_path / "flags.py"
    script.write_text("import os, de_store, tensorflow as tf\nprint(os.environ['TF_XLA_FLAGS'])")
    env = {**os.environ, "TF_XLA_FLAGS": "--tf_xla_enable_lazy_compilation=false"}
    env["DE_STORE_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "--tf_xla_enable_lazy_compilation=false"


@pytest.mark.parametrize("setting", ["off", ""])
def test_off_writes_nothing(tmp_path, setting):
    got, log = _run(tmp_path, setting)
    assert "tf_xla_persistent_cache_directory" not in got["xla_flags"]
    assert _kernel_lines(log, "written") == []
    assert _kernel_lines(log, "loaded") == []
    assert list(tmp_path.iterdir()) == [tmp_path / "script.py"]


def test_kernels_give_a_function_they_both_call_one_name(tmp_path, monkeypatch):
    """A restore compiles the bulk load's first race ahead with ``compile_load``: XLA
    compiles a function per name, so both kernels must call it by the same name."""
    import tensorflow as tf
    from tensorflow.core.framework import function_pb2

    from de_store.tables import _kernel_cache
    from de_store.tables._kernels import Kernels
    from de_store.tables._types import Config

    monkeypatch.setenv("DE_STORE_CACHE_DIR", str(tmp_path))
    config = Config(
        dim=5, dtype=tf.float32, max_load_factor=0.75, row_growth=1.25, init_capacity=16
    )
    kernels = Kernels(config)
    names = {}
    for kernel in ("load_distinct", "compile_load", "lookup"):
        _kernel_cache.store(config, kernel, getattr(kernels, kernel).get_concrete_function())
        entry = tmp_path / "kernels" / f"{_kernel_cache._entry_key(config, kernel)}.kernel"
        library = function_pb2.FunctionDefLibrary.FromString(entry.read_bytes().split(b"\n", 1)[1])
        names[kernel] = {f.signature.name for f in library.function}
    shared = names["load_distinct"] & names["compile_load"]
    assert len(shared) == 1  # the compiled first race, called by both
    assert not shared & names["lookup"]  # lookups compile another function


def test_an_entry_that_cannot_be_written_leaves_nothing_behind(tmp_path, monkeypatch):
    """A cache directory that takes the temporary file but not the rename (a full disk, a
    vanished directory): the kernel is returned all the same, and no file stays."""
    import tensorflow as tf

    from de_store.tables import _kernel_cache
    from de_store.tables._kernels import Kernels
    from de_store.tables._types import Config

    monkeypatch.setenv("DE_STORE_CACHE_DIR", str(tmp_path))
    config = Config(
        dim=5, dtype=tf.float32, max_load_factor=0.75, row_growth=1.25, init_capacity=16
    )

    def refuse(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_kernel_cache.os, "replace", refuse)
    concrete = Kernels(config).size.get_concrete_function()
    assert _kernel_cache.store(config, "size", concrete) is not None
    assert list((tmp_path / "kernels").iterdir()) == []
