"""The checks a restore and ``de-store verify`` share, so that they refuse the same data.

Three kinds, all on what is read anyway (no extra request, O(rows) numpy work):

* :func:`entry_problems`: a variable's shard records against the manifest, before any
  read: every rank of ``proc_size`` and every shard as counted is there, once; each record's
  ``part_buckets`` names one bucket below ``num_buckets`` per part; every part's byte range
  lies inside its file as recorded (the formats check the file's actual size against that
  record before reading, so no range read can pass the end of a file).
* :class:`PartBuckets`: the rows of each part read, as they come: no null key, and every
  key hashes to the bucket the manifest names for its part (a mislabelled part would be
  read by the wrong rank of a restore, and its keys lost).
* :func:`repeated_key`: a key held by two shards (or twice by one) of one checkpoint; a
  restore looks for it when loading its rows finds a key repeated, verify over every row.

Each problem names the file (or the manifest) it is about.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from de_store.backends.base import Backend
from de_store.errors import CheckpointCorruptError, DeStoreError
from de_store.formats import ShardInfo, get_format
from de_store.formats.batches import batch_to_numpy
from de_store.saver.buckets import key_hash_mod
from de_store.saver.commit import latest_generation, manifest_name
from de_store.saver.manifest import ShardRecord, VariableEntry

#: Stands for the manifest's file name in problems until one is found (see link_problems).
_MANIFEST = "manifest"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file (or the manifest) and what is wrong."""

    path: str
    message: str


def raise_first(problems: Sequence[Problem], where: str) -> None:
    """Raise :class:`CheckpointCorruptError` for the first of ``problems`` (if any).

    ``where`` names the checkpoint; the message names the file and how many more problems
    there are (``de-store verify`` lists them all).
    """
    if not problems:
        return
    first = problems[0]
    more = f" (and {len(problems) - 1} more problem(s): de-store verify lists them)"
    raise CheckpointCorruptError(
        f"checkpoint {where} is damaged: {first.path}: {first.message}"
        + (more if len(problems) > 1 else "")
    )


# --- shard records ------------------------------------------------------------------------
def link_problems(
    backend: Backend, folder: str, proc_size: int, entries: Iterable[VariableEntry]
) -> list[Problem]:
    """What is wrong with the shard records of ``entries``, all of the committed checkpoint
    ``folder`` under ``backend`` (saved by ``proc_size`` ranks); problems of the manifest
    itself name its file (looked up only when there are some)."""
    problems = [p for entry in entries for p in entry_problems(entry, proc_size, _MANIFEST)]
    if not problems:
        return []
    base = backend.url.rstrip("/")
    manifest = f"{base}/{backend.join(folder, manifest_name(latest_generation(backend, folder)))}"
    return [
        dataclasses.replace(p, path=manifest if p.path == _MANIFEST else f"{base}/"
                            f"{backend.join(folder, p.path)}")
        for p in problems
    ]  # fmt: skip


def entry_problems(entry: VariableEntry, proc_size: int, manifest: str) -> list[Problem]:
    """What is wrong with ``entry``'s shard records (``manifest`` names the manifest file)."""
    problems = _rank_problems(entry, proc_size, manifest)
    for record in [*entry.shards, *entry.removed]:
        problems += record_problems(record, entry.name)
    return problems


def _rank_problems(entry: VariableEntry, proc_size: int, manifest: str) -> list[Problem]:
    def problem(message: str) -> Problem:
        return Problem(manifest, f"variable {entry.name!r}: {message}")

    problems = []
    ranks = [record.rank for record in entry.shards]
    missing = sorted(set(range(proc_size)) - set(ranks))
    if missing:
        problems.append(problem(f"no shards of rank(s) {missing} (proc_size is {proc_size})"))
    outside = sorted({r for r in ranks if not (isinstance(r, int) and 0 <= r < proc_size)})
    if outside:
        problems.append(problem(f"shards of rank(s) {outside}, outside 0..{proc_size - 1}"))
    if entry.shard_count != len(entry.shards):
        problems.append(
            problem(f"shard_count is {entry.shard_count}, found {len(entry.shards)} records")
        )
    paths = [record.path for record in [*entry.shards, *entry.removed]]
    repeated = sorted(path for path, n in collections.Counter(paths).items() if n > 1)
    if repeated:
        problems.append(problem(f"shard file(s) {repeated} recorded more than once"))
    return problems


def record_problems(record: ShardRecord, variable: str) -> list[Problem]:
    """What is wrong with one shard record: its parts' buckets and byte ranges."""
    try:
        return _bucket_problems(record) + _range_problems(record.info)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        path = record.info.get("path") if isinstance(record.info, dict) else None
        return [Problem(str(path or f"a shard of {variable!r}"), f"record is not valid ({err!r})")]


def _bucket_problems(record: ShardRecord) -> list[Problem]:
    parts, buckets = len(record.info["parts"]), record.part_buckets
    count = record.num_buckets
    if not isinstance(count, int) or count < 1:
        return [Problem(record.path, f"num_buckets must be a positive integer, found {count!r}")]
    if not isinstance(buckets, list) or len(buckets) != parts:
        found = len(buckets) if isinstance(buckets, list) else repr(buckets)
        return [Problem(record.path, f"part_buckets must name one bucket for each of the "
                                     f"{parts} parts, found {found}")]  # fmt: skip
    bad = [b for b in buckets if not (isinstance(b, int) and 0 <= b < count)]
    if bad:
        return [Problem(record.path, f"part_buckets {bad[:5]} are not buckets of 0.."
                                     f"{count - 1} (num_buckets {count})")]  # fmt: skip
    return []


def _range_problems(info: dict[str, Any]) -> list[Problem]:
    """Every part's byte range must lie inside its file as recorded."""
    files = info["files"]
    for file in files:
        if not (isinstance(file["bytes"], int) and file["bytes"] >= 0):
            return [Problem(str(file["path"]), f"recorded size {file['bytes']!r} is not a "
                                               "byte count")]  # fmt: skip
    for index, part in enumerate(info["parts"]):
        ranges = part["ranges"]
        if len(ranges) != len(files):
            return [Problem(str(info["path"]), f"part {index} has {len(ranges)} byte ranges "
                                               f"for {len(files)} files")]  # fmt: skip
        for file, span in zip(files, ranges, strict=True):
            offset, length = span["offset"], span["length"]
            if not (isinstance(offset, int) and isinstance(length, int)):
                raise TypeError(f"part {index}: offset and length must be integers")
            if offset < 0 or length < 0 or offset + length > file["bytes"]:
                return [Problem(str(file["path"]), f"part {index}'s byte range [{offset}, "
                                f"{offset + length}) is outside the file's {file['bytes']} "
                                "bytes")]  # fmt: skip
    return []


# --- rows of the parts read -----------------------------------------------------------------
class PartBuckets:
    """Checks the rows read from some parts of one shard, batch by batch, in read order.

    Each key must be non-null and hash to its part's bucket (``part_buckets``). With
    ``proc_size`` > 1, :meth:`check` also returns each row's rank (``hash mod proc_size``),
    from the same hash.
    """

    def __init__(self, record: ShardRecord, parts: Sequence[int], key_dtype: str,
                 proc_size: int = 1) -> None:  # fmt: skip
        self.path = record.path
        self.key_dtype = key_dtype
        self.num_buckets = record.num_buckets
        self.proc_size = proc_size
        self.modulus = math.lcm(record.num_buckets, proc_size)
        rows = [int(record.info["parts"][i]["rows"]) for i in parts]
        self.parts = list(parts)
        self.ends = np.cumsum(rows, dtype=np.int64)
        self.buckets = np.asarray([record.part_buckets[i] for i in parts], np.int64)
        self.done = 0

    def check_nulls(self, batch: pa.RecordBatch) -> None:
        """No null key or value (a shard written by another tool may hold some)."""
        for name, column in zip(batch.schema.names, batch.columns, strict=True):
            nulls = column.null_count
            if pa.types.is_fixed_size_list(column.type):
                nulls += column.flatten().null_count
            if nulls:
                raise CheckpointCorruptError(
                    f"{self.path}: column {name!r} holds {nulls} null value(s); keys and "
                    "values of a checkpoint are never null"
                )

    def check(self, keys: np.ndarray) -> np.ndarray | None:
        """Check the next ``len(keys)`` keys; their ranks when ``proc_size`` > 1."""
        start, self.done = self.done, self.done + len(keys)
        if self.modulus == 1:
            return None
        hashed = key_hash_mod(keys, self.modulus, self.key_dtype)
        if self.num_buckets > 1:
            self._check_buckets(self._mod(hashed, self.num_buckets), start)
        return self._mod(hashed, self.proc_size) if self.proc_size > 1 else None

    def _mod(self, hashed: np.ndarray, modulus: int) -> np.ndarray:
        return hashed if modulus == self.modulus else hashed % modulus

    def _check_buckets(self, buckets: np.ndarray, start: int) -> None:
        index = int(np.searchsorted(self.ends, start, side="right"))
        position = 0
        while position < len(buckets):
            stop = min(len(buckets), int(self.ends[index]) - start)
            wrong = np.flatnonzero(buckets[position:stop] != self.buckets[index])
            if len(wrong):
                found = int(buckets[position + wrong[0]])
                raise CheckpointCorruptError(
                    f"{self.path}: part {self.parts[index]} is recorded as key bucket "
                    f"{int(self.buckets[index])} of {self.num_buckets}, but holds "
                    f"{len(wrong)} key(s) of other buckets (first: bucket {found}); the "
                    "manifest's part_buckets do not match the keys"
                )
            position, index = stop, index + 1


def read_checked(
    folder: Backend,
    record: ShardRecord,
    parts: Sequence[int],
    *,
    buffer_size: int,
    key_dtype: str | None = None,
    proc_size: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray | None]]:
    """Read ``parts`` of one shard file as ``(keys, values, extras, ranks)`` batches.

    The format verifies every byte against the recorded checksums; each batch is then
    checked by :class:`PartBuckets` (no null, every key in its part's bucket). ``ranks``:
    each row's rank of ``proc_size`` (None for one process). Needs no TensorFlow except to
    hash string keys.

    Raises
    ------
    CheckpointCorruptError
        A check failed, or the file cannot be read as its record describes (a range or a
        size no read can satisfy); the message names the file.
    """
    info = ShardInfo.from_dict(record.info)
    checker = PartBuckets(record, parts, key_dtype or info.schema.key_dtype, proc_size)
    batches = get_format(info.format).read(
        folder, info.path, buffer_size=buffer_size, parts=list(parts), expected=info
    )
    try:
        for batch in batches:
            checker.check_nulls(batch)
            keys, values, extras = batch_to_numpy(batch)
            yield keys, values, extras, checker.check(keys)
    except DeStoreError:
        raise
    except (ValueError, OverflowError, MemoryError) as err:
        raise CheckpointCorruptError(
            f"{record.path}: cannot be read as its manifest record describes ({err!r})"
        ) from err


# --- keys repeated across shards -------------------------------------------------------------
def repeated_key(keys_by_file: Iterable[tuple[str, np.ndarray]]) -> Problem | None:
    """A key held twice among ``keys_by_file`` (file path, keys), naming the files."""
    pairs = list(keys_by_file)
    if not pairs:
        return None
    keys = np.concatenate([keys for _, keys in pairs])
    if len(keys) < 2:
        return None
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not len(same):
        return None
    key = ordered[same[0]]
    owners = np.repeat(np.arange(len(pairs)), [len(k) for _, k in pairs])
    holders = sorted({pairs[i][0] for i in owners[order][ordered == key]})
    count = int(np.count_nonzero(ordered == key))
    return Problem(
        holders[0],
        f"key {_key_text(key)} is held {count} times (in {', '.join(holders)}); "
        f"{len(same)} extra copies of keys in all: a checkpoint holds each key once",
    )


def _key_text(key: Any) -> str:
    return repr(key.decode() if isinstance(key, bytes) else key.item() if hasattr(key, "item")
                else key)  # fmt: skip
