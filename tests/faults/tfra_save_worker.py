"""One process of a TFRA-layout crash test: saves version 1 of a two-table variable in TFRA's
file layout, then version 2 through a FaultyFileSystem that may SIGKILL it inside the save.

    python tfra_save_worker.py CONFIG_JSON

CONFIG keys: ``root`` (the folder), ``kill_at`` ([kind, k] or null), ``trace_out`` (JSON
file of the calls of the second save), ``variable`` (save through a real
``de_store.Variable.save_to_file_system``; otherwise through
``de_store.formats.tfra.write_table`` with TensorFlow stubbed out, which starts in about a
second).
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np

DIM = 4
NAME = "emb"
#: The same keys in both versions: the files of the two saves have the same sizes.
KEYS = np.arange(-300, 300, dtype=np.int64) * 7


def values(version: int) -> np.ndarray:
    """The rows of ``KEYS`` in version ``version``."""
    return (KEYS[:, None] * np.arange(1, DIM + 1) / 8 + version).astype(np.float32)


def _stub_tensorflow() -> None:
    stub = types.ModuleType("tensorflow")

    def no_tf(name: str) -> object:
        raise ImportError(f"tensorflow.{name} used in a worker that runs without TensorFlow")

    stub.__getattr__ = no_tf  # type: ignore[method-assign]
    sys.modules.setdefault("tensorflow", stub)


def main(config: dict) -> None:
    if not config.get("variable"):
        _stub_tensorflow()
    import fsspec

    from de_store.backends import open_backend
    from de_store.testing.faults import FaultPlan, FaultyFileSystem

    kill_at = tuple(config["kill_at"]) if config.get("kill_at") else None
    plan = FaultPlan(kill_at=kill_at, active=False)  # type: ignore[arg-type]
    backend = open_backend(FaultyFileSystem(fsspec.filesystem("file"), plan), root=config["root"])
    save = _variable_save() if config.get("variable") else _table_save()
    save(backend, 1)
    plan.active = True
    try:
        save(backend, 2)
    finally:
        if config.get("trace_out"):
            with open(config["trace_out"], "w") as f:
                json.dump(plan.trace, f)


def _table_save():  # type: ignore[no-untyped-def]
    import pyarrow as pa

    from de_store.formats import batch_from_numpy, tfra

    def save(backend, version: int) -> None:  # type: ignore[no-untyped-def]
        table = pa.Table.from_batches([batch_from_numpy(KEYS, values(version))])
        tfra.write_table(backend, NAME, table, num_tables=2)

    return save


def _variable_save():  # type: ignore[no-untyped-def]
    import de_store as ds

    variable = ds.Variable(NAME, dim=DIM, devices=["/CPU:0", "/CPU:0"])

    def save(backend, version: int) -> None:  # type: ignore[no-untyped-def]
        variable.upsert(KEYS, values(version))
        variable.save_to_file_system(backend)

    return save


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
