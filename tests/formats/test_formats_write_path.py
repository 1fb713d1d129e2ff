"""The write path of the plain Parquet writer and of the part loop every format shares.

A row group's pages go to the sink in one write when they are small (one crc32c and one
system call per part); a large page body is written as it is, never copied. The repetition
levels are the bit pattern Parquet defines. Batches that do not come straight from the
saver (nulls, another schema) are still checked.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from de_store.backends import open_backend
from de_store.errors import FormatError
from de_store.formats import (
    ExtraColumn,
    SchemaInfo,
    _plain_parquet,
    _thrift,
    batch_from_numpy,
    get_format,
)

INFO = SchemaInfo(name="emb", dim=16, extras=(ExtraColumn("step", "int32"),))


class CountingSink(io.BytesIO):
    """A real in-memory file that records the size of every write it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data: object) -> int:
        self.sizes.append(memoryview(data).nbytes)  # type: ignore[arg-type]
        return super().write(data)  # type: ignore[arg-type]


def rows_batch(count: int, seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(2**62), 2**62, count)
    values = rng.standard_normal((count, INFO.dim), dtype=np.float32)
    step = rng.integers(0, 1000, count).astype(np.int32)
    return batch_from_numpy(keys, values, {"step": step}, schema=INFO.arrow_schema())


def test_small_row_group_is_one_write() -> None:
    sink = CountingSink()
    writer = _plain_parquet.PlainParquetWriter(sink, INFO.arrow_schema(), statistics=["key"])
    batch = rows_batch(3000)
    for start in (0, 1000, 2000):
        writer.write_batch(batch.slice(start, 1000))
    writer.close()
    # the magic, one write per row group, the footer
    assert len(sink.sizes) == 5
    assert sink.sizes[0] == 4
    table = pq.read_table(io.BytesIO(sink.getvalue()))
    assert pq.ParquetFile(io.BytesIO(sink.getvalue())).metadata.num_row_groups == 3
    assert table.column("key").to_pylist() == batch.column(0).to_pylist()
    assert table.column("value").to_pylist() == batch.column(1).to_pylist()
    assert table.column("step").to_pylist() == batch.column(2).to_pylist()


def test_large_page_body_is_written_as_it_is() -> None:
    sink = CountingSink()
    writer = _plain_parquet.PlainParquetWriter(sink, INFO.arrow_schema(), statistics=["key"])
    rows = 20_000  # values: 1.28 MB, over JOIN_BYTES; keys 160 KB, steps 80 KB
    writer.write_batch(rows_batch(rows))
    writer.close()
    value_body = rows * INFO.dim * 4
    assert value_body >= _plain_parquet.JOIN_BYTES
    # magic; key page + value page header; the value body itself; step page; footer
    assert len(sink.sizes) == 5
    assert sink.sizes[2] == value_body
    assert pq.read_table(io.BytesIO(sink.getvalue())).num_rows == rows


def reference_levels(rows: int, width: int) -> bytes:
    """Repetition levels bit-packed element by element, then the definition run."""
    values = rows * width
    bits = np.ones(values, dtype=bool)
    bits[::width] = False
    packed = np.packbits(bits, bitorder="little").tobytes()
    groups = (values + 7) // 8
    repetition = _thrift.varint(groups << 1 | 1) + packed.ljust(groups, b"\0")
    definition = _thrift.varint(values << 1) + b"\x01"
    return b"".join(len(b).to_bytes(4, "little") + b for b in (repetition, definition))


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 24, 33, 64, 100])
def test_levels_are_the_bit_pattern_of_full_lists(width: int) -> None:
    for rows in [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 100, 2381, 65536]:
        assert _plain_parquet._levels(rows, width) == reference_levels(rows, width), rows


def test_batch_with_nulls_under_the_shard_schema_is_refused(tmp_path) -> None:
    schema = INFO.arrow_schema()
    batch = rows_batch(10)
    values = pa.array([1.0] * 159 + [None], pa.float32())
    nulls = pa.FixedSizeListArray.from_arrays(values, type=schema.field("value").type)
    bad = pa.RecordBatch.from_arrays([batch.column(0), nulls, batch.column(2)], schema=schema)
    with pytest.raises(FormatError, match="column 'value' holds 1 null"):
        get_format("parquet").write(open_backend(str(tmp_path)), "s.parquet", [bad],
                                    schema_info=INFO)  # fmt: skip


def test_part_key_ranges_of_int32_keys(tmp_path) -> None:
    info = SchemaInfo(name="emb", dim=2, key_dtype="int32")
    keys = np.array([5, -3, 9, 2**31 - 1, -(2**31)], np.int32)
    batch = batch_from_numpy(keys, np.zeros((5, 2), np.float32), schema=info.arrow_schema())
    for name in ("parquet", "arrow", "binary"):
        shard = get_format(name).write(open_backend(str(tmp_path)), f"s-{name}", [batch],
                                       schema_info=info, buffer_size=3)  # fmt: skip
        assert [(p.min_key, p.max_key) for p in shard.parts] == [(-3, 9), (-(2**31), 2**31 - 1)]
        assert all(type(p.min_key) is int for p in shard.parts)
        assert (shard.min_key, shard.max_key) == (-(2**31), 2**31 - 1)


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_part_key_ranges_are_each_parts_smallest_and_largest_key(tmp_path, compression) -> None:
    from de_store.formats.parquet import ParquetFormat

    batch = rows_batch(1000, seed=3)
    keys = batch.column(0).to_numpy()
    shard = ParquetFormat(compression).write(open_backend(str(tmp_path)), "s.parquet", [batch],
                                             schema_info=INFO, buffer_size=96)  # fmt: skip
    expected = [
        (int(keys[a : a + 96].min()), int(keys[a : a + 96].max())) for a in range(0, 1000, 96)
    ]
    assert [(p.min_key, p.max_key) for p in shard.parts] == expected
    assert all(type(p.min_key) is int and type(p.max_key) is int for p in shard.parts)
    metadata = pq.ParquetFile(tmp_path / "s.parquet").metadata
    statistics = [metadata.row_group(i).column(0).statistics for i in range(len(expected))]
    assert [(s.min, s.max) for s in statistics] == expected


def test_plain_writer_gives_the_key_range_of_the_batch_written_last_only() -> None:
    schema = INFO.arrow_schema()
    writer = _plain_parquet.PlainParquetWriter(io.BytesIO(), schema, statistics=["key"])
    first, second = rows_batch(50, seed=1), rows_batch(50, seed=2)
    assert writer.key_range(first) is None  # nothing written yet
    writer.write_batch(first)
    low, high = first.column(0).to_numpy().min(), first.column(0).to_numpy().max()
    assert writer.key_range(first) == (int(low), int(high))
    assert writer.key_range(second) is None  # not the batch written: its range is unknown
    assert writer.key_range(first.slice(0, 50)) is None  # an equal batch, not the same one
    writer.write_batch(second)
    assert writer.key_range(first) is None
    no_statistics = _plain_parquet.PlainParquetWriter(io.BytesIO(), schema, [])
    no_statistics.write_batch(first)
    assert no_statistics.key_range(first) is None
