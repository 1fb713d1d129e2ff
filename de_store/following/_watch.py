"""What a follower sees of a checkpoint root: the committed checkpoints, and the links
that take its tables from the checkpoint they hold to the newest one.

One poll is one listing of the root (every file under it): a folder holding a
``COMMIT-*`` record outside any staging folder (``NAME.pending``) or moved-aside copy
(``NAME.replaced-*``) is a committed checkpoint, at its highest generation. Its commit time
comes from that record, read once per ``(folder, generation)``.

The links to apply are found by walking parents from the newest checkpoint back, one
manifest per link, until each followed variable reaches either the checkpoint the
follower last applied (same folder, same manifest ``created``: its deltas apply on top)
or a full entry (a full load, then the deltas after it). The last applied checkpoint
itself is never read again, so gc may delete it once a newer full checkpoint exists.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from de_store.backends import Backend, Location
from de_store.checkpoint import names
from de_store.checkpoint.chain import iter_manifests, parent_folder
from de_store.checkpoint.commit import committed_generations_in
from de_store.checkpoint.manifest import Manifest, VariableEntry
from de_store.checkpoint.retry import RetryPolicy
from de_store.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed checkpoint of the root: its folder, generation and commit time."""

    folder: str
    generation: int
    committed: float


@dataclasses.dataclass(frozen=True)
class Held(Committed):
    """The checkpoint a follower's tables hold, with its manifest's ``created`` (what a
    delta saved on it names as its parent's)."""

    created: float


@dataclasses.dataclass(frozen=True)
class Link:
    """One link to apply to one variable: the folder it was saved in, its entry and the
    number of processes that saved it."""

    folder: str
    entry: VariableEntry
    proc_size: int


@dataclasses.dataclass(frozen=True)
class Update:
    """What takes the followed variables to the checkpoint ``target``.

    ``links[name]`` are the links of variable ``name`` in the order they apply; ``full``
    names the variables whose first link is a full load (it replaces their content).
    """

    target: Committed
    manifest: Manifest
    links: dict[str, list[Link]]
    full: frozenset[str]


def committed_generations(backend: Backend) -> dict[str, int]:
    """Every committed checkpoint folder under ``backend`` -> its highest generation, from
    one listing."""
    return {
        folder: generation
        for folder, generation in committed_generations_in(backend.list("")).items()
        if not any(names.is_pending(p) or names.REPLACED_INFIX in p for p in folder.split("/"))
    }


def plan_update(
    backend: Backend,
    target: Committed,
    variables: Sequence[str],
    held: Held | None,
    retry: RetryPolicy,
) -> Update:
    """The links that take ``variables`` from ``held`` to ``target``.

    The chain is walked as a restore walks it (:func:`~de_store.checkpoint.chain.iter_manifests`:
    every link committed, none rewritten since its child was saved), newest first, and left
    before the parent is read once that parent is ``held``.

    Raises
    ------
    CheckpointError
        A link of the chain is missing, not committed, rewritten since its child was saved
        (the chain is broken), or a variable is not in the checkpoint.
    """
    links: dict[str, list[Link]] = {name: [] for name in variables}
    pending, full = set(variables), set()
    walk = iter_manifests(backend, target.folder, retry)
    top_folder, manifest = next(walk)
    top = Location(backend, top_folder).url
    for name in variables:
        manifest.variable(name, top)  # a followed variable missing: refused up front
    for folder, link_manifest in itertools.chain([(top_folder, manifest)], walk):
        for name in sorted(pending):
            entry = link_manifest.variables.get(name)
            if entry is None:
                raise CheckpointError(
                    f"checkpoint {top}: variable {name!r} is a delta on "
                    f"{Location(backend, folder).url}, which has no variable {name!r}"
                )
            links[name].append(Link(folder, entry, link_manifest.proc_size))
            if not entry.incremental:
                full.add(name)
                pending.discard(name)
        if not pending or _saved_on(backend, folder, link_manifest, held):
            break  # the rest applies on what the tables hold
    else:
        raise CheckpointError(
            f"checkpoint {top}: variables {sorted(pending)} are incremental but their chain "
            "ends on a manifest that names no parent"
        )
    return Update(target, manifest, {name: ls[::-1] for name, ls in links.items()},
                  frozenset(full))  # fmt: skip


def _saved_on(backend: Backend, folder: str, manifest: Manifest, held: Held | None) -> bool:
    """Whether ``manifest`` (of ``folder``) is a delta saved on the checkpoint ``held``."""
    if held is None or manifest.parent is None:
        return False
    parent_at = parent_folder(backend, folder, manifest.parent)
    return (parent_at, manifest.parent_created) == (held.folder, held.created)
