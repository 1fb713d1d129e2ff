"""The checks a restore and ``de-store verify`` share, so that they refuse the same data.

Three kinds, all on what is read anyway (no extra request, O(rows) numpy work):

* :func:`entry_problems`: a variable's shard records against the manifest, before any
  read. Every number is an integer in its range and agrees with the others (``proc_size``,
  ``dim`` and each column's, ``shard_count``, ranks, ``num_buckets``, ``part_buckets``, the
  rows of the shard and of each part, bytes, byte ranges); every rank of ``proc_size`` and
  every shard as counted is there, once; each part's byte ranges lie inside its files and
  are large enough for its rows in its format (``ShardFormat.part_size_problem``).
  :func:`size_problems` then checks each file's real size against its record, so no row
  count is trusted beyond what the files can hold: a restore sizes its tables from the
  rows only after both passed.
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
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.buckets import key_hash_mod
from de_store.checkpoint.commit import latest_generation
from de_store.checkpoint.manifest import ColumnSpec, ShardRecord, VariableEntry
from de_store.checkpoint.parallel import map_in_threads
from de_store.errors import CheckpointCorruptError, DeStoreError, StorageNotFoundError
from de_store.formats import FORMATS, SchemaInfo, ShardInfo, format_class, get_format
from de_store.formats._schema import KEY_DTYPES, VALUE_DTYPES, is_count
from de_store.formats.batches import batch_to_numpy
from de_store.formats.registry import compressed_format

#: Stands for the manifest's file name in problems until one is found (see link_problems).
_MANIFEST = "manifest"
#: What a problem says of a file the manifest records that is not there.
MISSING = "missing"
#: The most key buckets a shard may name: bucket arithmetic (a modulus times a process
#: count) then stays inside int64.
MAX_BUCKETS = 1 << 31
#: The value column of a tombstone shard (see ``shards.TOMBSTONE_COLUMN``).
_TOMBSTONE = ColumnSpec("int64", 1)


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
    where = Location(backend, folder)
    manifest = (where / names.manifest_name(latest_generation(backend, folder))).url
    return [
        dataclasses.replace(p, path=manifest if p.path == _MANIFEST else (where / p.path).url)
        for p in problems
    ]


def check_link(
    backend: Backend, folder: str, proc_size: int, entry: VariableEntry, where: str
) -> None:
    """Raise :class:`CheckpointCorruptError` for the first problem of ``entry``'s records
    in the committed checkpoint ``folder`` (saved by ``proc_size`` ranks): its numbers,
    then its files' real sizes. What a reader checks before it sizes, allocates or loops
    over anything from the entry's numbers; ``where`` names the checkpoint read."""
    raise_first(link_problems(backend, folder, proc_size, [entry]), where)
    url = Location(backend, folder)
    sizes = size_problems(backend.sub(folder), [*entry.shards, *entry.removed])
    sizes = [dataclasses.replace(p, path=(url / p.path).url) for p in sizes]
    for problem in sizes:
        if problem.message == MISSING:
            raise StorageNotFoundError(f"checkpoint {where} is damaged: {problem.path}: {MISSING}")
    raise_first(sizes, where)


def entry_problems(entry: VariableEntry, proc_size: int, manifest: str) -> list[Problem]:
    """What is wrong with ``entry``'s shard records (``manifest`` names the manifest file).

    The numbers of the entry come first: the later checks loop over them."""
    problems = _entry_number_problems(entry, proc_size, manifest)
    if problems:
        return problems
    problems = _rank_problems(entry, proc_size, manifest)
    offered = format_class(entry.format).compressions if entry.format in FORMATS else ()
    if offered and entry.compression not in offered:
        return [Problem(manifest, f"variable {entry.name!r}: compression "
                f"{entry.compression!r} is not one the {entry.format} format offers "
                f"({list(offered)})")]  # fmt: skip
    for record in entry.shards:
        problems += record_problems(record, entry, _columns_of(entry))
        problems += _precision_problems(record, entry.value_precision)
    for record in entry.removed:
        problems += record_problems(record, entry, {"value": _TOMBSTONE})
        problems += _precision_problems(record, None)
    return problems


def _columns_of(entry: VariableEntry) -> dict[str, ColumnSpec]:
    """The columns the entry's shards store, in order: the value column at its
    precision and int8's scales (``stored_columns``), then the variable's others."""
    columns = {"value": ColumnSpec(entry.value_dtype, entry.dim), **entry.columns}
    if not entry.stored_columns:
        return columns
    return {**entry.stored_columns, **{k: c for k, c in columns.items() if k != "value"}}


def _precision_problems(record: ShardRecord, precision: str | None) -> list[Problem]:
    """A record must store values at its entry's precision (tombstones: exactly)."""
    if record.value_precision != precision:
        return [Problem(record.path, f"value_precision is {record.value_precision!r}, the "
                                     f"manifest's entry says {precision!r}")]  # fmt: skip
    return []


def _entry_number_problems(entry: VariableEntry, proc_size: Any, manifest: str) -> list[Problem]:
    """``proc_size``, the dims, dtypes and ``shard_count`` of the entry, and each record's
    rank, shard, ``num_buckets`` and ``part_buckets``, checked as numbers."""
    found: list[str] = []
    records = [*entry.shards, *entry.removed]
    if not is_count(proc_size, 1):
        found.append(f"proc_size must be an integer >= 1, found {proc_size!r}")
    if not is_count(entry.dim, 1):
        found.append(f"dim must be an integer >= 1, found {entry.dim!r}")
    if not is_count(entry.shard_count):
        found.append(f"shard_count must be an integer >= 0, found {entry.shard_count!r}")
    if entry.key_dtype not in KEY_DTYPES:
        found.append(f"key_dtype must be one of {list(KEY_DTYPES)}, found {entry.key_dtype!r}")
    if not isinstance(entry.columns, dict):
        found.append(f"columns must be a mapping, found {entry.columns!r}")
    else:
        for name, spec in _columns_of(entry).items():
            if not is_count(spec.dim, 1):
                found.append(f"dim of column {name!r} must be an integer >= 1, found "
                             f"{spec.dim!r}")  # fmt: skip
            if spec.dtype not in VALUE_DTYPES:
                found.append(f"dtype of column {name!r} must be one of {list(VALUE_DTYPES)}, "
                             f"found {spec.dtype!r}")  # fmt: skip
        value = ColumnSpec(entry.value_dtype, entry.dim)
        if entry.columns.get("value", value) != value:
            found.append(f"column 'value' is {entry.columns['value']}, the entry's value_dtype "
                         f"and dim say {value}")  # fmt: skip
    shards = proc_size * entry.shard_count if not found else 0  # a bound only
    for index, record in enumerate(records):
        found += [f"{_record_name(entry, index)} {p}"
                  for p in _record_number_problems(record, shards)]  # fmt: skip
    return [Problem(manifest, f"variable {entry.name!r}: {f}") for f in found]


def _record_name(entry: VariableEntry, index: int) -> str:
    kind, at = ("shards", index) if index < len(entry.shards) else (
        "removed", index - len(entry.shards))  # fmt: skip
    records = entry.shards if kind == "shards" else entry.removed
    info = records[at].info
    path = info.get("path") if isinstance(info, dict) else None
    return f"{kind}[{at}] ({path!r}):"


def _record_number_problems(record: ShardRecord, shards: int) -> list[str]:
    """``shards``: a bound of the shard numbers (ranks x shard_count)."""
    found = []
    if not is_count(record.rank):
        found.append(f"rank must be an integer >= 0, found {record.rank!r}")
    if not is_count(record.shard, 0, shards):
        found.append(f"shard must be an integer from 0 to {shards - 1} (proc_size x "
                     f"shard_count), found {record.shard!r}")  # fmt: skip
    if not is_count(record.num_buckets, 1, MAX_BUCKETS + 1):
        found.append(f"num_buckets must be an integer from 1 to {MAX_BUCKETS}, found "
                     f"{record.num_buckets!r}")  # fmt: skip
    elif not isinstance(record.part_buckets, list):
        found.append(f"part_buckets must be a list, found {record.part_buckets!r}")
    else:
        bad = [b for b in record.part_buckets if not is_count(b, 0, record.num_buckets)]
        if bad:
            found.append(f"part_buckets {bad[:5]} are not buckets of 0.."
                         f"{record.num_buckets - 1} (num_buckets "
                         f"{record.num_buckets})")  # fmt: skip
    if not isinstance(record.info, dict):
        found.append(f"info must be a mapping, found {type(record.info).__name__}")
    return found


def _rank_problems(entry: VariableEntry, proc_size: int, manifest: str) -> list[Problem]:
    def problem(message: str) -> Problem:
        return Problem(manifest, f"variable {entry.name!r}: {message}")

    problems = []
    ranks = [record.rank for record in entry.shards]
    missing = _missing_ranks(set(ranks), proc_size)
    if missing:
        problems.append(problem(f"no shards of rank(s) {missing} (proc_size is {proc_size})"))
    outside = sorted({r for r in ranks if not (isinstance(r, int) and 0 <= r < proc_size)})
    if outside:
        problems.append(problem(f"shards of rank(s) {outside}, outside 0..{proc_size - 1}"))
    if entry.shard_count != len(entry.shards):
        problems.append(
            problem(f"shard_count is {entry.shard_count}, found {len(entry.shards)} records")
        )
    numbers = [record.shard for record in entry.shards]
    twice = sorted(n for n, count in collections.Counter(numbers).items() if count > 1)
    if twice:
        problems.append(problem(f"shard number(s) {twice} recorded more than once"))
    paths = [record.path for record in [*entry.shards, *entry.removed]]
    repeated = sorted(path for path, n in collections.Counter(paths).items() if n > 1)
    if repeated:
        problems.append(problem(f"shard file(s) {repeated} recorded more than once"))
    return problems


def _missing_ranks(present: set[int], proc_size: int, most: int = 10) -> str:
    """The first ``most`` ranks of ``range(proc_size)`` not ``present``, as text ("" when
    none): at most ``len(present) + most`` ranks are looked at, however large the count."""
    missing: list[int] = []
    rank = 0
    while rank < proc_size and len(missing) < most:
        if rank not in present:
            missing.append(rank)
        rank += 1
    if not missing:
        return ""
    held = len({r for r in present if isinstance(r, int) and 0 <= r < proc_size})
    more = proc_size - held - len(missing)
    return f"{missing}" + (f" and {more} more" if more > 0 else "")


def record_problems(
    record: ShardRecord, entry: VariableEntry, columns: dict[str, ColumnSpec]
) -> list[Problem]:
    """What is wrong with one shard record of ``entry`` holding ``columns``: its schema,
    row counts, files, parts, buckets and byte ranges."""
    try:
        found = _info_problems(record.info, entry, columns)
        if not found:
            found = _bucket_problems(record) + _range_problems(record.info)
        if not found:
            found = _part_size_problems(record.info, entry.compression)
        return found
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        path = record.info.get("path") if isinstance(record.info, dict) else None
        where = str(path or f"a shard of {entry.name!r}")
        return [Problem(where, f"record is not valid ({err!r})")]


def _info_problems(
    info: dict[str, Any], entry: VariableEntry, columns: dict[str, ColumnSpec]
) -> list[Problem]:
    """The record's format, schema (as ``columns`` say), rows and bytes, each checked
    against the others: the rows of its parts add up, their offsets follow each other,
    the bytes of its files add up."""
    path = info["path"]
    if not isinstance(path, str) or info["format"] not in FORMATS:
        return [Problem(str(path), f"path {path!r} or format {info['format']!r} is not valid")]
    found = _schema_problems(info, entry, columns)
    if not is_count(info["rows"]):
        found.append(f"rows must be an integer >= 0, found {info['rows']!r}")
    offset = 0
    for index, part in enumerate(info["parts"]):
        if not is_count(part["rows"]):
            found.append(f"parts[{index}].rows must be an integer >= 0, found {part['rows']!r}")
            break
        if part["row_offset"] != offset or isinstance(part["row_offset"], bool):
            found.append(f"parts[{index}].row_offset is {part['row_offset']!r}, the parts "
                         f"before it hold {offset} rows")  # fmt: skip
            break
        offset += part["rows"]
    else:
        if info["rows"] != offset:
            found.append(f"rows is {info['rows']!r}, its {len(info['parts'])} parts hold "
                         f"{offset}")  # fmt: skip
    found += _file_number_problems(info)
    return [Problem(path, message) for message in found]


def _schema_problems(
    info: dict[str, Any], entry: VariableEntry, columns: dict[str, ColumnSpec]
) -> list[str]:
    try:
        schema = SchemaInfo.from_dict(info["schema"])
    except (TypeError, ValueError, KeyError) as err:
        return [f"schema is not valid ({err})"]
    found = (schema.key_dtype, schema.value_dtype, schema.dim, {
        e.name: ColumnSpec(e.dtype, e.width or 1) for e in schema.extras})  # fmt: skip
    value = columns["value"]
    expected = (entry.key_dtype, value.dtype, value.dim,
                {k: c for k, c in columns.items() if k != "value"})  # fmt: skip
    if found != expected:
        return [f"schema holds (key_dtype, value_dtype, dim, extra columns) = {found}, the "
                f"manifest's entry says {expected}"]  # fmt: skip
    if list(info["columns"]) != list(schema.columns):
        return [f"columns are {info['columns']!r}, its schema's {list(schema.columns)}"]
    return []


def _file_number_problems(info: dict[str, Any]) -> list[str]:
    found = []
    files = info["files"]
    if not isinstance(files, list) or not files:
        return [f"files must list the shard's files, found {files!r}"]
    for index, file in enumerate(files):
        if not isinstance(file["path"], str):
            found.append(f"files[{index}].path must be a string, found {file['path']!r}")
        if not is_count(file["bytes"]):
            found.append(f"files[{index}].bytes ({file['path']!r}) must be an integer >= 0, "
                         f"found {file['bytes']!r}")  # fmt: skip
        if not is_count(file["crc32c"], 0, 1 << 32):
            found.append(f"files[{index}].crc32c must be a 32-bit crc32c, found "
                         f"{file['crc32c']!r}")  # fmt: skip
    if not found and (not is_count(info["bytes"])
                      or info["bytes"] != sum(file["bytes"] for file in files)):  # fmt: skip
        found.append(f"bytes is {info['bytes']!r}, its files hold "
                     f"{sum(file['bytes'] for file in files)}")  # fmt: skip
    return found


def _part_size_problems(info: dict[str, Any], compression: str = "none") -> list[Problem]:
    """Each part's byte ranges must be large enough for its rows in its format as written
    (with ``compression``; exactly their size for ``binary``)."""
    fmt = _written_format(info["format"], compression)
    schema = SchemaInfo.from_dict(info["schema"])
    for index, part in enumerate(info["parts"]):
        lengths = [span["length"] for span in part["ranges"]]
        problem = fmt.part_size_problem(schema, part["rows"], lengths)
        if problem is not None:
            return [Problem(info["path"], f"parts[{index}].rows: {problem}")]
    return []


def _written_format(name: str, compression: str) -> Any:
    """The format ``name`` as it wrote with ``compression``; plain when the format
    offers no such codec (the schema checks name such a record already)."""
    if compression in format_class(name).compressions:
        return compressed_format(name, compression)
    return get_format(name)


def _bucket_problems(record: ShardRecord) -> list[Problem]:
    parts, buckets = len(record.info["parts"]), record.part_buckets
    if len(buckets) != parts:
        return [Problem(record.path, f"part_buckets must name one bucket for each of the "
                                     f"{parts} parts, found {len(buckets)}")]  # fmt: skip
    return []


def _range_problems(info: dict[str, Any]) -> list[Problem]:
    """Every part's byte range must lie inside its file as recorded."""
    files = info["files"]
    ends = [get_format(info["format"]).header_bytes] * len(files)  # of the part before
    for index, part in enumerate(info["parts"]):
        ranges = part["ranges"]
        if len(ranges) != len(files):
            return [Problem(str(info["path"]), f"part {index} has {len(ranges)} byte ranges "
                                               f"for {len(files)} files")]  # fmt: skip
        for file, span in zip(files, ranges, strict=True):
            offset, length = span["offset"], span["length"]
            if not (is_count(offset, -(1 << 63)) and is_count(length, -(1 << 63))
                    and is_count(span["crc32c"], 0, 1 << 32)):  # fmt: skip
                return [Problem(str(file["path"]), f"part {index}'s byte range (offset "
                                f"{offset!r}, length {length!r}, crc32c {span['crc32c']!r}) "
                                "must be integers")]  # fmt: skip
            if offset < 0 or length < 0 or offset + length > file["bytes"]:
                return [Problem(str(file["path"]), f"part {index}'s byte range [{offset}, "
                                f"{offset + length}) is outside the file's {file['bytes']} "
                                "bytes")]  # fmt: skip
        for j, span in enumerate(ranges):
            if span["offset"] < ends[j]:
                return [Problem(str(files[j]["path"]), f"parts[{index}]'s byte range starts "
                                f"at {span['offset']}, before byte {ends[j]} (the end of the "
                                "header or of the part before)")]  # fmt: skip
            ends[j] = span["offset"] + span["length"]
    return []


#: Most files whose sizes :func:`size_problems` asks at once.
SIZE_CHECKERS = 16


def size_problems(folder: Backend, records: Iterable[ShardRecord]) -> list[Problem]:
    """Each file of ``records`` (checked by :func:`entry_problems` first) must exist with
    the size its record gives; the sizes are asked side by side (a request each on an
    object store)."""
    files = [(str(f["path"]), int(f["bytes"])) for r in records for f in r.info["files"]]

    def check(file: tuple[str, int]) -> Problem | None:
        path, expected = file
        try:
            found = folder.size(path)
        except FileNotFoundError:
            return Problem(path, MISSING)
        if found != expected:
            return Problem(path, f"expected {expected} bytes, found {found}")
        return None

    found = map_in_threads(check, files, SIZE_CHECKERS, "de_store-size")
    return [p for p in found if p is not None]


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
def has_repeated_key(arrays: Sequence[np.ndarray]) -> bool:
    """Whether a key is held twice among ``arrays``: one copy of the keys sorted in place
    and its neighbours compared, with none of the bookkeeping :func:`repeated_key` needs
    to name the key and its files."""
    if sum(len(keys) for keys in arrays) < 2:
        return False
    keys = np.concatenate(arrays)
    keys.sort()
    return bool(np.any(keys[1:] == keys[:-1]))


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
