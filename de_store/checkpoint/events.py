"""What the saver tells the ``de_store`` logger (as orbax logs its saves).

INFO, one line each: a rank's shards written, a checkpoint committed, a restore done, with
how long it took, how many bytes and rows. Retries log a WARNING with their cause (see
:mod:`de_store.checkpoint.retry`). The loggers are children of ``logging.getLogger("de_store")``:
absl's handler (installed by ``absl.app.run`` or ``absl.logging.use_absl_handler()``) shows
them at verbosity INFO, and ``logging.getLogger("de_store").setLevel(logging.WARNING)``
silences the INFO lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from de_store.checkpoint.manifest import Manifest, RankManifest, VariableEntry
from de_store.checkpoint.topology import Topology

logger = logging.getLogger("de_store.saver")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _rows(variables: Mapping[str, VariableEntry]) -> tuple[int, int]:
    """Rows and tombstones of a manifest's entries."""
    entries = variables.values()
    return sum(e.rows for e in entries), sum(e.removed_rows for e in entries)


def _removed(removed: int) -> str:
    return f" and {removed:,} removed keys" if removed else ""


def rank_saved(where: str, topology: Topology, manifest: RankManifest, start: float) -> None:
    """This rank wrote its shards of ``where`` (``start``: ``time.perf_counter()``)."""
    rows, removed = _rows(manifest.variables)
    size = sum(entry.bytes for entry in manifest.variables.values())
    logger.info(
        "saved rank %d of %d of %s: %s rows%s, %s, %d variable(s) in %.2f s",
        topology.proc_rank,
        topology.proc_size,
        where,
        f"{rows:,}",
        _removed(removed),
        _size(size),
        len(manifest.variables),
        time.perf_counter() - start,
    )


def committed(where: str, manifest: Manifest, start: float) -> None:
    """Rank 0 committed ``where``; ``start`` is when its save began."""
    rows, removed = _rows(manifest.variables)
    kind = f"a delta on {manifest.parent}" if manifest.incremental else "full"
    logger.info(
        "committed %s (%s): %s rows%s, %s from %d process(es) in %.2f s",
        where,
        kind,
        f"{rows:,}",
        _removed(removed),
        _size(manifest.bytes),
        manifest.proc_size,
        time.perf_counter() - start,
    )


def restored(
    where: str, topology: Topology, rows: int, links: int, size: int, start: float
) -> None:
    """This rank restored ``rows`` rows from ``where``, whose chain of ``links`` checkpoints
    holds ``size`` bytes of shards."""
    logger.info(
        "restored %s rows into rank %d of %d from %s (%d checkpoint(s), %s of shards) in %.2f s",
        f"{rows:,}",
        topology.proc_rank,
        topology.proc_size,
        where,
        links,
        _size(size),
        time.perf_counter() - start,
    )
