"""Incremental saves: when a save may write only what changed, and what it is based on.

Each Variable's ``change_base`` (a :class:`ChangeBase`) is the last committed checkpoint
of that variable and the snapshot mark it was taken at. A save with an
:class:`IncrementalPolicy` takes a new mark and, unless the policy calls for a full save,
exports only the rows changed since the base's mark (a delta whose parent is the base).
The decision uses only what every rank knows alike (the committed manifests), so all ranks
of a save decide the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from de_store.checkpoint.chain import parent_reference
from de_store.checkpoint.manifest import Manifest, VariableEntry
from de_store.checkpoint.variable_rows import ChangeBase, VariableRows
from de_store.saver.rows import SavedVariable, column_specs, export_delta, export_rows


@dataclasses.dataclass(frozen=True)
class IncrementalPolicy:
    """When an incremental save writes a full checkpoint instead of a delta.

    Attributes
    ----------
    full_every:
        A full save at least every ``full_every`` saves: a chain (its full checkpoint and
        the deltas on it) never gets longer than this. 1 makes every save full.
    max_chain_ratio:
        A full save when the deltas of the chain so far hold more than this share of the
        bytes of the chain's full checkpoint (restores read all of them).
    """

    full_every: int = 10
    max_chain_ratio: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int):
            raise ValueError(f"full_every must be an int >= 1, got {self.full_every!r}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be an int >= 1, got {self.full_every!r}")
        if not isinstance(self.max_chain_ratio, (int, float)) or not self.max_chain_ratio > 0:
            raise ValueError(f"max_chain_ratio must be a number > 0, got {self.max_chain_ratio!r}")


def policy_of(incremental: IncrementalPolicy | bool | None) -> IncrementalPolicy | None:
    """The policy an ``incremental=`` option asks for: True is the default one."""
    if incremental is None or incremental is False:
        return None
    if incremental is True:
        return IncrementalPolicy()
    if not isinstance(incremental, IncrementalPolicy):
        raise ValueError(f"incremental must be a bool or an IncrementalPolicy, got {incremental!r}")
    return incremental


def full_save_reason(
    policy: IncrementalPolicy,
    base: ChangeBase | None,
    variable: SavedVariable,
    url: str | None,
    location: str | None = None,
) -> str | None:
    """Why ``variable``'s save into ``url`` must be full, or None when a delta will do.

    An async snapshot is taken before its target is known: ``url`` is None and
    ``location`` the parent URL it is expected in (None: not known, the save is full).
    """
    if base is None:
        return "no committed checkpoint of it since it was created, cleared or last failed"
    if column_specs(variable) != base.columns:
        return f"its columns changed since {base.url}"
    if url is not None and not is_sibling(base.url, url):
        return f"{url} is not a new folder beside its base {base.url}"
    if url is None and location is None:
        return "the target of the async save is not known yet"
    if url is None and location_of(base.url) != location:
        return f"its base {base.url} is not in {location}, where the async saves go"
    if base.chain_length >= policy.full_every:
        return f"the chain has {base.chain_length} links (full_every={policy.full_every})"
    if base.delta_bytes > policy.max_chain_ratio * base.full_bytes:
        return (
            f"the chain's deltas hold {base.delta_bytes} bytes, over {policy.max_chain_ratio} "
            f"of its full save's {base.full_bytes}"
        )
    return None


def location_of(url: str) -> str:
    """The parent URL of a checkpoint folder."""
    return url.rstrip("/").rpartition("/")[0]


def is_sibling(base_url: str, url: str) -> bool:
    """Whether ``url`` is another folder of the same parent URL as ``base_url``."""
    reference = parent_reference(base_url, url)
    return reference != base_url.rstrip("/") and reference != url.rstrip("/").rpartition("/")[2]


def tracks_changes(variable: SavedVariable) -> bool:
    """Whether every table of ``variable`` (companions too) tracks changes."""
    tables = getattr(variable, "all_tables", None)
    return tables is not None and all(getattr(t, "track_changes", False) for t in tables())


def snapshot(
    variable: SavedVariable,
    policy: IncrementalPolicy | None,
    url: str | None,
    location: str | None = None,
) -> VariableRows:
    """A save's rows of ``variable`` (eagerly): a delta on its ``change_base`` when the
    policy allows (see :func:`full_save_reason`), else every row; with a policy, marked so
    the next save can be a delta.

    Tables that do not track changes (``HashTableCreator(track_changes=False)``) always
    save full.
    """
    if policy is None or not tracks_changes(variable):
        return export_rows(variable)
    current = variable.change_base if isinstance(variable.change_base, ChangeBase) else None
    candidates = current.candidates() if current is not None else []
    mark = variable.next_change_epoch()
    if candidates:  # no later delta is taken since an older mark
        for table in variable.all_tables():
            table.forget_removed(min(base.mark for base in candidates))
    base = next((b for b in candidates if _located(b, url, location)), current)
    if base is None or full_save_reason(policy, base, variable, url, location) is not None:
        return dataclasses.replace(export_rows(variable), mark=mark)
    return dataclasses.replace(export_delta(variable, base.mark), mark=mark, base=base)


def _located(base: ChangeBase, url: str | None, location: str | None) -> bool:
    """Whether a delta on ``base`` may go to ``url`` (or, not known yet, to ``location``)."""
    if url is not None:
        return is_sibling(base.url, url)
    return location is not None and location_of(base.url) == location


def snapshots(
    variables: Sequence[SavedVariable], policy: IncrementalPolicy | None, url: str | None
) -> list[VariableRows]:
    """:func:`snapshot` of variables saved together: the deltas of one checkpoint apply
    on one parent, so when their bases differ, all of them are saved full instead."""
    rows = [snapshot(v, policy, url) for v in variables]
    bases = {(r.base.url, r.base.created) for r in rows if r.base is not None}
    if len(bases) <= 1:
        return rows
    return [
        dataclasses.replace(export_rows(v), mark=r.mark) if r.incremental else r
        for v, r in zip(variables, rows, strict=True)
    ]


def record_commit(
    variable: SavedVariable, rows: VariableRows, url: str, manifest: Manifest
) -> None:
    """After ``rows`` committed as ``url``: the variable's next delta applies on it."""
    if rows.mark is None:
        return
    entry = manifest.variables[rows.name]
    if rows.base is not None:
        old = rows.base
        length, full, deltas = old.chain_length + 1, old.full_bytes, old.delta_bytes + entry.bytes
    else:
        length, full, deltas = 1, entry.bytes, 0
    previous = _elsewhere(variable.change_base, url)
    _set_base(variable, ChangeBase(url, rows.mark, manifest.created, length, full, deltas,
                                   dict(entry.columns), previous))  # fmt: skip


def _elsewhere(current: ChangeBase | None, url: str) -> ChangeBase | None:
    """The newest base among ``current``'s candidates in another location than ``url``."""
    if not isinstance(current, ChangeBase):
        return None
    for base in current.candidates():
        if location_of(base.url) != location_of(url):
            return dataclasses.replace(base, previous=None)
    return None


def record_failure(variable: SavedVariable) -> None:
    """After a failed save: nothing is known to be committed, the next save is full."""
    _set_base(variable, None)


def record_restore(
    variable: SavedVariable, url: str, manifest: Manifest, chain: Sequence[VariableEntry]
) -> None:
    """After ``variable`` was restored from ``url`` (whose chain is ``chain``, oldest
    first): its next delta applies on that checkpoint."""
    if not tracks_changes(variable):
        return
    deltas = sum(entry.bytes for entry in chain[1:])
    base = ChangeBase(url, variable.next_change_epoch(), manifest.created, len(chain),
                      chain[0].bytes, deltas, dict(chain[-1].columns))  # fmt: skip
    _set_base(variable, base)


def _set_base(variable: SavedVariable, base: ChangeBase | None) -> None:
    # tf.Module would track an attribute set the usual way
    object.__setattr__(variable, "change_base", base)
