"""A small TFRA 0.8.1 ``FileSystemSaver`` folder, for the docs' snippets and conversion tests.

>>> folder = tfra_sample()                 # .../TFRADynamicEmbedding in a new temporary folder
>>> folder = tfra_sample(tmp, rows=10, dim=4, num_tables=1)

The files are written by :func:`de_store.formats.tfra.write_table`, in the layout TFRA's
``FileSystemSaver`` writes (the tests compare it with files TFRA wrote); no TensorFlow is
imported.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pyarrow as pa

from de_store.formats import tfra


def tfra_sample(
    directory: str | None = None,
    *,
    name: str = "user_emb",
    rows: int = 100,
    dim: int = 8,
    num_tables: int = 2,
) -> str:
    """Write TFRA variable ``name`` with ``rows`` keys into ``{directory}/TFRADynamicEmbedding``.

    Parameters
    ----------
    directory:
        The TF checkpoint folder to write into; a new temporary folder when None.
    name, rows, dim:
        The variable's name, number of keys and row width. Keys are ``-(rows // 2)`` to
        ``rows - rows // 2 - 1`` (TFRA files hold negative keys too), row ``k`` holds
        ``k / 1000`` in each of its ``dim`` float32 columns.
    num_tables:
        Tables of the variable (TFRA makes one per device); key ``k`` goes to table
        ``k mod num_tables``, as TFRA's default partitioner puts it. One rank.

    Returns
    -------
    str
        The URL of the ``TFRADynamicEmbedding`` folder (what ``de-store convert`` reads,
        with ``--dim``).
    """
    if rows < 0 or dim < 1:
        raise ValueError(f"tfra_sample needs rows >= 0 and dim >= 1, got rows={rows}, dim={dim}")
    directory = directory or tempfile.mkdtemp(prefix="de_store_tfra_sample_")
    folder = f"{directory.rstrip('/')}/{tfra.FOLDER}"
    keys = np.arange(rows, dtype=np.int64) - rows // 2
    values = np.repeat((keys / 1000).astype(np.float32), dim)
    table = pa.table(
        {
            "key": pa.array(keys),
            "value": pa.FixedSizeListArray.from_arrays(pa.array(values), dim),
        }
    )
    tfra.write_table(folder, name, table, num_tables=num_tables)
    return folder
