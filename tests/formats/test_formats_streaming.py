"""Writing and reading stream: peak memory stays far below the shard's size.

A fresh interpreter writes and reads a 2M-row, dim-16 shard (~144 MB) per format with
``buffer_size=65536`` (~4.5 MB a part) and reports the peak of Python/numpy allocations
(tracemalloc) and of Arrow's memory pool; both must stay under 40 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, tracemalloc
    import numpy as np, pyarrow as pa
    from de_store.backends import open_backend
    from de_store.formats import SchemaInfo, batch_from_numpy, get_format

    ROWS, DIM, BUFFER = 2_000_000, 16, 65536
    backend = open_backend(sys.argv[1])

    def batches():
        for start in range(0, ROWS, 100_000):  # the batch in hand: 100k rows
            keys = np.arange(start, start + 100_000, dtype=np.int64)
            yield batch_from_numpy(keys, np.full((100_000, DIM), start, np.float32))

    result = {}
    for name in ("binary", "arrow", "parquet"):
        fmt = get_format(name)
        tracemalloc.start()
        info = fmt.write(backend, name + fmt.suffix, batches(), schema_info=SchemaInfo("e", DIM),
                         buffer_size=BUFFER)
        rows = checksum = 0
        for batch in fmt.read(backend, info.path, expected=info, buffer_size=BUFFER):
            rows += batch.num_rows
            checksum += int(batch.column(0).to_numpy()[-1])
        python_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        pool_peak = pa.default_memory_pool().max_memory()
        result[name] = {"bytes": info.bytes, "rows": rows, "last_keys_sum": checksum,
                        "python_peak": python_peak, "arrow_pool_peak": pool_peak}
        for file in info.files:
            backend.delete(file.path)
    print(json.dumps(result))
    """
)


@pytest.mark.slow
def test_large_shard_streams_with_bounded_memory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 40 << 20
    for name, figures in result.items():
        assert figures["rows"] == 2_000_000, name
        assert figures["bytes"] > 130 << 20, name
        assert figures["python_peak"] < bound, (name, figures)
        assert figures["arrow_pool_peak"] < bound, (name, figures)


def test_closing_map_ahead_early_does_not_wait_for_running_calls() -> None:
    """The garbage collector closes an abandoned iterator in whichever thread it runs,
    possibly one holding a lock of ``threading`` that a pool thread takes to end: closing
    must return without joining, the running call left to finish on its own."""
    import threading

    from de_store.formats._shard import map_ahead

    release, finished = threading.Event(), threading.Event()

    def call(item: int) -> int:
        if item == 1:
            release.wait(30)
            finished.set()
        return item

    results = map_ahead(call, range(5), depth=2, name="test")
    assert next(results) == 0  # calls 1 and 2 were submitted; call 1 waits
    closer = threading.Thread(target=results.close)
    closer.start()
    closer.join(10)
    try:
        assert not closer.is_alive()  # close returned...
        assert not finished.is_set()  # ...while call 1 still ran
    finally:
        release.set()
    assert finished.wait(10)
