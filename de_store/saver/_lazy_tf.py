"""``tensorflow``, imported when first used.

The saver's data path below the tables (shard formats, rank manifests, barrier, merge,
commit, reads) runs on numpy rows; only moving rows in and out of the tables needs
TensorFlow. Importing it on first use lets processes that only write or read rows, such
as the ranks of ``benchmarks/scale_bench.py``, skip its import time and memory.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf
else:

    class _TensorFlow:
        def __getattr__(self, name: str) -> Any:
            import tensorflow

            return getattr(tensorflow, name)

    tf = _TensorFlow()

__all__ = ["on_device", "tf"]


def on_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """``tf.device(device)``, holding the lock of eager ops off the host's first CPU
    (:func:`de_store.tables._locking.on_device`), TensorFlow imported when first used."""
    from de_store.tables._locking import on_device as locked

    return locked(device)
