"""A layer's table as its weights in a Keras file (``.keras``, ``.weights.h5``).

The entry ``layer`` holds the name of the layer that saved the tables (UTF-8 bytes): Keras
finds a layer's weights by the layer's class and position in the model, not its name, so
a model whose de_store layers come in another order, or another layer's file, would
otherwise load one table into another. Each table, the Variable's and each companion's
(optimizer slots), is three entries of the layer's weights: ``{prefix}keys`` ``[n]``,
``{prefix}values`` ``[n, width]`` and ``{prefix}crc32c``, the crc32c of the keys' bytes and
of the values' bytes (two uint32). The prefix is ``""`` for the Variable and
``"{column}."`` for a companion.

The crc32c is there because nothing else checks the rows: HDF5 keeps no checksum of dataset
data, a ``.weights.h5`` file is plain HDF5, and the CRC-32 of a ``.keras`` zip member is
verified only while a reader goes through the member to its end: from Python 3.12 on,
zipfile stops checking it once a reader seeks forward in an uncompressed member, as h5py
does when Keras reads the weights from the zip without extracting them (``load_weights``
of a ``.keras`` file, and ``load_model`` when reading the member whole failed).

Loading reads and checks every entry (names, dtypes, shapes, crc32c) before it changes any
table, so a file that does not fit the layer leaves its tables as they were. Files saved
before the ``layer`` and ``crc32c`` entries existed (``{prefix}keys`` and
``{prefix}values`` only) still load, with every check but those two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from de_store.errors import ChecksumError, FormatError, VariableError
from de_store.formats._crc32c import crc32c as _crc32c

#: The entries of one table, after its prefix.
ENTRIES = ("keys", "values", "crc32c")
#: The entries of one table in files saved before the crc32c and ``layer`` entries.
UNCHECKED_ENTRIES = ("keys", "values")
#: The entry holding the saving layer's name.
LAYER = "layer"


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """One table's rows as a Keras file holds them, checked against the layer."""

    column: str  # "" for the Variable, else the companion's column
    keys: np.ndarray
    values: np.ndarray


def save_tables(store: Any, variable: Any, layer: str) -> None:
    """Write the rows of ``variable`` and of each of its companions into ``store``, as
    layer ``layer``'s."""
    store[LAYER] = np.frombuffer(layer.encode(), np.uint8)
    for prefix, table in _tables(variable).items():
        keys, values = (t.numpy() for t in table.export())
        store[f"{prefix}keys"] = keys
        store[f"{prefix}values"] = values
        store[f"{prefix}crc32c"] = np.array([crc32c(keys), crc32c(values)], np.uint32)


def load_tables(store: Any, variable: Any, layer: str) -> None:
    """Replace the rows of ``variable`` and its companions by those ``store`` holds.

    Raises FormatError (entries missing or foreign), VariableError (saved by a layer of
    another name, dtype or width not the layer's, keys and rows of different counts) or
    ChecksumError (crc32c), naming ``layer``, before any table changes.
    """
    stored = read_tables(store, variable, layer)
    variable.clear()  # the Variable and every companion
    for table in stored:
        target = variable
        if table.column:
            dtype = tf.as_dtype(table.values.dtype)
            target = variable.companion(table.column, table.values.shape[1], dtype)
        if len(table.keys):
            target.upsert(table.keys, table.values)


def read_tables(store: Any, variable: Any, layer: str) -> list[StoredTable]:
    """Every table ``store`` holds for the layer, checked; the Variable's first."""
    names = list(store.keys())
    prefixes = _prefixes([n for n in names if n != LAYER], layer, names)
    checked = LAYER in names  # else saved before the layer and crc32c entries
    saved_by = bytes(np.asarray(store[LAYER], np.uint8)).decode(errors="replace") if checked \
        else layer  # fmt: skip
    if saved_by != layer:
        raise VariableError(
            f"layer '{layer}': the weights file holds the table of layer '{saved_by}' here "
            "(Keras matches weights by layer class and position, not by name): expected "
            f"layer '{layer}'"
        )
    companions = variable.companions()
    out = []
    for prefix in prefixes:
        column = prefix[:-1]
        keys, values = np.asarray(store[f"{prefix}keys"]), np.asarray(store[f"{prefix}values"])
        what = f"companion '{column}'" if column else "table"
        _check_shapes(keys, values, variable, layer, what)
        target = companions.get(column) if column else variable
        if target is not None:
            _check_width(values, target, layer, what)
        if checked:
            _check_crc(np.asarray(store[f"{prefix}crc32c"]), keys, values, layer, what)
        out.append(StoredTable(column, keys, values))
    return out


def crc32c(array: np.ndarray) -> int:
    """crc32c of an array's bytes, little-endian."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return _crc32c(np.ascontiguousarray(array))


def _tables(variable: Any) -> dict[str, Any]:
    return {"": variable, **{f"{c}.": v for c, v in sorted(variable.companions().items())}}


def _prefixes(names: list[str], layer: str, found: list[str]) -> list[str]:
    """The table prefixes of entry ``names``, ``""`` first; FormatError unless every name is
    one of the three entries of a table, the Variable's table is there and ``found`` (every
    entry) holds the layer's name."""
    prefixes: dict[str, set[str]] = {}
    foreign = []
    for name in names:
        entry = next((e for e in ENTRIES if name.endswith(e)), "")
        prefix = name[: len(name) - len(entry)]
        if entry and (prefix == "" or prefix.endswith(".")):
            prefixes.setdefault(prefix, set()).add(entry)
        else:
            foreign.append(name)
    layout = set(ENTRIES) if LAYER in found else set(UNCHECKED_ENTRIES)
    incomplete = any(e != layout for e in prefixes.values())
    if foreign or incomplete or "" not in prefixes:
        raise FormatError(
            f"layer '{layer}': expected the entries {LAYER}, {', '.join(ENTRIES)} of a "
            "de_store table (and keys, values, crc32c of each companion, prefixed 'column.') "
            f"in the weights file, found {sorted(found) or 'none'}"
        )
    return sorted(prefixes)


def _check_shapes(
    keys: np.ndarray, values: np.ndarray, variable: Any, layer: str, what: str
) -> None:
    expected_keys = np.dtype(variable.key_dtype.as_numpy_dtype)
    if keys.dtype != expected_keys:
        raise VariableError(
            f"layer '{layer}': the weights file holds {keys.dtype} keys, expected "
            f"{variable.key_dtype.name} (the {what}'s key_dtype)"
        )
    if keys.ndim != 1 or values.ndim != 2 or len(keys) != len(values):
        raise VariableError(
            f"layer '{layer}': the weights file holds {len(keys)} keys and {len(values)} rows "
            f"for its {what} (shapes {list(keys.shape)} and {list(values.shape)}), expected "
            "[n] keys and [n, width] rows"
        )


def _check_width(values: np.ndarray, target: Any, layer: str, what: str) -> None:
    found = f"{values.shape[1]} {tf.as_dtype(values.dtype).name}"
    expected = f"{target.dim} {target.value_dtype.name}"
    if found != expected:
        size = "embedding_size" if what == "table" else f"the {what}'s width"
        raise VariableError(
            f"layer '{layer}': the weights file holds {what} rows of {found} values, "
            f"expected {size} {expected} values"
        )


def _check_crc(
    saved: np.ndarray, keys: np.ndarray, values: np.ndarray, layer: str, what: str
) -> None:
    if saved.shape != (2,) or saved.dtype.kind not in "iu":
        raise FormatError(
            f"layer '{layer}': the crc32c entry of its {what} should hold 2 integers, found "
            f"{saved.dtype} of shape {list(saved.shape)}"
        )
    for part, array, expected in (("keys", keys, saved[0]), ("values", values, saved[1])):
        found = crc32c(array)
        if found != int(expected):
            raise ChecksumError(
                f"layer '{layer}': the {part} of its {what} in the weights file do not match "
                f"the crc32c saved with them (expected 0x{int(expected):08x}, "
                f"found 0x{found:08x})"
            )
