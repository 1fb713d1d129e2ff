"""Key buckets: how a shard's rows are grouped so a restoring rank reads only its share.

``bucket = floormod(hash(key), num_buckets)``, where ``hash`` is the key itself for integers
and TF's fast string fingerprint for strings: the hash of ``default_partition_fn``.
``num_buckets`` is a highly composite number with a large power of two, so for the usual
process counts ``M`` (dividing it) rank ``r`` of ``M`` needs exactly the buckets ``b`` with
``b mod M == r``; in general the buckets with ``b mod g == r mod g``, ``g = gcd(M,
num_buckets)``: a share ``1/g`` of every shard.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

#: Candidate bucket counts, largest first; each divides the next larger one.
_BUCKET_COUNTS = (5040, 720, 240, 48, 24, 12, 4, 2, 1)
#: Fewest rows a bucket should hold on average before a larger count is chosen.
MIN_ROWS_PER_BUCKET = 2048


def choose_num_buckets(rows: int) -> int:
    """The largest candidate count that leaves buckets of MIN_ROWS_PER_BUCKET rows or more."""
    for count in _BUCKET_COUNTS:
        if rows >= count * MIN_ROWS_PER_BUCKET:
            return count
    return 1


def key_hash_mod(keys: np.ndarray, modulus: int, key_dtype: str) -> np.ndarray:
    """``floormod(hash(key), modulus)`` as int64, the same hash as ``default_partition_fn``."""
    if key_dtype == "string":
        import tensorflow as tf

        return tf.strings.to_hash_bucket_fast(keys, modulus).numpy()
    return np.mod(keys.astype(np.int64, copy=False), modulus)


def bucket_order(buckets: np.ndarray, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """The row order that groups rows by bucket (stable), and the rows of each bucket."""
    small = narrowed(buckets, num_buckets)
    return np.argsort(small, kind="stable"), np.bincount(small, minlength=num_buckets)


def narrowed(buckets: np.ndarray, num_buckets: int) -> np.ndarray:
    """``buckets`` as the narrowest integers that hold ``num_buckets`` values: numpy
    radix-sorts 16-bit integers (``kind="stable"``), about 10x faster than int64."""
    return buckets.astype(np.int16 if num_buckets <= 1 << 15 else np.int32)


class BucketOrder:
    """The rows of a shard in bucket order (stable), sorted out a range of buckets at a
    time, one range ahead in a helper thread.

    The bucket of every key and the row count of every bucket are computed at once; the
    order of the rows of each of :data:`GROUPS` bucket ranges is sorted when the writer
    nears it, so a writer starts writing the first buckets after one pass over the keys
    instead of after a sort of all of them, and the rest are sorted while it writes.
    """

    #: Bucket ranges sorted one at a time (each about ``1 / GROUPS`` of the rows).
    GROUPS = 8

    def __init__(self, keys: np.ndarray, key_dtype: str) -> None:
        self.num_buckets = choose_num_buckets(len(keys))
        hashed = key_hash_mod(keys, self.num_buckets, key_dtype)
        self.buckets = narrowed(hashed, self.num_buckets)
        self.counts = np.bincount(self.buckets, minlength=self.num_buckets)
        self.ends = np.cumsum(self.counts)
        self._groups = bucket_ranges(self.ends, max(1, -(-len(keys) // self.GROUPS)))
        self._lock = threading.Lock()
        self._sorted: dict[int, Future[np.ndarray]] = {}

    def start(self, bucket: int) -> int:
        """The position of bucket ``bucket``'s first row in bucket order."""
        return int(self.ends[bucket] - self.counts[bucket])

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """``[first, last)`` bucket ranges of about ``rows`` rows each (whole buckets,
        none across two sorting groups) that cover every row."""
        starts = {a for a, _ in self._groups} | {a for a, _ in bucket_ranges(self.ends, rows)}
        edges = sorted(starts | {self.num_buckets})
        return [(a, b) for a, b in itertools.pairwise(edges) if self.ends[b - 1] > self.start(a)]

    def rows(self, first: int, last: int) -> np.ndarray:
        """Positions of the rows of buckets ``[first, last)`` in bucket order (a range
        from :meth:`chunks`; ranges asked for in order)."""
        at = next(i for i, (low, high) in enumerate(self._groups) if low <= first < high)
        with self._lock:
            for group in (at, at + 1)[: len(self._groups) - at]:  # this one, the next ahead
                if group not in self._sorted:
                    self._sorted[group] = _SORTER.submit(self._sort, *self._groups[group])
            for done in [g for g in self._sorted if g < at]:
                del self._sorted[done]
            sorted_rows = self._sorted[at]
        base = self.start(self._groups[at][0])
        return sorted_rows.result()[self.start(first) - base : int(self.ends[last - 1]) - base]

    def _sort(self, low: int, high: int) -> np.ndarray:
        chosen = np.flatnonzero((self.buckets >= low) & (self.buckets < high))
        return chosen[np.argsort(self.buckets[chosen], kind="stable")]


#: Sorts :class:`BucketOrder` groups ahead (numpy's sort releases the GIL).
_SORTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="de_store-bucket-sort")


def bucket_ranges(ends: np.ndarray, rows: int) -> list[tuple[int, int]]:
    """``[first, last)`` bucket ranges of about ``rows`` rows each (whole buckets), that
    cover every bucket; ``ends`` is the cumulative row count of the buckets."""
    crossing = np.searchsorted(ends, np.arange(rows, int(ends[-1]), rows))
    edges = np.unique(np.concatenate([[0], crossing + 1, [len(ends)]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]
