"""The tables a follower keeps up to date, found in what the user hands it.

- de_store ``Variable`` s, alone, in a list, tuple or dict;
- a Keras model, layer or any ``tf.Module`` / trackable object: every ``Variable`` it
  tracks, at any depth (the companions of a Variable, its optimizer slots, are not
  followed: serving reads values only);
- a SavedModel exported by de_store and loaded with ``tf.saved_model.load``: its tables
  are objects holding ``_shards``, each with the variables of a table core and its mutex;
  the saved variable names (``{name}_shard_{i}_of_{n}/values``) give the de_store name. A
  ``Variable`` is built around those loaded variables and mutex, so that the follower's
  upserts and the SavedModel's lookups use the same tables under the same lock.
"""

from __future__ import annotations

import re
from typing import Any

from de_store.errors import VariableError

#: A table core's variables, as ``HashTable`` names them (and a SavedModel keeps them).
_STATE = ("index", "values", "free_rows", "num_keys", "num_deleted", "num_free", "next_row",
          "stamps", "epoch", "removed", "removed_at", "num_removed", "row_keys")  # fmt: skip
_SAVED_NAME = re.compile(r"(?P<name>.+)_shard_(?P<shard>\d+)_of_(?P<count>\d+)/values:\d+")


def find_variables(found: Any) -> dict[str, Any]:
    """Variable name -> the Variable to keep up to date, from ``found`` (see the module).

    Raises
    ------
    VariableError
        Nothing to follow was found, or two tables have the same name.
    """
    from de_store.variable import Variable

    out: dict[str, Any] = {}
    seen: set[int] = set()

    def add(variable: Any) -> None:
        if variable.name in out and out[variable.name] is not variable:
            raise VariableError(f"two followed tables are named {variable.name!r}")
        out[variable.name] = variable

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Variable):
            add(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif _is_saved_table(obj):
            add(_bound_variable(obj))
        else:
            for child in _children(obj):
                visit(child)

    visit(found)
    if not out:
        raise VariableError(
            f"found no de_store table to follow in {type(found).__name__}: expected "
            "Variables, a model or module holding them, or a SavedModel loaded by "
            "tf.saved_model.load that de_store exported"
        )
    return out


def _children(obj: Any) -> list[Any]:
    children = getattr(obj, "_trackable_children", None)
    if children is None:
        return []
    try:
        return list(children().values())
    except Exception:  # an object that cannot list its children holds no table we know
        return []


def _is_saved_table(obj: Any) -> bool:
    shards = getattr(obj, "_shards", None)
    if shards is None or not len(shards):  # a ListWrapper
        return False
    return all(hasattr(shard, "_mutex") and all(hasattr(shard, s) for s in _STATE)
               for shard in shards)  # fmt: skip


def _bound_variable(saved: Any) -> Any:
    """A Variable whose table cores are the loaded variables and mutexes of ``saved``."""
    import tensorflow as tf

    from de_store.tables.hash_table import HashTable
    from de_store.variable import Variable

    shards = list(saved._shards)
    match = _SAVED_NAME.fullmatch(shards[0].values.name)
    if match is None or int(match["count"]) != len(shards):
        raise VariableError(
            f"a loaded SavedModel table has variables named {shards[0].values.name!r}: "
            "expected '{name}_shard_{i}_of_{n}/values:0', as de_store saves them"
        )
    values = shards[0].values
    device = values.device or "/CPU:0"
    variable = Variable(match["name"], tf.int64, values.dtype, int(values.shape[-1]),
                        devices=[device] * len(shards))  # fmt: skip
    for core, loaded in zip(variable.shards, shards, strict=True):
        if not isinstance(core, HashTable):
            raise VariableError(f"variable {match['name']!r}: only HashTable cores can follow "
                                "a loaded SavedModel")  # fmt: skip
        core.adopt([getattr(loaded, s) for s in _STATE], loaded._mutex)
    return variable
