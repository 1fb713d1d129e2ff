"""The plan of a restore: what each variable reads and how, built once before any row.

:func:`plan_restore` reads the committed manifest and each variable's chain (an
incremental checkpoint's full link, then its deltas), checks every link as ``de-store
verify`` does (its numbers and its files' sizes, before anything is sized from them) and
against the variable, then decides per variable:

- whether the tasks of its tables (parameter servers) read its rows there
  (:func:`~de_store.saver.device_restore.plan_for`);
- the parts of the chain's shard files that can hold this rank's keys, and each table
  shard's share of their rows (what its tables grow for);
- whether its full link is loaded while it is read (:mod:`de_store.saver.streamed`): one
  process restores a variable that holds nothing, from a link that removes no key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from de_store.backends import Location
from de_store.checkpoint import shards
from de_store.checkpoint.chain import chain_links
from de_store.checkpoint.checks import check_link
from de_store.checkpoint.commit import read_manifest
from de_store.checkpoint.manifest import Manifest, VariableEntry
from de_store.checkpoint.topology import Topology
from de_store.saver import device_restore
from de_store.saver.rows import RestoredVariable, check_compatible, holds_keys, restore_shares

if TYPE_CHECKING:
    from de_store.saver.core import IOOptions
    from de_store.saver.device_restore import DevicePlan

#: One link of a variable's chain: its folder, manifest and entry.
Link = tuple[str, Manifest, VariableEntry]
#: A part of a shard file a rank reads: ``(num_buckets, bucket, rows)``.
Part = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class VariablePlan:
    """How one variable's rows are read and loaded.

    Attributes
    ----------
    variable: the variable restored.
    chain: its links, the full link first, then the deltas in order.
    links: each link's checkpoint folder.
    parts: the parts this rank reads of the chain's rows (tombstones not counted).
    full_rows: the rows of those parts in the full link.
    shares: the rows each table shard receives (:func:`~de_store.saver.rows.restore_shares`).
    streamed: the full link is loaded while it is read.
    on_devices: the tasks of its tables read its rows; None: this process reads them.
    """

    variable: RestoredVariable
    chain: list[Link]
    links: list[Location]
    parts: list[Part]
    full_rows: int
    shares: list[int]
    streamed: bool
    on_devices: DevicePlan | None

    @property
    def entries(self) -> list[VariableEntry]:
        """The entry of each link, the full link's first."""
        return [entry for *_, entry in self.chain]

    @property
    def read_first(self) -> list[Link]:
        """The links read before anything is loaded: a streamed chain's deltas (its full
        link is read while it loads), else every link."""
        return self.chain[1:] if self.streamed else self.chain

    @property
    def rows(self) -> int:
        """The rows of the parts this rank reads, every link's."""
        return sum(rows for *_, rows in self.parts)

    @property
    def urls(self) -> list[str]:
        """Each link's checkpoint URL (what messages name)."""
        return [link.url for link in self.links]


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A restore of the checkpoint ``where`` (its committed ``manifest``) into this rank."""

    where: Location
    manifest: Manifest
    topology: Topology
    options: IOOptions
    variables: list[VariablePlan]

    @property
    def total(self) -> int:
        """Rows and removed keys of every chain: what the progress bar counts."""
        return sum(e.rows + e.removed_rows for v in self.variables for e in v.entries)

    @property
    def bytes(self) -> int:
        """Bytes of the shard files of every chain."""
        return sum(entry.bytes for v in self.variables for entry in v.entries)

    @property
    def links(self) -> int:
        """Links of the longest chain."""
        return max((len(v.chain) for v in self.variables), default=0)


def plan_restore(
    variables: Sequence[RestoredVariable],
    where: Location,
    topology: Topology,
    options: IOOptions,
    check_manifest: Callable[[Manifest], None] | None = None,
) -> RestorePlan:
    """The plan of restoring ``variables`` from the checkpoint ``where``.

    ``check_manifest`` is called with the manifest before anything else is read.

    Raises
    ------
    CheckpointCorruptError
        A link's numbers or files' sizes are wrong; the message names the file.
    CheckpointError
        A link cannot be restored into its variable (another dtype or dim).
    """
    backend = where.backend
    folder, manifest = options.retry.call(lambda: read_manifest(backend, where.path))
    if check_manifest is not None:
        check_manifest(manifest)
    chains = [_chain_of(where, folder, manifest, v.name, options) for v in variables]
    links = [[Location(backend, at) for at, *_ in chain] for chain in chains]
    for variable, chain, at in zip(variables, chains, links, strict=True):
        for (link, link_manifest, entry), checkpoint in zip(chain, at, strict=True):
            # nothing is sized, compared or looped over from a number not checked first
            check_link(backend, link, link_manifest.proc_size, entry, where.url)
            check_compatible(variable, entry, checkpoint.url)
    # None: read by this process; else read by the tasks of its tables (parameter servers)
    on_devices = [device_restore.plan_for(v, c, backend, topology.proc_size)
                  for v, c in zip(variables, chains, strict=True)]  # fmt: skip
    plans = [
        _plan_variable(*planned, topology)
        for planned in zip(variables, chains, links, on_devices, strict=True)
    ]
    return RestorePlan(where, manifest, topology, options, plans)


def _chain_of(
    where: Location, folder: str, manifest: Manifest, variable_name: str, options: IOOptions
) -> list[Link]:
    entry = manifest.variable(variable_name, where.url)
    if not entry.incremental:
        return [(folder, manifest, entry)]
    return chain_links(where.backend, where.path, variable_name, options.retry)


def _plan_variable(
    variable: RestoredVariable,
    chain: list[Link],
    links: list[Location],
    on_devices: DevicePlan | None,
    topology: Topology,
) -> VariablePlan:
    by_link = [_parts_to_read(entry, topology) for *_, entry in chain]
    parts = [part for link_parts in by_link for part in link_parts]
    full_rows = sum(rows for *_, rows in by_link[0])
    streamed = on_devices is None and _streams(variable, chain, topology.proc_size)
    shares = restore_shares(variable, parts)
    return VariablePlan(variable, chain, links, parts, full_rows, shares, streamed, on_devices)


def _parts_to_read(entry: VariableEntry, topology: Topology) -> list[Part]:
    """``(num_buckets, bucket, rows)`` of every part this rank reads of one link's rows."""
    return [
        part
        for record in entry.shards
        for part in shards.bucket_rows(record, topology.proc_rank, topology.proc_size)
    ]


def _streams(variable: RestoredVariable, chain: list[Link], proc_size: int) -> bool:
    """Whether ``variable``'s full link of ``chain`` is loaded while it is read: the rows
    read are then exactly the rows loaded, and a failure leaves it as it was, empty."""
    return proc_size == 1 and not chain[0][2].removed and not holds_keys(variable)
