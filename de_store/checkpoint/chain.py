"""Chains of incremental checkpoints: a full checkpoint and the deltas saved on it.

An incremental checkpoint's manifest names its ``parent`` (see
:class:`~de_store.checkpoint.manifest.Manifest`); following the parents of one variable's
incremental entries back to its full entry gives the chain a restore applies, oldest first.
Every link must be committed, and must still be the generation the child was saved on.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.commit import read_manifest
from de_store.checkpoint.manifest import Manifest, VariableEntry
from de_store.checkpoint.retry import NO_RETRY, RetryPolicy
from de_store.errors import CheckpointError, CheckpointNotFoundError


def parent_reference(parent_url: str, child_url: str) -> str:
    """How ``child_url``'s manifest names ``parent_url``: the bare folder name when both are
    folders of the same parent URL, else the parent's absolute URL."""
    parent_head, _, parent_name = parent_url.rstrip("/").rpartition("/")
    child_head = child_url.rstrip("/").rpartition("/")[0]
    return parent_name if parent_head == child_head else parent_url.rstrip("/")


def parent_folder(backend: Backend, name: str, parent: str) -> str:
    """The folder (within ``backend``) of the parent ``parent`` of checkpoint ``name``.

    Raises ``CheckpointError`` for an absolute parent URL outside ``backend``.
    """
    if "://" not in parent and not parent.startswith("/"):
        return posixpath.join(posixpath.dirname(name.strip("/")), parent)
    root = Location(backend).url + "/"
    if parent.startswith(root):
        return parent[len(root) :]
    raise CheckpointError(
        f"checkpoint {Location(backend, name).url} is a delta on {parent}, outside {backend.url}: "
        "chains must stay within one location"
    )


def iter_manifests(
    backend: Backend, name: str, retry: RetryPolicy = NO_RETRY
) -> Iterator[tuple[str, Manifest]]:
    """``(folder, manifest)`` of ``name`` and then of each parent in turn, newest first,
    until a checkpoint without a parent; every link is checked as :func:`resolve_chain` does.
    """
    link, child, expected_created = name.strip("/"), None, None
    seen: set[str] = set()
    while True:
        if link in seen:
            raise CheckpointError(f"checkpoint {Location(backend, link).url} is its own ancestor")
        seen.add(link)
        folder, manifest = _read_link(backend, link, child, retry)
        if expected_created is not None and manifest.created != expected_created:
            raise CheckpointError(
                f"checkpoint {Location(backend, child or link).url} depends on "
                f"{Location(backend, link).url}, which was rewritten after it was saved (its "
                f"manifest was created at {manifest.created}, expected {expected_created})"
            )
        yield folder, manifest
        if manifest.parent is None:
            return
        child, expected_created = link, manifest.parent_created
        link = parent_folder(backend, link, manifest.parent)


def resolve_chain(
    backend: Backend, name: str, variable_name: str, retry: RetryPolicy = NO_RETRY
) -> list[tuple[str, VariableEntry]]:
    """The chain that restores ``variable_name`` from checkpoint ``name``: ``(folder,
    entry)`` per link, oldest (the full entry) first. ``folder`` holds the link's committed
    files within ``backend`` (shard paths are relative to it).

    Raises
    ------
    CheckpointNotFoundError
        ``name`` or a link it depends on does not exist (the message names both).
    CheckpointError
        A link is not committed, was rewritten since, or lacks the variable.
    """
    links = chain_links(backend, name, variable_name, retry)
    return [(folder, entry) for folder, _, entry in links]


def chain_links(
    backend: Backend, name: str, variable_name: str, retry: RetryPolicy = NO_RETRY
) -> list[tuple[str, Manifest, VariableEntry]]:
    """:func:`resolve_chain` with each link's manifest: ``(folder, manifest, entry)``."""
    chain: list[tuple[str, Manifest, VariableEntry]] = []
    previous = name.strip("/")
    for folder, manifest in iter_manifests(backend, name, retry):
        where = Location(backend, folder).url
        if variable_name not in manifest.variables and chain:
            raise CheckpointError(
                f"checkpoint {Location(backend, previous).url} saved variable {variable_name!r} "
                f"as a delta on {where}, which has no variable {variable_name!r}"
            )
        entry = manifest.variable(variable_name, where)
        chain.append((folder, manifest, entry))
        if not entry.incremental:
            return chain[::-1]
        if manifest.parent is None:
            raise CheckpointError(
                f"checkpoint {where}: variable {variable_name!r} is incremental but the "
                "manifest names no parent"
            )
        previous = folder
    raise AssertionError("iter_manifests ended on a manifest with a parent")  # pragma: no cover


def _read_link(
    backend: Backend, link: str, child: str | None, retry: RetryPolicy
) -> tuple[str, Manifest]:
    try:
        return retry.call(lambda: read_manifest(backend, link))
    except CheckpointNotFoundError as err:
        if child is None:
            raise
        needed = (
            f"checkpoint {Location(backend, child).url} depends on {Location(backend, link).url}"
        )
        if backend.exists(link) or backend.exists(names.pending_folder(link)):
            raise CheckpointError(
                f"{needed}, which is not committed (no {names.COMMIT_PREFIX}* marker): its "
                "save failed or is still running"
            ) from err
        raise CheckpointNotFoundError(
            f"{needed}, which does not exist: every link of an incremental chain is needed"
        ) from err
