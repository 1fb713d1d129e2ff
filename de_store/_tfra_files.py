"""``Variable.save_to_file_system`` and ``load_from_file_system``: TFRA's own file layout,
written and read through :mod:`de_store.formats.tfra` on any fsspec URL (or Backend).

A save replaces the previous save of the variable on its rank as a whole: a process killed
at any point of it leaves the previous save or the new one for ``load_from_file_system``
and ``de-store convert`` (the commit record of :mod:`de_store.formats.tfra`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import tensorflow as tf

from de_store.formats import batch_from_numpy, batch_to_numpy, tfra

if TYPE_CHECKING:
    from de_store.backends import Backend

DIRPATH_ENV = "TFRA_SAVED_KV"


def folder(dirpath: str | Backend, dirpath_env: str) -> str | Backend:
    """``dirpath``, or the folder named by environment variable ``dirpath_env`` (TFRA's)."""
    return os.environ.get(dirpath_env) or dirpath


def save(variable: Any, dirpath: str | Backend, proc_size: int, proc_rank: int) -> list[str]:
    """Write ``variable`` as TFRA 0.8's ``save_to_file_system`` does: one ``-keys`` /
    ``-values`` pair per table, keys in the table TFRA's partitioner gives them."""
    keys, values = (t.numpy() for t in variable.export())
    schema = tfra.SchemaInfo(
        variable.name, variable.dim, variable.key_dtype.name, variable.value_dtype.name
    )
    batch = batch_from_numpy(keys, values, {}, schema=schema.arrow_schema())
    infos = tfra.write_table(
        dirpath,
        variable.name,
        pa.Table.from_batches([batch]),
        num_tables=len(variable.tables),
        proc_rank=proc_rank,
        proc_size=proc_size,
    )
    return [f.path for info in infos for f in info.files]


def load(variable: Any, dirpath: str | Backend) -> None:
    """Upsert every key of ``variable``'s TFRA files under ``dirpath`` (every table and
    rank), as TFRA 0.8's ``load_from_file_system`` with ``load_entire_dir``."""
    table = tfra.read_table(
        dirpath,
        variable.name,
        dim=variable.dim,
        key_dtype=variable.key_dtype.name,
        value_dtype=variable.value_dtype.name,
    )
    for batch in table.to_batches():
        keys, values, _ = batch_to_numpy(batch)
        if len(keys):
            variable.upsert(tf.constant(keys), np.asarray(values))
