"""Converting checkpoints (``de-store convert``): between shard formats, from and to TFRA.

- de_store checkpoint -> de_store checkpoint in another shard format (same ranks, shards,
  rows and columns; a new committed checkpoint).
- TFRA ``TFRADynamicEmbedding`` folder -> committed de_store checkpoint: TFRA's rank ``r``
  becomes rank ``r``, its table ``i`` shard ``i - 1`` of that rank.
- de_store checkpoint -> TFRA layout: keys and values, ``num_tables`` = shards per rank,
  partitioned into tables as TFRA's default partitioner does (``formats.tfra.table_of``).

Rows are held one variable and one rank at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from de_store._rewrite import (
    Rows,
    RowsLoader,
    SourceVariable,
    check_columns,
    commit_ranks,
    concat_rows,
    new_checkpoint,
    select,
)
from de_store.backends import Backend, Location, open_backend, open_location
from de_store.checkpoint import shards
from de_store.checkpoint._tf_bundle import INDEX_SUFFIX, read_index
from de_store.checkpoint.checks import check_link
from de_store.checkpoint.commit import read_manifest
from de_store.checkpoint.manifest import ColumnSpec, ShardRecord, VariableEntry
from de_store.checkpoint.variable_rows import ShardRows, VariableRows
from de_store.compaction import chain_source, compact, flattened_source
from de_store.errors import CheckpointError, CheckpointNotFoundError, FormatError
from de_store.formats import FORMATS, batch_to_numpy, tfra
from de_store.formats.batches import batch_from_numpy
from de_store.formats.binary import decode_pair, numpy_dtype
from de_store.progress import NO_PROGRESS, Progress

#: Target names of ``de-store convert --to``.
TARGETS = (*sorted(FORMATS), "tfra")
_TFRA_FILE = re.compile(r"^(?:.*/)?(.+)_mht_(\d+)of(\d+)_rank(\d+)_size(\d+)-keys$")


# --- sources ----------------------------------------------------------------------------
def checkpoint_source(backend: Backend, name: str) -> list[SourceVariable]:
    """The variables of the committed de_store checkpoint ``name`` under ``backend``; of an
    incremental one, with its chain applied (see :func:`de_store.compaction.flattened_source`)."""
    folder, manifest = read_manifest(backend, name)
    if manifest.incremental:
        return flattened_source(backend, name)
    for entry in manifest.variables.values():  # before any count is used
        check_link(backend, folder, manifest.proc_size, entry, Location(backend, name).url)
    folder_backend = backend.sub(folder)

    def loader(record: ShardRecord) -> RowsLoader:
        def load() -> Rows:
            parts = list(range(len(record.part_buckets)))
            batches = list(
                shards.read_shard_rows(folder_backend, record, parts, buffer_size=1 << 16)
            )
            return concat_rows([(b.keys, b.columns) for b in batches], record.info)

        return load

    out = []
    for entry in manifest.variables.values():
        by_rank: dict[int, list[tuple[int, RowsLoader]]] = {}
        for record in sorted(entry.shards, key=lambda s: (s.rank, s.shard)):
            by_rank.setdefault(record.rank, []).append((record.shard, loader(record)))
        out.append(
            SourceVariable(
                entry.name,
                entry.key_dtype,
                entry.value_dtype,
                entry.dim,
                dict(entry.columns),
                manifest.proc_size,
                by_rank,
            )
        )
    return out


def tfra_variable_names(backend: Backend) -> list[str]:
    """Names of the variables (``/`` shown as ``_``) in a TFRA folder."""
    return sorted({m.group(1) for p in backend.list() if (m := _TFRA_FILE.match(p))})


#: A TFRA Variable's tables in a TF checkpoint: the object ``tables_of_{name}`` (TFRA tracks
#: them so), its name escaped as TensorFlow escapes object names ("/" as ".S", "." as "..").
_TFRA_TABLES = re.compile(r"(?:^|/)tables_of_([^/]+)/")


def tfra_checkpoint_names(backend: Backend) -> dict[str, str]:
    """The real names of the TFRA variables whose files name them with ``/`` as ``_``
    (``tower_emb`` -> ``tower/emb``), read from the TF checkpoints (``*.index``) beside the
    TFRA folder: file name -> variable name. A file name that the checkpoints give two
    names for, or none, is left out (``--name`` names it)."""
    found: dict[str, set[str]] = {}
    for path in backend.list():
        if "/" in path or not path.endswith(INDEX_SUFFIX):
            continue
        where = Location(backend, path).url
        try:
            tensors = read_index(backend.read_bytes(path), where)
        except FormatError:
            continue  # not a TF checkpoint: it names nothing
        for tensor in tensors:
            if (match := _TFRA_TABLES.search(tensor)) is not None:
                name = re.sub(r"\.(S|\.)", lambda m: "/" if m[1] == "S" else ".", match[1])
                found.setdefault(name.replace("/", "_"), set()).add(name)
    return {stem: next(iter(names)) for stem, names in found.items() if len(names) == 1}


#: Slot names of TFRA's optimizers -> the companion column de_store's optimizers use.
TFRA_SLOTS = {"m": "adam_m", "v": "adam_v", "accumulator": "adagrad_accumulator"}
_TFRA_SLOT_NAMES = (*TFRA_SLOTS, "vhat", "momentum", "rms", "mom", "linear")


def tfra_slot_stems(stem: str, stems: list[str]) -> dict[str, str]:
    """The slot variables TFRA saved for variable file stem ``stem``: column -> stem.

    TFRA saves an optimizer slot as a variable of its own, ``{name}_{lookup}_{slot}``
    (``user_emb_lk_m``); Adam's ``m`` and ``v`` and Adagrad's ``accumulator`` become the
    columns de_store's optimizers read (``adam_m`` ...), others ``tfra_{slot}``.
    """
    slots = {}
    for other in stems:
        rest = other[len(stem) + 1 :] if other.startswith(stem + "_") else ""
        lookup, _, slot = rest.rpartition("_")
        if lookup and slot in _TFRA_SLOT_NAMES:
            slots[TFRA_SLOTS.get(slot, f"tfra_{slot}")] = other
    return slots


def tfra_source(
    backend: Backend,
    names: list[str] | None,
    *,
    dim: int,
    key_dtype: str,
    value_dtype: str,
) -> list[SourceVariable]:
    """The variables ``names`` (default: all) of a TFRA folder, read with ``dim`` and dtypes;
    the slot files of a variable's optimizer come in as its companion columns."""
    stems = tfra_variable_names(backend)
    if not stems:
        raise FormatError(f"no TFRA files (*_mht_*of*_rank*_size*-keys) under {backend.url}")
    slot_stems = {s for stem in stems for s in tfra_slot_stems(stem, stems).values()}
    real = tfra_checkpoint_names(backend)
    names = names or [real.get(s, s) for s in stems if s not in slot_stems]
    out = []
    for name in names:
        slots = tfra_slot_stems(name.replace("/", "_"), stems)
        slot_tables = {column: _tables_of(backend, other) for column, other in slots.items()}
        by_rank: dict[int, list[tuple[int, RowsLoader]]] = {}
        proc_size = 1
        for pair in tfra.find_pairs(backend, name):
            proc_size = pair.proc_size
            load = _tfra_loader(backend, pair, name, dim, key_dtype, value_dtype)
            if slots:
                slot_pairs = {
                    c: _slot_pair(tables, pair, slots[c]) for c, tables in slot_tables.items()
                }
                load = _with_slots(backend, load, slot_pairs, dim, key_dtype, value_dtype)
            by_rank.setdefault(pair.rank, []).append(
                (pair.rank * pair.num_tables + pair.table - 1, load)
            )
        columns = {c: ColumnSpec(value_dtype, dim) for c in ("value", *sorted(slots))}
        out.append(SourceVariable(name, key_dtype, value_dtype, dim, columns, proc_size, by_rank))
    return out


def _tables_of(backend: Backend, name: str) -> dict[tuple[int, int], tfra.TablePair]:
    return {(p.rank, p.table): p for p in tfra.find_pairs(backend, name)}


def _slot_pair(
    tables: dict[tuple[int, int], tfra.TablePair], pair: tfra.TablePair, slot: str
) -> tfra.TablePair:
    """The table of slot variable ``slot`` that holds the slots of ``pair``'s keys."""
    found = tables.get((pair.rank, pair.table))
    if found is None or (found.num_tables, found.proc_size) != (pair.num_tables, pair.proc_size):
        raise FormatError(
            f"TFRA slot variable {slot!r}: expected table {pair.table} of {pair.num_tables} on "
            f"rank {pair.rank} of {pair.proc_size}, as its variable has ({pair.keys}), found "
            f"{sorted((p.table, p.num_tables, p.rank, p.proc_size) for p in tables.values())}"
        )
    return found


def _with_slots(
    backend: Backend,
    load: RowsLoader,
    slots: dict[str, tfra.TablePair],
    dim: int,
    key_dtype: str,
    value_dtype: str,
) -> RowsLoader:
    """``load`` plus the rows of each slot's table of the same rank and number, by key;
    a key the slot does not hold (never trained) gets zeros."""
    slot_loaders = {
        column: _tfra_loader(backend, pair, column, dim, key_dtype, value_dtype)
        for column, pair in slots.items()
    }

    def load_all() -> Rows:
        keys, columns = load()
        for column, slot_load in slot_loaders.items():
            slot_keys, slot_columns = slot_load()
            order = np.argsort(slot_keys, kind="stable")
            found = np.searchsorted(slot_keys[order], keys).clip(0, max(len(order) - 1, 0))
            rows = np.zeros_like(columns["value"])
            if len(order):
                held = slot_keys[order][found] == keys
                rows[held] = slot_columns["value"][order][found][held]
            columns[column] = rows
        return keys, columns

    return load_all


def _tfra_loader(
    backend: Backend, pair: tfra.TablePair, name: str, dim: int, key_dtype: str, value_dtype: str
) -> RowsLoader:
    keys_path, values_path = pair.keys, pair.values
    schema = tfra.SchemaInfo(name, dim, key_dtype, value_dtype)
    check = functools.partial(_check_tfra_sizes, backend, keys_path, values_path, schema)
    check(backend.size(keys_path), backend.size(values_path))  # before anything is written
    _check_distinct_keys(backend, keys_path, schema.key_dtype)

    def load() -> Rows:
        keys, values = backend.read_bytes(keys_path), backend.read_bytes(values_path)
        check(len(keys), len(values))
        key_array, value_array, _ = batch_to_numpy(decode_pair(keys, values, schema.arrow_schema()))
        return key_array, {"value": value_array}

    return load


def _check_tfra_sizes(
    backend: Backend,
    keys_path: str,
    values_path: str,
    schema: tfra.SchemaInfo,
    keys_bytes: int,
    values_bytes: int,
) -> None:
    """TFRA files record no dtype or dim; their sizes are what can be checked: a whole
    number of keys, and keys x dim x itemsize bytes of values."""
    key_size = numpy_dtype(schema.key_dtype).itemsize
    item_size = numpy_dtype(schema.value_dtype).itemsize
    where = Location(backend)
    if keys_bytes % key_size:
        raise FormatError(
            f"TFRA keys file {(where / keys_path).url}: expected a whole number of "
            f"{key_size}-byte {schema.key_dtype} keys, found {keys_bytes} bytes; check --key-dtype"
        )
    rows = keys_bytes // key_size
    expected = rows * schema.dim * item_size
    if values_bytes != expected:
        per_row = f" ({values_bytes / rows:g} bytes a row)" if rows else ""
        raise FormatError(
            f"TFRA values file {(where / values_path).url}: expected {rows:,} keys x dim "
            f"{schema.dim} x {item_size} bytes ({schema.value_dtype}) = {expected:,} bytes, "
            f"found {values_bytes:,}{per_row} (the keys are those of "
            f"{keys_path.rpartition('/')[2]}, {keys_bytes:,} bytes); TFRA files record no "
            "dim or dtype: check --dim and --value-dtype"
        )


def _check_distinct_keys(backend: Backend, keys_path: str, key_dtype: str) -> None:
    """A TFRA table holds each key once; a keys file holding one twice would make a
    checkpoint that no restore accepts, so it is refused before anything is written."""
    keys = np.frombuffer(backend.read_bytes(keys_path), numpy_dtype(key_dtype))
    keys = np.sort(keys)
    repeated = np.flatnonzero(keys[1:] == keys[:-1])
    if len(repeated):
        key = keys[repeated[0]]
        raise FormatError(
            f"TFRA keys file {Location(backend, keys_path).url}: expected each key once, "
            f"found key {key} {np.count_nonzero(keys == key)} times ({len(repeated):,} extra "
            "copies of keys in all)"
        )


# --- targets ----------------------------------------------------------------------------
def write_checkpoint(
    variables: list[SourceVariable],
    backend: Backend,
    name: str,
    format_name: str,
    *,
    buffer_size: int = 65536,
    metadata: dict[str, Any] | None = None,
    progress: Progress = NO_PROGRESS,
) -> None:
    """Write ``variables`` as the new committed checkpoint ``name`` in ``format_name``."""
    proc_size = max(v.proc_size for v in variables)
    with new_checkpoint(backend, name) as strategy:
        staging = backend.sub(strategy.staging)
        entries: dict[int, dict[str, VariableEntry]] = {r: {} for r in range(proc_size)}
        for var in variables:
            for rank, loaders in sorted(var.shards.items()):
                entry = _write_rank(staging, var, rank, loaders, format_name, buffer_size)
                entries[rank][var.name] = entry
                progress.update(len(loaders))
        commit_ranks(strategy, entries, metadata)


def _write_rank(
    staging: Backend,
    var: SourceVariable,
    rank: int,
    loaders: list[tuple[int, RowsLoader]],
    format_name: str,
    buffer_size: int,
) -> VariableEntry:
    """Write the shards of ``var`` that rank ``rank`` held; return the rank's entry."""
    loaded = [(shard_id, load()) for shard_id, load in loaders]
    shard_rows = [ShardRows(keys, {c: cols[c] for c in var.columns}) for _, (keys, cols) in loaded]
    rows = VariableRows(var.name, var.key_dtype, var.value_dtype, var.dim, var.columns, shard_rows)
    records = [
        shards.write_shard(
            staging,
            rows,
            index,
            rank=rank,
            global_shard=shard_id,
            format_name=format_name,
            buffer_size=buffer_size,
        )
        for index, (shard_id, _) in enumerate(loaded)
    ]
    return shards.entry_for(rows, records, format_name)


def write_tfra(
    variables: list[SourceVariable], backend: Backend, *, progress: Progress = NO_PROGRESS
) -> list[str]:
    """Write keys and values of ``variables`` in TFRA's layout; return the files written."""
    written = []
    for var in variables:
        for rank, loaders in sorted(var.shards.items()):
            loaded = [load() for _, load in loaders]
            keys = np.concatenate([k for k, _ in loaded])
            values = np.concatenate([cols["value"] for _, cols in loaded])
            table = pa.Table.from_batches(
                [batch_from_numpy(keys, values, {}, schema=_value_schema(var))]
            )
            infos = tfra.write_table(
                backend,
                var.name,
                table,
                num_tables=len(loaders),
                proc_rank=rank,
                proc_size=var.proc_size,
            )
            written += [f.path for info in infos for f in info.files]
            progress.update(len(loaders))
    return written


def _value_schema(var: SourceVariable) -> pa.Schema:
    return tfra.SchemaInfo(var.name, var.dim, var.key_dtype, var.value_dtype).arrow_schema()


# --- the command ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TfraOptions:
    """How to read a TFRA folder, whose files record neither dim nor dtypes."""

    dim: int | None = None
    key_dtype: str = "int64"
    value_dtype: str = "float32"
    names: tuple[str, ...] = ()


def open_source(
    src: str, storage_options: dict[str, Any] | None, tfra_options: TfraOptions
) -> tuple[list[SourceVariable], str]:
    """The variables of ``src`` and its kind ("checkpoint" or "tfra")."""
    backend, name = open_location(src, storage_options)
    try:
        variables = checkpoint_source(backend, name)
    except CheckpointNotFoundError:
        pass
    else:
        if tfra_options.names:
            variables = select(variables, tfra_options.names, src)
        return variables, "checkpoint"
    if tfra_options.dim is None:
        raise CheckpointError(
            f"{src} holds no committed de_store checkpoint; to read it as a TFRA folder give "
            "--dim (TFRA's files do not record dim or dtypes)"
        )
    folder = open_backend(src, storage_options)
    variables = tfra_source(
        folder,
        list(tfra_options.names) or None,
        dim=tfra_options.dim,
        key_dtype=tfra_options.key_dtype,
        value_dtype=tfra_options.value_dtype,
    )
    return variables, "tfra"


def check_target(
    variables: list[SourceVariable], to: str, values_only: bool
) -> list[SourceVariable]:
    """The variables as they will be written to ``to``; a clear error if it cannot hold them."""
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    if values_only or to == "tfra":
        variables = [
            dataclasses.replace(v, columns={"value": v.columns["value"]}) for v in variables
        ]
    for var in variables:
        check_columns(var.name, var.key_dtype, var.columns, to)
    return variables


def convert(
    src: str,
    dst: str,
    to: str | None,
    *,
    storage_options: dict[str, Any] | None = None,
    tfra_options: TfraOptions = TfraOptions(),
    values_only: bool = False,
    progress_factory: Callable[[int, str], Progress] | None = None,
) -> str:
    """Convert ``src`` into ``dst`` in format ``to``; return a one-line summary.

    An incremental ``src`` is flattened: ``dst`` is always a full checkpoint (or TFRA files)
    holding what restoring ``src``'s chain gives. ``to`` None (a committed ``src`` only):
    :func:`compact` it, each variable keeping its format.
    """
    kind = _checkpoint_kind(src, storage_options)
    if to is None and kind is None:
        raise ValueError(
            f"give --to: {src} holds no committed de_store checkpoint to keep the format of"
        )
    if to is None or (to != "tfra" and kind == "delta"):
        return _flatten(src, dst, to, storage_options, tfra_options, values_only, progress_factory)
    variables, source = open_source(src, storage_options, tfra_options)
    variables = check_target(variables, to, values_only)
    total = sum(len(loaders) for v in variables for loaders in v.shards.values())
    progress = progress_factory(total, "convert (shards)") if progress_factory else NO_PROGRESS
    with progress:
        if to == "tfra":
            files = write_tfra(variables, open_backend(dst, storage_options), progress=progress)
            return f"wrote {len(files)} TFRA files of {len(variables)} variable(s) to {dst}"
        backend, name = open_location(dst, storage_options)
        write_checkpoint(
            variables, backend, name, to, metadata={"converted_from": src}, progress=progress
        )
    return f"converted {len(variables)} variable(s) from {source} {src} to {to} checkpoint {dst}"


def _checkpoint_kind(src: str, storage_options: dict[str, Any] | None) -> str | None:
    """ "full" or "delta" for a committed checkpoint ``src``, else None."""
    backend, name = open_location(src, storage_options)
    try:
        return "delta" if read_manifest(backend, name)[1].incremental else "full"
    except CheckpointNotFoundError:
        return None


def _flatten(
    src: str,
    dst: str,
    to: str | None,
    storage_options: dict[str, Any] | None,
    tfra_options: TfraOptions,
    values_only: bool,
    progress_factory: Callable[[int, str], Progress] | None,
) -> str:
    if to is not None and to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    backend, name = open_location(src, storage_options)
    _, variables = chain_source(backend, name)
    if tfra_options.names:
        variables = select(variables, tfra_options.names, src)
    total = sum(v.groups for v in variables)
    progress = progress_factory(total, "flatten (groups)") if progress_factory else NO_PROGRESS
    with progress:
        compact(
            src,
            dst,
            format=to,
            storage_options=storage_options,
            names=[v.name for v in variables],
            values_only=values_only,
            metadata={"converted_from": src},
            progress=progress,
        )
    links = max(len(v.links) for v in variables)
    return (
        f"flattened {len(variables)} variable(s) of {src} ({links} link(s) in its longest "
        f"chain) into full {to or 'same-format'} checkpoint {dst}"
    )
