"""Flattening a chain of incremental checkpoints into one full checkpoint (compaction).

:func:`compact` reads a checkpoint's chain (its full link, then each delta in order) and
writes what restoring it gives as a new committed full checkpoint. Rows are merged one key
group (``hash(key) mod groups``) at a time in numpy, so memory stays bounded by a group's
rows whatever the table's size, where the full link is bucketed (a file saved in table
order, one bucket, is held whole). ``de-store convert`` uses it for any delta input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from de_store import _rewrite
from de_store.backends import Backend, Location, open_location
from de_store.checkpoint import shards
from de_store.checkpoint.buckets import bucket_order, choose_num_buckets, key_hash_mod
from de_store.checkpoint.chain import chain_links
from de_store.checkpoint.checks import check_link
from de_store.checkpoint.commit import read_manifest
from de_store.checkpoint.manifest import ColumnSpec, Manifest, ShardRecord, VariableEntry
from de_store.checkpoint.retry import RetryPolicy
from de_store.checkpoint.variable_rows import ShardRows, VariableRows
from de_store.errors import CheckpointError
from de_store.formats.binary import numpy_dtype
from de_store.progress import NO_PROGRESS, Progress

#: About how many rows of a variable :func:`compact` merges at a time.
GROUP_ROWS = 1 << 20


@dataclasses.dataclass
class ChainVariable:
    """One variable of a checkpoint with its chain: the full link, then its deltas in order.

    Rows are merged one key group (``hash(key) mod groups``) at a time; ``columns`` are
    those of the newest link.
    """

    name: str
    key_dtype: str
    value_dtype: str
    dim: int
    columns: dict[str, ColumnSpec]
    links: list[tuple[str, VariableEntry]]  # (checkpoint folder, entry), oldest first
    groups: int


def chain_source(
    backend: Backend, name: str, *, group_rows: int = GROUP_ROWS
) -> tuple[Manifest, list[ChainVariable]]:
    """The manifest of the committed checkpoint ``name`` and the chain of each variable.

    Raises
    ------
    CheckpointNotFoundError, CheckpointError
        ``name`` or a link of a chain is missing or uncommitted (the message names it).
    """
    _, manifest = read_manifest(backend, name)
    where = Location(backend, name).url
    out = []
    for var_name in sorted(manifest.variables):
        chain = chain_links(backend, name, var_name, RetryPolicy())
        for folder, link_manifest, entry in chain:  # before any count is used
            check_link(backend, folder, link_manifest.proc_size, entry, where)
        links = [(folder, entry) for folder, _, entry in chain]
        newest = links[-1][1]
        _check_links(links, where)
        rows = sum(entry.rows + entry.removed_rows for _, entry in links)
        buckets = max((r.num_buckets for r in links[0][1].shards), default=1)
        if buckets == 1:  # saved in table order: read whole, its groups chosen freely
            buckets = choose_num_buckets(rows)
        out.append(
            ChainVariable(
                var_name,
                newest.key_dtype,
                newest.value_dtype,
                newest.dim,
                dict(newest.columns),
                links,
                group_count(rows, buckets, group_rows),
            )
        )
    return manifest, out


def group_count(rows: int, num_buckets: int, group_rows: int) -> int:
    """The fewest key groups, a divisor of the full link's ``num_buckets`` (each group is
    then a set of its parts), that hold at most ``group_rows`` of ``rows`` each on average;
    ``num_buckets`` when even single buckets are larger."""
    wanted = -(-rows // max(group_rows, 1))
    divisors = (d for d in range(1, num_buckets + 1) if num_buckets % d == 0 and d >= wanted)
    return next(divisors, num_buckets)


def _check_links(links: list[tuple[str, VariableEntry]], where: str) -> None:
    newest = links[-1][1]
    for folder, entry in links:
        mine = (entry.key_dtype, entry.value_dtype, entry.dim)
        if mine != (newest.key_dtype, newest.value_dtype, newest.dim) or any(
            newest.columns.get(c, spec) != spec for c, spec in entry.columns.items()
        ):
            raise CheckpointError(
                f"variable {newest.name!r} of {where}: link {folder} of its chain holds "
                f"(key_dtype, value_dtype, dim, columns) = {(*mine, entry.columns)}, the "
                f"newest link {(newest.key_dtype, newest.value_dtype, newest.dim, newest.columns)}"
            )


class _RecordGroups:
    """The rows of one shard file, one key group at a time.

    A file bucketed as finely as the groups (its bucket count a multiple of theirs) holds
    each group in its own parts. A coarser one, a small delta, is read once per class of
    groups it cannot tell apart (``group mod step``) and kept while the groups stay in it.
    """

    def __init__(
        self, folder: Backend, record: ShardRecord, key_dtype: str, groups: int, buffer_size: int
    ) -> None:
        self.folder, self.record, self.key_dtype = folder, record, key_dtype
        self.groups, self.buffer_size = groups, buffer_size
        self.step = math.gcd(record.num_buckets, groups)
        self._class = -1
        self._rows: ShardRows | None = None
        self._starts = self._ends = np.zeros(0, np.int64)

    def rows(self, group: int) -> ShardRows | None:
        if group % self.step != self._class:
            self._load(group % self.step)
        if self._rows is None or self.step == self.groups:
            return self._rows
        start, end = int(self._starts[group]), int(self._ends[group])
        return ShardRows(
            self._rows.keys[start:end], {c: v[start:end] for c, v in self._rows.columns.items()}
        )

    def _load(self, klass: int) -> None:
        self._class, self._rows = klass, None
        parts = [i for i, b in enumerate(self.record.part_buckets) if b % self.step == klass]
        if not parts:
            return
        batches = list(
            shards.read_shard_rows(self.folder, self.record, parts, buffer_size=self.buffer_size)
        )
        keys, columns = _rewrite.concat_rows(
            [(b.keys, b.columns) for b in batches], self.record.info
        )
        if self.step < self.groups:  # order the class's rows by group, once
            buckets = key_hash_mod(keys, self.groups, self.key_dtype)
            order, counts = bucket_order(buckets, self.groups)
            keys = np.take(keys, order)
            columns = {c: np.take(v, order, axis=0) for c, v in columns.items()}
            self._ends = np.cumsum(counts)
            self._starts = self._ends - counts
        self._rows = ShardRows(keys, columns)


def merged_groups(
    backend: Backend, var: ChainVariable, *, buffer_size: int = 65536
) -> Iterator[tuple[int, ShardRows]]:
    """``(group, rows)``: the variable's rows as restoring its chain gives them, per group.

    Per group: the full link's rows, then for each delta in order its tombstones removed
    and its rows upserted (the last write wins). The deltas are merged among themselves
    first (they are small), then applied to the full link's rows in one pass. A column a
    link lacks reads as zeros.
    """
    readers = []
    for folder, entry in var.links:
        sub = backend.sub(folder)
        rows = [_RecordGroups(sub, r, var.key_dtype, var.groups, buffer_size) for r in entry.shards]
        removed = [
            _RecordGroups(sub, r, var.key_dtype, var.groups, buffer_size) for r in entry.removed
        ]
        readers.append((rows, removed))
    steps = sorted({r.step for rows, removed in readers for r in rows + removed})
    # groups in mixed-radix order: each coarse file's class stays the same for a run
    for group in sorted(range(var.groups), key=lambda g: (*(g % s for s in steps), g)):
        base, overlay, tombstones = _empty_rows(var), _empty_rows(var), []
        for index, (rows, removed) in enumerate(readers):
            drop = [r.keys for reader in removed if (r := reader.rows(group)) is not None]
            update = [
                _with_columns(r, var) for reader in rows if (r := reader.rows(group)) is not None
            ]
            if index == 0:
                base = _apply(base, drop, update)
            else:
                overlay = _apply(overlay, drop, update)
                tombstones += drop
        yield group, _apply(base, tombstones, [overlay])


def _empty_rows(var: ChainVariable) -> ShardRows:
    keys = np.zeros(0, object if var.key_dtype == "string" else numpy_dtype(var.key_dtype))
    columns = {c: np.zeros((0, s.dim), numpy_dtype(s.dtype)) for c, s in var.columns.items()}
    return ShardRows(keys, columns)


def _with_columns(rows: ShardRows, var: ChainVariable) -> ShardRows:
    """``rows`` with exactly ``var``'s columns: one the link lacks is zeros."""
    columns = {
        c: rows.columns[c]
        if c in rows.columns
        else np.zeros((rows.rows, s.dim), numpy_dtype(s.dtype))
        for c, s in var.columns.items()
    }
    return ShardRows(rows.keys, columns)


def _apply(base: ShardRows, removed: list[np.ndarray], updates: list[ShardRows]) -> ShardRows:
    """``base`` without the ``removed`` keys, then with ``updates`` upserted (their keys
    must be unique across them), each column copied once."""
    updates = [u for u in updates if u.rows]
    if not base.rows and len(updates) == 1:
        return updates[0]
    drop = [*removed, *(u.keys for u in updates)]
    keep = None
    if base.rows and drop:
        keep = np.flatnonzero(~np.isin(base.keys, np.concatenate(drop)))
    if keep is None and not updates:
        return base

    def column(rows: np.ndarray, added: list[np.ndarray]) -> np.ndarray:
        kept = len(rows) if keep is None else len(keep)
        out = np.empty((kept + sum(len(a) for a in added), *rows.shape[1:]), rows.dtype)
        if keep is None:
            out[:kept] = rows
        else:  # np.take gathers rows about twice as fast as boolean indexing
            np.take(rows, keep, axis=0, out=out[:kept])
        for a in added:
            out[kept : kept + len(a)] = a
            kept += len(a)
        return out

    keys = column(base.keys, [u.keys for u in updates])
    columns = {c: column(v, [u.columns[c] for u in updates]) for c, v in base.columns.items()}
    return ShardRows(keys, columns)


def write_flattened(
    variables: list[ChainVariable],
    source: Backend,
    backend: Backend,
    name: str,
    format_name: str | None,
    *,
    buffer_size: int = 65536,
    metadata: dict[str, Any] | None = None,
    progress: Progress = NO_PROGRESS,
) -> None:
    """Write the flattened chains of ``variables`` as the new full checkpoint ``name``.

    One shard file per key group, all of rank 0: a restore into any number of processes
    and shards reads its buckets as from any full checkpoint. ``format_name`` None: the
    format of each variable's newest link.
    """
    with _rewrite.new_checkpoint(backend, name) as strategy:
        staging = backend.sub(strategy.staging)
        entries = {}
        for var in variables:
            fmt = format_name or var.links[-1][1].format
            entries[var.name] = _write_groups(staging, source, var, fmt, buffer_size, progress)
        _rewrite.commit_ranks(strategy, {0: entries}, metadata)


def _write_groups(
    staging: Backend,
    source: Backend,
    var: ChainVariable,
    format_name: str,
    buffer_size: int,
    progress: Progress,
) -> VariableEntry:
    """Write one shard file per key group of ``var``'s flattened chain; return its entry.

    In the newest link's format, the shards keep its compression and value precision; in
    another format the values are written at their own dtype, uncompressed."""
    schema = VariableRows(var.name, var.key_dtype, var.value_dtype, var.dim, var.columns, [])
    encoding = _encoding_of(var.links[-1][1], format_name)
    records = []
    for group, merged in merged_groups(source, var, buffer_size=buffer_size):
        records.append(
            shards.write_shard(
                staging,
                dataclasses.replace(schema, shards=[merged]),
                0,
                rank=0,
                global_shard=group,
                format_name=format_name,
                buffer_size=buffer_size,
                **encoding,
            )
        )
        progress.update(1)
    records.sort(key=lambda r: r.shard)
    return shards.entry_for(schema, records, format_name, **encoding)


def _encoding_of(newest: VariableEntry, format_name: str) -> dict[str, Any]:
    """The compression and value precision of ``newest`` when writing ``format_name`` is
    writing its format; none otherwise."""
    if format_name != newest.format:
        return {}
    return {
        "compression": newest.compression,
        "compression_level": newest.compression_level,
        "value_precision": newest.value_precision,
    }


def compact(
    url: str,
    out_url: str,
    *,
    format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    names: Sequence[str] = (),
    values_only: bool = False,
    buffer_size: int = 65536,
    group_rows: int = GROUP_ROWS,
    metadata: dict[str, Any] | None = None,
    progress: Progress = NO_PROGRESS,
) -> str:
    """Write the checkpoint ``url``, with its chain applied, as the new full checkpoint
    ``out_url``; return ``out_url``.

    The result holds what restoring ``url`` gives (the full link, then each delta's
    removals and rows in order), through the same commit protocol as a save. Rows are
    merged in numpy one key group at a time, so memory stays bounded by about
    ``group_rows`` rows (plus the rows of the deltas for that group), whatever the size
    of the table, where the full link is bucketed (one saved in table order is held
    whole). No TensorFlow table is involved.

    Parameters
    ----------
    url:
        A committed checkpoint, full or incremental.
    out_url:
        The new checkpoint folder; it must not exist yet.
    format:
        Shard format of the output; default: that of the newest link of each variable.
    storage_options:
        fsspec options for both URLs.
    names:
        Only these variables (default: all).
    values_only:
        Drop the extra columns (optimizer slots, status).
    buffer_size:
        Rows per part written and most rows per batch read.
    group_rows:
        About how many rows are merged at a time.
    metadata:
        Stored in the new manifest (default: ``{"compacted_from": url}``).
    progress:
        Advanced by one per key group written.

    Raises
    ------
    CheckpointNotFoundError, CheckpointError
        ``url`` or a link of its chain is missing or uncommitted (the message names the
        link and the checkpoint that depends on it); ``out_url`` exists already.
    """
    source, name = open_location(url, storage_options)
    _, variables = chain_source(source, name, group_rows=group_rows)
    if names:
        variables = _rewrite.select(variables, tuple(names), url)
    if values_only:
        variables = [
            dataclasses.replace(v, columns={"value": v.columns["value"]}) for v in variables
        ]
    for var in variables:
        _rewrite.check_columns(
            var.name, var.key_dtype, var.columns, format or var.links[-1][1].format
        )
    target, out_name = open_location(out_url, storage_options)
    write_flattened(
        variables,
        source,
        target,
        out_name,
        format,
        buffer_size=buffer_size,
        metadata={"compacted_from": url} if metadata is None else metadata,
        progress=progress,
    )
    return out_url


def flattened_source(backend: Backend, name: str) -> list[_rewrite.SourceVariable]:
    """The variables of the checkpoint ``name`` with their chains applied, for the TFRA
    writer: rank ``r`` of the newest link's ``proc_size`` gets the keys of
    ``default_partition_fn``, its table ``i`` those with ``key mod tables == i``."""
    manifest, chains = chain_source(backend, name)
    out = []
    for var in chains:
        newest = var.links[-1][1]
        tables = max(
            1, max(sum(r.rank == rank for r in newest.shards) for rank in range(manifest.proc_size))
        )
        rank_rows = _RankRows(backend, var, manifest.proc_size)
        by_rank: dict[int, list[tuple[int, _rewrite.RowsLoader]]] = {
            rank: [
                (rank * tables + i, functools.partial(rank_rows.table, rank, i, tables))
                for i in range(tables)
            ]
            for rank in range(manifest.proc_size)
        }
        out.append(
            _rewrite.SourceVariable(
                var.name,
                var.key_dtype,
                var.value_dtype,
                var.dim,
                var.columns,
                manifest.proc_size,
                by_rank,
            )
        )
    return out


class _RankRows:
    """A flattened variable's rows of one rank at a time (the one last asked for)."""

    def __init__(self, backend: Backend, var: ChainVariable, proc_size: int) -> None:
        self.backend, self.var, self.proc_size = backend, var, proc_size
        self._rank, self._rows = -1, _empty_rows(var)

    def table(self, rank: int, index: int, tables: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if rank != self._rank:
            groups = [rows for _, rows in merged_groups(self.backend, self.var)]
            rows = _apply(_empty_rows(self.var), [], groups)
            mine = key_hash_mod(rows.keys, self.proc_size, self.var.key_dtype) == rank
            self._rank = rank
            self._rows = ShardRows(rows.keys[mine], {c: v[mine] for c, v in rows.columns.items()})
        keep = np.mod(self._rows.keys, tables) == index
        return self._rows.keys[keep], {c: v[keep] for c, v in self._rows.columns.items()}
