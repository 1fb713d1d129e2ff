"""The pages of the buffers TensorFlow's CPU allocator (oneDNN's BFC) holds free are handed
back to the system after a table's growth, and nothing held is touched.

Each test runs in a fresh process: BFC's pool then holds only what the test put there,
and the allocator is chosen before TensorFlow is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20

PRELUDE = """
import json
import numpy as np
import tensorflow as tf
from de_store import _memory
from de_store.tables._variables import read_shared

address = _memory.buffer_address

def resident_bytes(start, size):
    first, last = _memory.whole_pages(start, size)
    return _memory.resident_bytes(first, last - first)

def huge_bytes_around(start):
    # AnonHugePages of the mapping holding ``start`` (/proc/self/smaps, in kB)
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                found = low <= start < high
            elif found and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0
"""


def run_child(code: str, **env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def test_a_freed_buffers_pages_go_back_and_live_buffers_keep_their_bytes():
    out = run_child(
        """
        size = 96 << 20
        freed = tf.fill([size // 4], 1.5)
        kept = tf.fill([size // 4], 2.5)
        assert _memory.cpu_bytes_in_use() >= 2 * size  # BFC counts them
        start = address(freed)
        before = resident_bytes(start, size)
        del freed
        released = _memory.release_free_chunks([(start, size)], [(address(kept), size)])
        print(json.dumps({
            "before": before, "after": resident_bytes(start, size), "released": released,
            "kept_intact": bool(tf.reduce_all(kept == 2.5)),
        }))
        """
    )
    assert out["before"] >= 95 * MIB
    assert out["after"] == 0
    assert out["released"] >= 95 * MIB
    assert out["kept_intact"]


def test_a_growing_table_hands_back_the_store_it_replaced_and_keeps_every_row():
    out = run_child(
        """
        from de_store.tables import HashTable
        table = HashTable(tf.int64, tf.float32, 16, name="grown")
        batch = 1 << 18
        def rows(keys):
            return tf.cast(tf.tile(keys[:, None], [1, 16]), tf.float32) * 0.5
        count, old = 0, None
        while True:
            keys = tf.range(count, count + batch, dtype=tf.int64)
            length = int(tf.shape(table.values)[0])
            store = read_shared(table.values)
            start, size = address(store), int(store.shape[0]) * 64
            del store
            table.insert(keys, rows(keys))
            count += batch
            if int(tf.shape(table.values)[0]) != length and size >= 64 << 20:
                old = (start, size)
                break
        after = resident_bytes(*old)
        keys = tf.range(count, dtype=tf.int64)
        found, exists = table.lookup(keys)
        print(json.dumps({
            "old_store": old[1], "resident_after": after, "keys": count,
            "all_found": bool(tf.reduce_all(exists)),
            "rows_equal": bool(tf.reduce_all(found == rows(keys))),
        }))
        """
    )
    assert out["old_store"] >= 64 * MIB
    # the replaced store's pages went, but for what later allocations took again
    assert out["resident_after"] <= out["old_store"] // 4
    assert out["all_found"] and out["rows_equal"]


def test_a_growth_hands_back_its_replaced_store_while_an_xla_compile_takes_memory():
    # XLA's compiling thread makes a stand-in index (512 MiB, unwritten) in the middle of
    # a growth and holds it past it: between the two counts of the allocator's memory in
    # use that tell the growing call whether the store it replaced went back to the pool.
    out = run_child(
        """
        import threading
        from de_store.tables import HashTable, _index, _kernels, _xla
        armed, made, checked = threading.Event(), threading.Event(), threading.Event()
        real_cached, real_release = _xla._as_cached, _kernels.release_freed_memory
        real_check = _kernels._release_replaced
        def as_cached(function):
            compiled = real_cached(function)
            if not threading.current_thread().name.startswith("de_store-xla"):
                return compiled
            def call(handle, *args):  # the stand-in made, held until the count is read
                if int(tf.raw_ops.VariableShape(input=handle)[0]) == 1 << 25:
                    made.set()
                    checked.wait(120)
                return compiled(handle, *args)
            return call
        def release(*args, **kwargs):  # right after the growth, before its second count
            if armed.is_set() and not made.is_set():
                _xla.prepare_at(_index.race_from[True], table.index, 1 << 25,
                                *_index.load_race_args())
                made.wait(120)
            return real_release(*args, **kwargs)
        def check(*args):
            try:
                return real_check(*args)
            finally:
                checked.set()
        _xla._as_cached, _kernels.release_freed_memory = as_cached, release
        _kernels._release_replaced = check

        table = HashTable(tf.int64, tf.float32, 16, name="grown")
        batch = 1 << 18
        def rows(keys):
            return tf.cast(tf.tile(keys[:, None], [1, 16]), tf.float32) * 0.5
        count, old = 0, None
        while old is None:
            keys = tf.range(count, count + batch, dtype=tf.int64)
            length = int(tf.shape(table.values)[0])
            store = read_shared(table.values)
            start, size = address(store), int(store.shape[0]) * 64
            del store
            if size >= 64 << 20:
                armed.set()
            table.insert(keys, rows(keys))
            count += batch
            if int(tf.shape(table.values)[0]) != length and armed.is_set():
                old = (start, size)
        after = resident_bytes(*old)
        checked.set()
        _xla.wait_for_compiles()
        keys = tf.range(count, dtype=tf.int64)
        found, exists = table.lookup(keys)
        print(json.dumps({
            "old_store": old[1], "resident_after": after, "stand_in_made": made.is_set(),
            "all_found": bool(tf.reduce_all(exists)),
            "rows_equal": bool(tf.reduce_all(found == rows(keys))),
        }))
        """
    )
    assert out["stand_in_made"]
    assert out["old_store"] >= 64 * MIB
    assert out["resident_after"] <= out["old_store"] // 4
    assert out["all_found"] and out["rows_equal"]


def test_a_store_held_elsewhere_through_a_growth_keeps_its_pages_and_bytes():
    out = run_child(
        """
        from de_store.tables import HashTable
        table = HashTable(tf.int64, tf.float32, 16, name="held")
        batch = 1 << 18
        count = 0
        while True:
            keys = tf.range(count, count + batch, dtype=tf.int64)
            length = int(tf.shape(table.values)[0])
            held = read_shared(table.values)  # as a save's snapshot holds it
            copy = held.numpy().copy()
            table.insert(keys, tf.ones([batch, 16]))
            count += batch
            if int(tf.shape(table.values)[0]) != length and copy.nbytes >= 64 << 20:
                break
            del held
        size = copy.nbytes
        print(json.dumps({
            "size": size, "resident": resident_bytes(address(held), size),
            "intact": bool(np.array_equal(held.numpy(), copy)),
        }))
        """
    )
    assert out["resident"] >= out["size"] - 2 * MIB
    assert out["intact"]


def test_with_the_system_allocator_nothing_is_counted_and_nothing_taken():
    out = run_child(
        """
        kept = tf.fill([1 << 24], 2.5)
        print(json.dumps({"in_use": _memory.cpu_bytes_in_use()}))
        """,
        TF_ONEDNN_USE_SYSTEM_ALLOCATOR="1",
    )
    assert out["in_use"] is None


# --- huge pages for a table's index ---------------------------------------------------------


def _huge_pages_possible() -> bool:
    """Whether this kernel collapses memory into huge pages on request (Linux 6.1 and
    later, transparent huge pages not switched off)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            if "[never]" in setting.read():
                return False
    except OSError:
        return False
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 1)


needs_huge_pages = pytest.mark.skipif(
    not _huge_pages_possible(), reason="needs MADV_COLLAPSE (Linux 6.1+, THP not 'never')"
)


@needs_huge_pages
def test_a_written_buffer_goes_on_huge_pages_with_its_bytes_unchanged():
    out = run_child(
        """
        values = tf.range(6 << 20, dtype=tf.int64) * 3  # 48 MiB, every page written
        expected = values.numpy().copy()
        start, size = address(values), 48 << 20
        spans = ((start + size) // (2 << 20) - -(-start // (2 << 20))) * (2 << 20)
        before = resident_bytes(start, size)
        collapsed = _memory.collapse_huge_pages(values)
        print(json.dumps({
            "spans": spans, "collapsed": collapsed, "huge": huge_bytes_around(start),
            "resident": resident_bytes(start, size), "before": before,
            "intact": bool(np.array_equal(values.numpy(), expected)),
        }))
        """
    )
    assert out["collapsed"] == out["spans"] >= 44 * MIB
    assert out["huge"] >= out["collapsed"]
    assert out["resident"] == out["before"] >= 47 * MIB  # no page added, none lost
    assert out["intact"]


@needs_huge_pages
def test_a_table_reserved_for_millions_of_keys_has_its_index_on_huge_pages():
    out = run_child(
        """
        from de_store.tables import HashTable
        from de_store.tables.hash_table import HUGE_INDEX_MIN_KEYS
        def rows(keys):
            return tf.cast(tf.tile(keys[:, None], [1, 4]), tf.float32) * 0.5
        table = HashTable(tf.int64, tf.float32, 4, name="big")
        table.reserve(HUGE_INDEX_MIN_KEYS)
        index = read_shared(table.index)
        start, size = address(index), int(tf.size(index)) * 8
        del index
        keys = tf.range(HUGE_INDEX_MIN_KEYS, dtype=tf.int64) * 7919
        table.insert(keys, rows(keys))
        found, exists = table.lookup(keys)
        print(json.dumps({
            "index": size, "huge": huge_bytes_around(start),
            "all_found": bool(tf.reduce_all(exists)),
            "rows_equal": bool(tf.reduce_all(found == rows(keys))),
        }))
        """
    )
    assert out["index"] >= 64 * MIB
    assert out["huge"] >= out["index"] - 4 * MIB
    assert out["all_found"] and out["rows_equal"]
