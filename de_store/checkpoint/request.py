"""A save request, checked once, where it enters the library.

Each way into a save (``de_store.save``, the TF hook's save, ``saver.core.save_checkpoint``)
calls :func:`check_save_request` before it takes a snapshot or writes anything; what it
calls after that trusts the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from de_store.backends.location import Location
from de_store.checkpoint.destination import check_destination


def check_save_request(where: Location, names: Sequence[str], paths: Sequence[str] = ()) -> None:
    """Refuse a save of variables named ``names`` as the checkpoint ``where`` that cannot
    be done: two variables of one name (:func:`check_unique_names`), a destination that
    cannot take the checkpoint (:func:`~de_store.checkpoint.destination.check_destination`).

    Raises
    ------
    ValueError
        Two variables share a name.
    DestinationError
        A file is in the way, or a local folder cannot be written.
    """
    check_unique_names(names, where.url, paths)
    check_destination(where.backend, where.path)


def check_unique_names(names: Sequence[str], where: str, paths: Sequence[str] = ()) -> None:
    """Refuse two variables of one name in one checkpoint: one's rows would replace the
    other's. ``paths`` name the variables (TF checkpoint paths); positions when not given.

    Raises
    ------
    ValueError
        Two variables share a name; the message names both.
    """
    first: dict[str, int] = {}
    for index, name in enumerate(names):
        if name not in first:
            first[name] = index
            continue
        which = [paths[i] if paths else f"variables[{i}]" for i in (first[name], index)]
        raise ValueError(
            f"cannot save {where}: {which[0]} and {which[1]} are both named {name!r}; the "
            "variables of one checkpoint need distinct names (give each its own name=)"
        )
