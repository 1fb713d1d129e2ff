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

import numpy as np

#: Candidate bucket counts, largest first; each divides the next larger one.
_BUCKET_COUNTS = (5040, 720, 240, 48, 24, 12, 4, 2, 1)
#: Fewest rows a bucket should hold on average before a larger count is chosen: a bucket
#: is written as one part (or more), and each part costs a row group, a manifest record
#: and a read of its own, so parts of 16Ki rows or more (1 MiB at 16 float32) keep that
#: cost small next to the part's bytes.
MIN_ROWS_PER_BUCKET = 16384
#: Arrow sorts integers spanning at most this many values by counting; wider ones by
#: comparison, several times slower (docs/benchmarks.md, Costs behind the code).
COUNTING_SORT_RANGE = 4096


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
    return int_floormod(keys.astype(np.int64, copy=False), modulus)


def int_floormod(values: np.ndarray, modulus: int) -> np.ndarray:
    """``np.mod(values, modulus)`` of int64 ``values``, by numpy's floor division (which
    divides by a scalar with multiplications, faster than its remainder loop).

    ``values - quotient * modulus`` may wrap around in between (``-2**63`` by 720), but
    int64 arithmetic wraps modulo ``2**64`` and the result lies in ``[0, modulus)``, so
    it is exact for every int64.
    """
    product = np.floor_divide(values, modulus)
    product *= modulus
    return np.subtract(values, product, out=product)


def bucket_order(buckets: np.ndarray, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """The row order that groups rows by bucket (stable), and the rows of each bucket."""
    return stable_order(buckets), np.bincount(buckets, minlength=num_buckets)


def stable_order(buckets: np.ndarray) -> np.ndarray:
    """The stable sort order of ``buckets``, non-negative ids (int64 positions).

    Arrow's counting sort for ids below ``COUNTING_SORT_RANGE`` (faster than numpy's
    radix sort of the same ids as 16-bit integers); numpy's radix sort for wider ones
    (5040 buckets), which Arrow would sort by comparison (docs/benchmarks.md).
    """
    top = int(buckets.max()) if len(buckets) else 0
    if top < COUNTING_SORT_RANGE:
        return _counting_order(buckets)
    narrow = np.uint16 if top <= np.iinfo(np.uint16).max else np.int64
    return np.argsort(buckets.astype(narrow), kind="stable")


def _counting_order(ids: np.ndarray) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    # Arrow's uint64 positions, read as int64 in place (no copy of 8 bytes a row)
    return pc.array_sort_indices(pa.array(ids)).to_numpy().view(np.int64)


class BucketOrder:
    """The rows of a shard in bucket order (stable), taken a range of buckets at a time.

    The bucket of every key, the row count of every bucket and the order of all rows are
    computed at once (one pass over the keys and one counting sort).
    """

    def __init__(self, keys: np.ndarray, key_dtype: str) -> None:
        self.num_buckets = choose_num_buckets(len(keys))
        buckets = key_hash_mod(keys, self.num_buckets, key_dtype)
        self.order, self.counts = bucket_order(buckets, self.num_buckets)
        self.ends = np.cumsum(self.counts)

    def start(self, bucket: int) -> int:
        """The position of bucket ``bucket``'s first row in bucket order."""
        return int(self.ends[bucket] - self.counts[bucket])

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """``[first, last)`` bucket ranges of about ``rows`` rows each (whole buckets)
        that cover every row."""
        return [
            (a, b) for a, b in bucket_ranges(self.ends, rows) if self.ends[b - 1] > self.start(a)
        ]

    def rows(self, first: int, last: int) -> np.ndarray:
        """Positions of the rows of buckets ``[first, last)`` in bucket order."""
        return self.order[self.start(first) : int(self.ends[last - 1])]


def bucket_ranges(ends: np.ndarray, rows: int) -> list[tuple[int, int]]:
    """``[first, last)`` bucket ranges of about ``rows`` rows each (whole buckets), that
    cover every bucket; ``ends`` is the cumulative row count of the buckets."""
    crossing = np.searchsorted(ends, np.arange(rows, int(ends[-1]), rows))
    edges = np.unique(np.concatenate([[0], crossing + 1, [len(ends)]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]
