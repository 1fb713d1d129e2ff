"""Read and write TFRA 0.8.1 ``FileSystemSaver`` folders (``TFRADynamicEmbedding``).

TFRA writes each table (one per device) of a variable on each rank as a pair of raw files,
``{name}_mht_{i}of{n}_rank{r}_size{s}-keys`` and ``-values``, with ``/`` in the variable name
replaced by ``_`` and ``i`` counting tables from 1. Keys are raw little-endian keys, values
raw little-endian values, ``dim`` a row; nothing in the files records dim or dtypes, so the
caller gives them. :func:`read_table` imports every table and rank of a variable;
:func:`write_table` writes a folder TFRA restores, partitioning keys the way TFRA's default
partitioner does (:func:`table_of`).

A pair of files cannot be replaced atomically, and a save of several tables replaces
several pairs, so :func:`write_table` commits each save (one variable's tables on one rank)
with a record: it writes the new files into a hidden folder beside the old ones
(``.{group}.{token}/``), then the commit record ``.{group}.commit`` naming them (renamed
into place from that folder: the moment the save takes effect), publishes each file over
the old one, and deletes the folder and the record. :func:`find_pairs` reads a file from
the hidden folder while a record names it and it is still there, so a crash at any point
leaves the folder holding the previous save or the new one, whole; the next save of the
same group first finishes a committed save and deletes an uncommitted one. TFRA's own
loader knows no record: it sees the keys of one save beside the values of another only if
a process dies between two publishes.

Example::

    from de_store.formats import tfra
    table = tfra.read_table("ckpt/TFRADynamicEmbedding", "user_emb", dim=8)
    keys, values, _ = de_store.formats.batch_to_numpy(table)
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from de_store.backends.location import Location
from de_store.errors import FormatError

from ._stream import read_exact
from .base import DEFAULT_BUFFER_SIZE, SchemaInfo, ShardInfo
from .batches import DTYPE_KEY
from .binary import KEYS_SUFFIX, VALUES_SUFFIX, BinaryFormat, decode_pair, numpy_dtype

if TYPE_CHECKING:
    from de_store.backends import Backend

#: Sub-folder of a TF checkpoint directory where TFRA's FileSystemSaver writes.
FOLDER = "TFRADynamicEmbedding"
#: Suffix of a save's commit record, ``.{group}.commit`` beside the files it names.
COMMIT_SUFFIX = ".commit"
_TOKEN = re.compile(r"[0-9a-f]{12}")


def file_prefix(name: str, table: int, num_tables: int, proc_rank: int, proc_size: int) -> str:
    """TFRA's file name (without ``-keys``/``-values``) for table ``table`` (from 1)."""
    return f"{name.replace('/', '_')}_mht_{table}of{num_tables}_rank{proc_rank}_size{proc_size}"


def save_group(name: str, proc_rank: int, proc_size: int) -> str:
    """What one :func:`write_table` call replaces together: variable ``name``'s tables on
    rank ``proc_rank`` of ``proc_size``; names its commit record and staging folders."""
    return f"{name.replace('/', '_')}_rank{proc_rank}_size{proc_size}"


def is_commit_record(path: str) -> bool:
    """Whether ``path`` (any folder) is the commit record of a save in TFRA's layout."""
    base = path.rpartition("/")[2]
    return base.startswith(".") and base.endswith(COMMIT_SUFFIX)


def table_of(keys: np.ndarray, num_tables: int, *, cuda_wheel: bool = True) -> np.ndarray:
    """The table (from 0) TFRA 0.8's ``default_partition_fn`` gives each integer key.

    Under a TensorFlow wheel built with CUDA support (the stock ``tensorflow`` wheel, even
    on a machine without a GPU) an int64 key goes to ``int32(key & 0x7fffffff) mod n``;
    otherwise, and for int32 keys, to ``key mod n`` (floored, as TensorFlow's ``mod``).
    """
    if cuda_wheel and keys.dtype == np.int64:
        return np.mod((keys & 0x7FFFFFFF).astype(np.int32), num_tables)
    return np.mod(keys, num_tables)


def _open(directory: str | Backend, storage_options: Mapping[str, Any] | None) -> Backend:
    from de_store.backends import Backend, open_backend

    if isinstance(directory, Backend):
        return directory
    return open_backend(directory, dict(storage_options or {}))


@dataclasses.dataclass(frozen=True)
class TablePair:
    """The files of one table of a TFRA variable, as a reader opens them.

    Attributes
    ----------
    rank, table, num_tables, proc_size:
        From the file names: table ``table`` (from 1) of ``num_tables`` on rank ``rank``
        of ``proc_size``.
    keys, values:
        Paths of the ``-keys`` and ``-values`` files to read: each is the file of that name
        in the folder, or its staged copy while a commit record names it (see the module's
        docstring).
    """

    rank: int
    table: int
    num_tables: int
    proc_size: int
    keys: str
    values: str


def find_pairs(backend: Backend, name: str) -> list[TablePair]:
    """The tables of variable ``name`` on ``backend``, by rank then table.

    Looks in the backend's root, or in its ``TFRADynamicEmbedding`` folder when the root
    holds none. Raises FormatError when none are found or some table or rank is missing.
    """
    stem = re.escape(name.replace("/", "_"))
    pattern = re.compile(rf"^(?:{FOLDER}/)?{stem}_mht_(\d+)of(\d+)_rank(\d+)_size(\d+)-keys$")
    listing = backend.list()
    staged = _committed(backend, listing, name)
    matches = [(p, m) for p in sorted({*listing, *staged}) if (m := pattern.match(p))]
    if any("/" not in p for p, _ in matches):  # files in the root win over the sub-folder
        matches = [(p, m) for p, m in matches if "/" not in p]
    found: dict[tuple[int, int], str] = {}
    layouts = set()
    for path, match in matches:
        i, n, rank, size = map(int, match.groups())
        found[(rank, i)] = path
        layouts.add((n, size))
    where = Location(backend).url
    if not found:
        raise FormatError(f"no TFRA files of variable {name!r} under {where}")
    if len(layouts) > 1:
        raise FormatError(
            f"TFRA files of {name!r} under {where} mix layouts (tables, ranks): {sorted(layouts)}"
        )
    ((n, size),) = layouts
    missing = [
        file_prefix(name, i, n, r, size) + KEYS_SUFFIX
        for r in range(size)
        for i in range(1, n + 1)
        if (r, i) not in found
    ]
    if missing:
        raise FormatError(f"TFRA variable {name!r} under {where} is incomplete: missing {missing}")
    pairs = []
    for (rank, i), keys in sorted(found.items()):
        values = keys[: -len(KEYS_SUFFIX)] + VALUES_SUFFIX
        read = (staged.get(keys, keys), staged.get(values, values))
        pairs.append(TablePair(rank, i, n, size, *read))
    return pairs


def _committed(backend: Backend, listing: list[str], name: str) -> dict[str, str]:
    """Path -> staged path of each file of variable ``name`` that a commit record names and
    that is still in the record's staging folder (not yet published)."""
    stem = re.escape(name.replace("/", "_"))
    record = re.compile(rf"^((?:{FOLDER}/)?)\.({stem}_rank\d+_size\d+){re.escape(COMMIT_SUFFIX)}$")
    present = set(listing)
    out = {}
    for path in listing:
        if match := record.match(path):
            folder, group = match.groups()
            staging, files = _read_record(backend, path, group)
            for file in files:
                if f"{folder}{staging}/{file}" in present:
                    out[f"{folder}{file}"] = f"{folder}{staging}/{file}"
    return out


def _read_record(backend: Backend, path: str, group: str) -> tuple[str, list[str]]:
    """The staging folder and the file names of the commit record at ``path``; FormatError
    if it is not one that :func:`write_table` writes for ``group``."""
    data = backend.read_bytes(path)
    try:
        record = json.loads(data)
        staging, files = record["staging"], record["files"]
        valid = (
            isinstance(staging, str)
            and staging.startswith(f".{group}.")
            and _TOKEN.fullmatch(staging[len(group) + 2 :]) is not None
            and isinstance(files, list)
            and all(_is_file_name(f) for f in files)
        )
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise FormatError(
            f"TFRA commit record {Location(backend, path).url}: expected JSON naming a staging "
            f"folder .{group}.<12 hex digits> and its files, found {data[:200]!r}"
        )
    return staging, files


def _is_file_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and "/" not in name
        and not name.startswith(".")
        and name.endswith((KEYS_SUFFIX, VALUES_SUFFIX))
    )


def _pair_rows(backend: Backend, keys_path: str, values_path: str, schema: SchemaInfo) -> int:
    key_size = numpy_dtype(schema.key_dtype).itemsize
    row_size = numpy_dtype(schema.value_dtype).itemsize * schema.dim
    keys_bytes, values_bytes = backend.size(keys_path), backend.size(values_path)
    rows = keys_bytes // key_size
    if keys_bytes % key_size or values_bytes != rows * row_size:
        raise FormatError(
            f"TFRA files {Location(backend, keys_path).url} ({keys_bytes} bytes) and "
            f"{Location(backend, values_path).url} ({values_bytes} bytes) do not fit "
            f"key_dtype={schema.key_dtype} ({key_size} bytes a key), dim={schema.dim}, "
            f"value_dtype={schema.value_dtype} ({row_size} bytes a row): expected "
            f"{rows * row_size} value bytes for {keys_bytes / key_size:g} keys"
        )
    return rows


def _read_pair(
    backend: Backend, pair: TablePair, schema: SchemaInfo, buffer_size: int
) -> Iterator[pa.RecordBatch]:
    keys_path, values_path = pair.keys, pair.values
    rows = _pair_rows(backend, keys_path, values_path, schema)
    key_size = numpy_dtype(schema.key_dtype).itemsize
    row_size = numpy_dtype(schema.value_dtype).itemsize * schema.dim
    arrow_schema = schema.arrow_schema()
    with backend.open_read(keys_path) as keys_f, backend.open_read(values_path) as values_f:
        for start in range(0, rows, buffer_size):
            count = min(buffer_size, rows - start)
            keys = read_exact(keys_f, count * key_size, Location(backend, keys_path).url)
            values = read_exact(values_f, count * row_size, Location(backend, values_path).url)
            yield decode_pair(keys, values, arrow_schema)


def read_batches(
    directory: str | Backend,
    name: str,
    *,
    dim: int,
    key_dtype: str = "int64",
    value_dtype: str = "float32",
    storage_options: Mapping[str, Any] | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> Iterator[pa.RecordBatch]:
    """Stream the rows of a TFRA variable as batches of at most ``buffer_size`` rows.

    Same parameters as :func:`read_table`.
    """
    backend = _open(directory, storage_options)
    schema = SchemaInfo(name, dim, key_dtype, value_dtype)
    for pair in find_pairs(backend, name):
        yield from _read_pair(backend, pair, schema, buffer_size)


def read_table(
    directory: str | Backend,
    name: str,
    *,
    dim: int,
    key_dtype: str = "int64",
    value_dtype: str = "float32",
    storage_options: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Import every table and rank of TFRA variable ``name`` as one table.

    Parameters
    ----------
    directory:
        URL (or Backend) of a ``TFRADynamicEmbedding`` folder, or of the checkpoint folder
        holding one.
    name:
        The variable's name as given to ``de.get_variable`` (``/`` becomes ``_``).
    dim, key_dtype, value_dtype:
        What the variable was created with; TFRA's files do not record them.
    storage_options:
        Passed to fsspec (credentials, endpoint, ...).

    Returns
    -------
    pyarrow.Table
        Columns ``key`` and ``value`` (``fixed_size_list[dim]``), rank by rank, table by
        table, in file order.

    Raises
    ------
    FormatError
        No files, a missing table or rank, or a file pair whose sizes do not fit ``dim``
        and the dtypes (the message names both files and their sizes).
    """
    schema = SchemaInfo(name, dim, key_dtype, value_dtype).arrow_schema()
    batches = read_batches(
        directory,
        name,
        dim=dim,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        storage_options=storage_options,
    )
    return pa.Table.from_batches(list(batches), schema=schema)


def _schema_of(name: str, table: pa.Table) -> SchemaInfo:
    key_type, value_field = table.schema.field("key").type, table.schema.field("value")
    if not pa.types.is_fixed_size_list(value_field.type):
        raise FormatError(
            f"column 'value' of {name!r} must be fixed_size_list, found {value_field.type}"
        )
    logical = (value_field.metadata or {}).get(DTYPE_KEY)
    value_dtype = (
        logical.decode() if logical else str(value_field.type.value_type.to_pandas_dtype().__name__)
    )
    key_dtype = str(np.dtype(key_type.to_pandas_dtype()).name)
    return SchemaInfo(name, value_field.type.list_size, key_dtype, value_dtype)


def write_table(
    directory: str | Backend,
    name: str,
    table: pa.Table | pa.RecordBatch,
    *,
    num_tables: int = 1,
    proc_rank: int = 0,
    proc_size: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    cuda_wheel: bool = True,
) -> list[ShardInfo]:
    """Write ``table`` (columns ``key``, ``value``) as TFRA 0.8.1 would save it.

    Each row goes to the table TFRA's default partitioner picks for its key
    (:func:`table_of`; ``cuda_wheel=False`` for a TensorFlow built without CUDA), keeping
    the input order within each table. Point ``directory`` at the checkpoint's
    ``TFRADynamicEmbedding`` folder.

    The call is one save: its files appear together, or the folder keeps the previous
    save (see the module's docstring).

    Returns
    -------
    list of ShardInfo
        One per table, in table order, with the files' sizes and crc32c.
    """
    if not 0 <= proc_rank < proc_size or num_tables < 1:
        raise ValueError(
            "need 0 <= proc_rank < proc_size and num_tables >= 1, got "
            f"proc_rank={proc_rank}, proc_size={proc_size}, num_tables={num_tables}"
        )
    backend = _open(directory, storage_options)
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    table = table.select(["key", "value"])
    schema = _schema_of(name, table)
    table = table.cast(schema.arrow_schema())
    buckets = table_of(table.column("key").to_numpy(), num_tables, cuda_wheel=cuda_wheel)
    group = save_group(name, proc_rank, proc_size)
    finish_saves(backend, group)
    staging = f".{group}.{uuid.uuid4().hex[:12]}"
    infos = []
    try:
        for i in range(num_tables):
            rows = table if num_tables == 1 else table.filter(pa.array(buckets == i))
            prefix = file_prefix(name, i + 1, num_tables, proc_rank, proc_size)
            info = BinaryFormat().write(
                backend,
                f"{staging}/{prefix}",
                rows.to_batches(),
                schema_info=schema,
                buffer_size=buffer_size,
            )
            infos.append(_published(info, prefix, staging))
    except BaseException:
        backend.delete(staging, recursive=True)
        raise
    record = {"staging": staging, "files": [f.path for info in infos for f in info.files]}
    # Written in the staging folder and renamed into place: what a crash leaves of a write
    # in progress (a temporary file) goes with the folder.
    backend.write_bytes(f"{staging}/.{group}{COMMIT_SUFFIX}", json.dumps(record).encode())
    backend.publish(f"{staging}/.{group}{COMMIT_SUFFIX}", f".{group}{COMMIT_SUFFIX}")
    finish_saves(backend, group)
    return infos


def _published(info: ShardInfo, prefix: str, staging: str) -> ShardInfo:
    """``info`` of a pair written in ``staging``, with the paths it is published at."""
    files = tuple(dataclasses.replace(f, path=f.path[len(staging) + 1 :]) for f in info.files)
    return dataclasses.replace(info, path=prefix, files=files)


def finish_saves(backend: Backend, group: str) -> None:
    """Finish what saves of ``group`` left in ``backend``'s root: publish each file that the
    commit record names and that is still staged, delete the record's staging folder (empty
    by then: a listing of files would not show it) and the record, then the staging folders
    of saves of the group that never committed."""
    record = f".{group}{COMMIT_SUFFIX}"
    listing = backend.list()
    staging = ""
    if record in listing:
        staging, files = _read_record(backend, record, group)
        for file in files:
            if f"{staging}/{file}" in listing:
                backend.publish(f"{staging}/{file}", file)
        backend.delete(staging, recursive=True)
        backend.delete(record)
    prefix = f".{group}."
    for folder in sorted({p.partition("/")[0] for p in listing if "/" in p}):
        if (
            folder != staging
            and folder.startswith(prefix)
            and _TOKEN.fullmatch(folder[len(prefix) :])
        ):
            backend.delete(folder, recursive=True)
