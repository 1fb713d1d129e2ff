"""Checking ``storage_options`` against the options a backend's filesystem knows.

fsspec filesystems take ``**kwargs`` and most ignore the ones they do not know, so a
misspelt option (``auto_mkdirr``) would silently do nothing. For the backends whose class
sets ``storage_options_extra`` (local disk, memory, S3, GCS), the known options are the
named parameters of the filesystem class's constructors (every class of its MRO), the
options fsspec itself reads, and that tuple (options the filesystem hands on to a client
it builds). Other protocols go through unchecked: their
filesystems may pass any keyword on.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable
from typing import Any

import fsspec

from de_store.errors import StorageOptionError

from .base import Backend

#: Options fsspec's own base classes read (the listings cache, the instance cache, async).
FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache",
     "asynchronous", "loop"}
)  # fmt: skip


def check_storage_options(
    backend: type[Backend], protocol: str, options: dict[str, Any], where: str
) -> None:
    """Raise if ``options`` holds one the filesystem of ``protocol`` does not know.

    Raises
    ------
    StorageOptionError
        An unknown option; the message names it (with the closest known one) and lists
        the known options.
    """
    extra = getattr(backend, "storage_options_extra", None)
    if extra is None or not options:
        return
    fs_class = fsspec.get_filesystem_class(protocol)
    known = known_options(fs_class) | set(extra)
    unknown = sorted(set(options) - known)
    if not unknown:
        return
    hints = [_with_hint(name, known) for name in unknown]
    raise StorageOptionError(
        f"unknown storage option(s) {', '.join(hints)} for {where} ({fs_class.__name__}); "
        f"known options: {', '.join(sorted(known))}"
    )


def _with_hint(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


@functools.cache
def known_options(fs_class: type) -> frozenset[str]:
    """The keyword parameters of every constructor of ``fs_class``'s MRO, and fsspec's."""
    return frozenset(FSSPEC_OPTIONS | set(_named_parameters(fs_class.__mro__)))


def _named_parameters(classes: Iterable[type]) -> Iterable[str]:
    for cls in classes:
        init = cls.__dict__.get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        for name, param in inspect.signature(init).parameters.items():
            if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                yield name
