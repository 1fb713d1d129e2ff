"""What the benchmark scripts share: timing, cold reads, the benchmark rows, the raw
references, and figures passed between phases.

A script that runs phases in fresh processes prints each phase's figures as one line
``RESULT {json}`` (:func:`emit`) and reads them back from :func:`run_phase`. This module
imports numpy and the standard library only (and de_store's ``testing/page_cache.py``,
which does too, by its path): the TFRA side of ``tfra_bench.py`` imports it
under another interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

RESULT_TAG = "RESULT "
FILL_BATCH = 1 << 20
SEED = 1234
DROP_CACHES = "/proc/sys/vm/drop_caches"


def proc_status(*fields: str) -> dict[str, int]:
    """The ``fields`` of ``/proc/self/status`` that this kernel reports (``VmRSS``,
    ``VmHWM``, ``VmSize``, ...), in bytes (the file gives kB)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name = line.split(":", 1)[0]
            if name in fields:
                found[name] = int(line.split()[1]) * 1024
    return found


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _page_cache() -> Any:
    """``de_store/testing/page_cache.py``, loaded by its path: it imports the standard
    library only, and the TFRA side runs where de_store is not installed."""
    path = os.path.join(os.path.dirname(__file__), "..", "de_store", "testing", "page_cache.py")
    spec = importlib.util.spec_from_file_location("_de_store_page_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Evict a file, or every file under a folder, from the page cache (fsynced first), so
#: that the next read is cold.
drop_cache: Callable[[str], None] = _page_cache().evict


def cold_read_setup(root: str) -> str:
    """Make the next read of ``root`` cold; return how: ``"drop_caches"`` (the whole page
    cache dropped, as root) or ``"posix_fadvise"`` (each file under ``root`` evicted)."""
    drop_cache(root)
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
    except OSError:
        return "posix_fadvise"
    return "drop_caches"


def rows(keys: int, dim: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The benchmark's rows, in batches of ``FILL_BATCH``: unique int64 keys spread over the
    whole range, standard normal float32 values."""
    rng = np.random.default_rng(SEED)
    for start in range(0, keys, FILL_BATCH):
        n = min(FILL_BATCH, keys - start)
        ids = np.arange(start, start + n, dtype=np.int64)
        # an odd multiplier permutes int64: unique keys, no order, every bucket used
        batch_keys = ids * np.int64(-7046029254386353131)
        yield batch_keys, rng.standard_normal((n, dim), dtype=np.float32)


def sample_rows(keys: int, dim: int, count: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` rows of every batch, for verifying a restore (copies: a slice
    would keep its whole batch alive, gigabytes at 50M keys in the measured process)."""
    picked = [(k[:count].copy(), v[:count].copy()) for k, v in rows(keys, dim)]
    return np.concatenate([k for k, _ in picked]), np.concatenate([v for _, v in picked])


def raw_write(path: str, keys: int, dim: int) -> float:
    """Seconds to write the rows to ``path.keys`` and ``path.values`` with ``tofile`` and
    fsync them (making the rows is not timed).

    Each batch is made right before its write and the one before it freed: on this
    project's virtual machines the page cache takes those pages, just touched, for the
    next write, where a save in settled memory (:func:`settle_memory`) writes into memory
    the host has taken back (docs/benchmarks.md, *The cost curve*)."""
    seconds = 0.0
    with open(path + ".keys", "wb") as fk, open(path + ".values", "wb") as fv:
        for batch_keys, batch_values in rows(keys, dim):
            start = time.perf_counter()
            batch_keys.tofile(fk)
            batch_values.tofile(fv)
            seconds += time.perf_counter() - start
        start = time.perf_counter()
        for f in (fk, fv):
            f.flush()
            os.fsync(f.fileno())
        seconds += time.perf_counter() - start
    return seconds


def raw_direct_write(path: str, keys: int, dim: int) -> float:
    """Seconds to write the rows to ``path.keys`` and ``path.values`` straight to the disk
    (``O_DIRECT``, Linux) and fsync them (making the rows is not timed): each array of a
    batch copied into one page-aligned buffer, touched before the timing, and written with
    one ``pwrite``; the last padded to a page, the files cut back to their lengths. The
    plainest direct write of the bytes, as a save to a local folder writes them, with no
    page cache taking pages for them."""
    buffer = np.frombuffer(mmap.mmap(-1, FILL_BATCH * 4 * max(dim, 2)), np.uint8)
    buffer[:] = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fds = [os.open(path + suffix, flags, 0o644) for suffix in (".keys", ".values")]
    sizes, seconds = [0, 0], 0.0
    try:
        for batch in rows(keys, dim):
            start = time.perf_counter()
            for i, array in enumerate(batch):
                data = array.reshape(-1).view(np.uint8)
                if sizes[i] % _PAGE:
                    raise ValueError(
                        f"{path}: only the last batch may end off a {_PAGE}-byte page, "
                        f"but another batch followed {sizes[i]} bytes"
                    )
                end = -(-len(data) // _PAGE) * _PAGE
                buffer[: len(data)] = data
                buffer[len(data) : end] = 0
                pwrite_all(fds[i], buffer[:end], sizes[i], path)
                sizes[i] += len(data)
            seconds += time.perf_counter() - start
        start = time.perf_counter()
        for fd, size in zip(fds, sizes, strict=True):
            os.ftruncate(fd, size)
            os.fsync(fd)
        seconds += time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
    return seconds


def pwrite_all(fd: int, view: Any, offset: int, path: str) -> None:
    """Write all of ``view`` at ``offset`` of ``path``'s descriptor ``fd`` (a write that
    takes nothing is an error naming the file, not a loop without end)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if not n:
            raise OSError(f"{path}: the disk took none of {len(view) - done} bytes")
        done += n


class DirectWriter:
    """One file written straight to the disk (``O_DIRECT`` where the system has it) from
    ``buffer`` (page-aligned, a whole number of pages): bytes are copied in, each full
    buffer written with one ``pwrite``; :meth:`close` writes the rest padded to a page,
    cuts the file back to its length and fsyncs. A stream of any sizes, where
    :func:`raw_direct_write` writes whole batches."""

    def __init__(self, path: str, buffer: np.ndarray) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
        self.path = path
        self.fd = os.open(path, flags, 0o644)
        self.buffer, self.fill, self.size = buffer, 0, 0

    def write(self, data: Any) -> None:
        view = np.frombuffer(data, np.uint8)
        while len(view):
            n = min(len(view), len(self.buffer) - self.fill)
            self.buffer[self.fill : self.fill + n] = view[:n]
            self.fill, view = self.fill + n, view[n:]
            if self.fill == len(self.buffer):
                self._write_out(len(self.buffer))

    def _write_out(self, end: int) -> None:
        pwrite_all(self.fd, self.buffer[:end], self.size, self.path)
        self.size += self.fill
        self.fill = 0

    def close(self) -> None:
        try:
            if self.fill:
                end = -(-self.fill // _PAGE) * _PAGE
                self.buffer[self.fill : end] = 0
                self._write_out(end)
            os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def remove_raw(path: str) -> None:
    """Delete the files :func:`raw_write` wrote at ``path``."""
    for suffix in (".keys", ".values"):
        os.remove(path + suffix)


def bucket_reorder(keys: int, dim: int) -> float:
    """Seconds numpy and Arrow take to put the rows in key-bucket order, as a checkpoint
    shard holds them: each key's bucket (``key mod num_buckets``, de_store's bucket count
    for that many rows), Arrow's stable counting sort of the buckets, and one ``take`` of
    the keys and one of the values (making the rows is not timed). With ``raw_write``,
    the floor of a save that writes its rows grouped by bucket."""
    from de_store.checkpoint.buckets import (  # numpy and Arrow only
        choose_num_buckets,
        int_floormod,
        stable_order,
    )

    batches = list(rows(keys, dim))
    all_keys = np.concatenate([k for k, _ in batches])
    all_values = np.concatenate([v for _, v in batches])
    del batches
    start = time.perf_counter()
    buckets = int_floormod(all_keys, choose_num_buckets(keys))
    order = stable_order(buckets)
    np.take(all_keys, order)
    np.take(all_values, order, axis=0)
    return time.perf_counter() - start


def raw_read(path: str, dim: int) -> dict[str, Any]:
    """Read ``path.keys`` and ``path.values`` cold with ``numpy.fromfile``: ``raw_read_s``,
    the rows read and how the page cache was emptied (``raw_read_cold``)."""
    how = cold_read_setup(path + ".keys")
    drop_cache(path + ".values")
    start = time.perf_counter()
    keys = np.fromfile(path + ".keys", dtype=np.int64)
    values = np.fromfile(path + ".values", dtype=np.float32).reshape(-1, dim)
    seconds = time.perf_counter() - start
    if len(values) != len(keys):
        raise RuntimeError(f"{path}: {len(keys)} keys but {len(values)} value rows")
    return {"raw_read_s": seconds, "raw_rows": len(keys), "raw_read_cold": how}


def memory_first_touch(tf: Any, nbytes: int) -> float:
    """Seconds a plain TensorFlow op takes to allocate and first touch ``nbytes`` in this
    process (``tf.fill``): the floor this machine's memory sets any step that builds a
    table of that many bytes (on this virtual machine, memory the guest has not touched
    costs far more than memory it has)."""
    start = time.perf_counter()
    filled = tf.fill([max(nbytes // 8, 1)], tf.constant(1, tf.int64))
    filled[-1].numpy()  # wait for it
    seconds = time.perf_counter() - start
    del filled
    return seconds


#: Seconds :func:`settle_memory` waits: the guest kernel reports the memory freed before
#: it to the host 2 s after the free (``page_reporting``'s delay), then the host takes it.
SETTLE_WAIT_S = 4.0
#: Pages one ``process_vm_readv`` call of :func:`touch_mapped_pages` reads a byte of.
_TOUCH_BATCH = 1024
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: Bytes of address space one read of ``/proc/self/pagemap`` covers (8 MiB of entries).
_PAGEMAP_SPAN = _TOUCH_BATCH * 1024 * _PAGE
#: Mappings whose pages are not memory of the process's own.
_NOT_MEMORY = ("[vvar]", "[vvar_vclock]", "[vsyscall]")


def settle_memory(wait_s: float = SETTLE_WAIT_S) -> dict[str, float]:
    """Bring the process's memory to one state before a timed step: wait until the host
    has taken back what was freed before (:data:`SETTLE_WAIT_S`), then touch every page
    the process has mapped (:func:`touch_mapped_pages`).

    On this project's virtual machines, when the guest reports freed memory to the host
    (free page reporting), the next access to each page the process still holds costs
    far more than usual, once: a read of one value per page of a resident 1 GiB buffer
    took 32-260 ms in the seconds after files of gigabytes were deleted, 4-11 ms
    otherwise. A step timed right after such a free pays it on every page it touches
    (the block of an async save, 112-151 ms against 2.5-4 ms, for the same Python calls;
    docs/benchmarks.md, *Memory state*);
    a step timed after this call does not, as a step of a loop that ran since does not.
    Returns the pages touched and ``touch_ns_per_page``, which shows how far the memory
    was from that state: about 550 ns a page in a process whose pages were all touched
    lately, 590-1,700 ns in the cost curve's settlings on 2026-12-02."""
    time.sleep(wait_s)
    start = time.perf_counter()
    pages = touch_mapped_pages()
    seconds = time.perf_counter() - start
    return {"pages": pages, "touch_ns_per_page": seconds / max(pages, 1) * 1e9}


def touch_mapped_pages() -> int:
    """Read one byte of every page mapped into this process (present in its page table,
    ``/proc/self/pagemap``; readable, not the kernel's own), through ``process_vm_readv``
    on itself, which fails on a page unmapped meanwhile instead of faulting; return how
    many were read (0 where Linux's calls are not available). Only present pages are
    read: the process's RSS does not change."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not sys.platform.startswith("linux") or not hasattr(libc, "process_vm_readv"):
        return 0

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]

    read = libc.process_vm_readv
    read.restype = ctypes.c_ssize_t
    vector = ctypes.POINTER(IoVec)
    read.argtypes = [ctypes.c_int, vector, ctypes.c_ulong, vector, ctypes.c_ulong, ctypes.c_ulong]
    sink = (ctypes.c_uint8 * _TOUCH_BATCH)()
    local = (IoVec * _TOUCH_BATCH)(
        *[IoVec(ctypes.addressof(sink) + i, 1) for i in range(_TOUCH_BATCH)]
    )
    remote = (IoVec * _TOUCH_BATCH)()
    fields = np.frombuffer(remote, dtype=np.uint64).reshape(_TOUCH_BATCH, 2)
    fields[:, 1] = 1
    pid, touched = os.getpid(), 0
    for start in _present_pages():
        for at in range(0, start.size, _TOUCH_BATCH):
            batch = start[at : at + _TOUCH_BATCH]
            fields[: batch.size, 0] = batch
            touched += max(0, read(pid, local, batch.size, remote, batch.size, 0))
    return touched


def _present_pages() -> Iterator[np.ndarray]:
    """The addresses of the present pages of each readable mapping of this process."""
    with open("/proc/self/maps") as maps:
        ranges = [line.split() for line in maps]
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for fields in ranges:
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] in _NOT_MEMORY):
                continue
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            for first in range(low, high, _PAGEMAP_SPAN):
                count = (min(high, first + _PAGEMAP_SPAN) - first) // _PAGE
                pagemap.seek(first // _PAGE * 8)
                entries = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
                present = np.flatnonzero(entries >> np.uint64(63))
                if present.size:
                    yield first + present.astype(np.uint64) * np.uint64(_PAGE)


def dense_hash_table(tf: Any, keys: int, dim: int) -> Any:
    """TensorFlow's own open-addressing table (``DenseHashTable``) of int64 keys and
    float32 rows of ``dim``, sized for ``keys`` keys at a load of 0.8 at most."""
    return tf.lookup.experimental.DenseHashTable(
        tf.int64,
        tf.float32,
        tf.zeros([dim]),
        empty_key=-1,
        deleted_key=-2,
        initial_num_buckets=1 << int(np.ceil(np.log2(keys / 0.8))),
    )


def dense_index(tf: Any, keys: int, dim: int) -> float:
    """Seconds TensorFlow's own hash table takes to be created for the benchmark's rows
    and to insert them, in batches of ``FILL_BATCH`` (making the rows is not timed): the
    plainest way to index the keys a restore reads, next to the read of their bytes."""
    start = time.perf_counter()
    table = dense_hash_table(tf, keys, dim)
    seconds = time.perf_counter() - start
    for batch_keys, batch_values in rows(keys, dim):
        batch = tf.constant(batch_keys), tf.constant(batch_values)
        start = time.perf_counter()
        table.insert(*batch)
        seconds += time.perf_counter() - start
    if int(table.size()) != keys:
        raise AssertionError(f"DenseHashTable holds {int(table.size())} keys, not {keys}")
    return seconds


def plain_restore(tf: Any, path: str, dim: int) -> dict[str, Any]:
    """The plainest restore of the rows :func:`raw_write` wrote at ``path``: a thread reads
    ``path.keys`` and ``path.values`` cold with ``numpy.fromfile``, ``FILL_BATCH`` rows at a
    time, while this one inserts each batch into a ``DenseHashTable`` sized ahead, as it
    comes (at most two batches read ahead). On a machine of few cores the two compete for
    them: the floor a restore that overlaps its reading and its indexing meets there.
    ``plain_restore_s``, from the table's creation to the last insert done."""
    import queue
    import threading

    how = cold_read_setup(path + ".keys")
    drop_cache(path + ".values")
    keys = os.path.getsize(path + ".keys") // 8
    ready: queue.Queue[tuple[np.ndarray, np.ndarray] | BaseException | None] = queue.Queue(2)

    def read() -> None:
        try:
            with open(path + ".keys", "rb") as key_file, open(path + ".values", "rb") as values:
                for start in range(0, keys, FILL_BATCH):
                    n = min(FILL_BATCH, keys - start)
                    batch_keys = np.fromfile(key_file, np.int64, n)
                    batch_values = np.fromfile(values, np.float32, n * dim).reshape(n, dim)
                    ready.put((batch_keys, batch_values))
            ready.put(None)
        except BaseException as error:  # handed to the inserting thread
            ready.put(error)

    start = time.perf_counter()
    table = dense_hash_table(tf, keys, dim)
    reader = threading.Thread(target=read, name="plain-restore-read", daemon=True)
    reader.start()
    while (item := ready.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        table.insert(tf.constant(item[0]), tf.constant(item[1]))
    held = int(table.size())  # every insert done
    seconds = time.perf_counter() - start
    reader.join()
    if held != keys:
        raise AssertionError(f"DenseHashTable holds {held} keys, not {keys}")
    return {"plain_restore_s": seconds, "plain_restore_cold": how}


def dense_fill(tf: Any, keys: int, dim: int) -> float:
    """Seconds TensorFlow's own hash table (``DenseHashTable``), created empty with its
    default buckets, takes to insert the benchmark's rows in batches of ``FILL_BATCH``,
    growing as they come (it doubles its buckets past a load of 0.8): the plainest growing
    fill of the same rows, its memory from the same allocator (making the rows is not
    timed)."""
    table = tf.lookup.experimental.DenseHashTable(
        tf.int64, tf.float32, tf.zeros([dim]), empty_key=-1, deleted_key=-2
    )
    seconds = 0.0
    for batch_keys, batch_values in rows(keys, dim):
        batch = tf.constant(batch_keys), tf.constant(batch_values)
        start = time.perf_counter()
        table.insert(*batch)
        seconds += time.perf_counter() - start
    start = time.perf_counter()
    held = int(table.size())  # every insert done
    seconds += time.perf_counter() - start
    if held != keys:
        raise AssertionError(f"DenseHashTable holds {held} keys, not {keys}")
    return seconds


def plain_growth(tf: Any, keys: int, dim: int, after: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds the plainest growing store takes to take the benchmark's rows in batches of
    ``FILL_BATCH``: one variable of values ``[capacity, dim]`` and one of keys, their
    capacity doubled whenever a batch does not fit (a new store left unwritten, the rows in
    use copied into it, the old store dropped), each batch written after the rows before
    it. No index: what it holds past its rows is what its growths leave in TensorFlow's CPU
    allocator, the floor of any table that keeps its rows in one growing buffer (making
    the rows is not timed), and what ``after()`` returns, called with the stores filled.
    """
    stores = [
        tf.Variable(tf.zeros([0, dim], tf.float32), shape=tf.TensorShape([None, dim])),
        tf.Variable(tf.zeros([0], tf.int64), shape=tf.TensorShape([None])),
    ]

    def regrow(store: Any, used: int, capacity: int) -> None:
        # No copy of the old store on its read, none of the new one on its assign: a
        # variable a scatter touched copies every value read from or assigned to it.
        tf.raw_ops.DisableCopyOnRead(resource=store.handle)
        old = store.read_value()
        shape = [capacity, *store.shape[1:]]
        store.assign(tf.raw_ops.Empty(shape=shape, dtype=store.dtype))
        if used:
            store.scatter_update(tf.IndexedSlices(old[:used], tf.range(used)))

    used = capacity = 0
    seconds = 0.0
    for batch_keys, batch_values in rows(keys, dim):
        batch = tf.constant(batch_values), tf.constant(batch_keys)
        start = time.perf_counter()
        n = len(batch_keys)
        if used + n > capacity:
            capacity = max(2 * capacity, used + n)
            for store in stores:
                regrow(store, used, capacity)
        at = tf.range(used, used + n)
        for store, part in zip(stores, batch, strict=True):
            store.scatter_update(tf.IndexedSlices(part, at))
        used += n
        seconds += time.perf_counter() - start
    start = time.perf_counter()
    stores[1][used - 1].numpy()  # every write done
    return seconds + time.perf_counter() - start, after()


def emit(result: dict[str, Any]) -> None:
    """Print a phase's figures for the parent process."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_phase(
    script: str,
    phase: str,
    options: list[str],
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``script --phase phase *options`` in a fresh process of interpreter ``python``,
    with ``env`` added to the environment; return the figures it printed (its output and an
    error if it failed)."""
    command = [python, os.path.abspath(script), "--phase", phase, *options]
    environment = {**os.environ, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    return _result_of(done, phase)


def _result_of(done: subprocess.CompletedProcess[str], phase: str) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"phase {phase!r} failed with exit status {done.returncode}")
    return dict(json.loads(lines[-1][len(RESULT_TAG) :]))
