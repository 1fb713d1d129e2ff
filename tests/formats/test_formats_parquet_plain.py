"""Uncompressed fixed-width shards are written by de_store's own Parquet writer.

What a reader sees must be what Arrow's writer produces for the same batches: the same
table, Arrow schema with its metadata, Parquet schema, key-value metadata, row groups and
key statistics, whatever the dtypes, widths, row group sizes and page splits.
"""

from __future__ import annotations

import os
import sys
import threading

import google_crc32c
import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from formats_testdata import concat, make_keys, make_values, same

from de_store.backends import open_backend
from de_store.errors import FormatError
from de_store.formats import ExtraColumn, SchemaInfo, _plain_parquet, batch_from_numpy, get_format

OURS = _plain_parquet.CREATED_BY.decode()


def write_both(directory, schema_info, batches, buffer_size, compression="none"):
    """The shard de_store writes, and the file Arrow writes from the same row groups."""
    info = get_format("parquet", compression=compression).write(
        open_backend(str(directory)),
        "ours.parquet",
        batches,
        schema_info=schema_info,
        buffer_size=buffer_size,
    )
    reference = directory / "arrow.parquet"
    schema = schema_info.arrow_schema()
    with pq.ParquetWriter(
        reference,
        schema,
        compression=compression,
        use_dictionary=False,
        write_statistics=["key"],
        store_schema=True,
    ) as writer:
        for batch in batches:
            for start in range(0, batch.num_rows, buffer_size):
                piece = batch.slice(start, buffer_size)
                writer.write_batch(
                    pa.RecordBatch.from_arrays(piece.columns, schema=schema),
                    row_group_size=piece.num_rows,
                )
    return info, directory / "ours.parquet", reference


def assert_same_file_view(ours, reference):
    ours_file, ref_file = pq.ParquetFile(ours), pq.ParquetFile(reference)
    assert ours_file.metadata.created_by == OURS
    assert ours_file.schema.equals(ref_file.schema)
    assert ours_file.schema_arrow.equals(ref_file.schema_arrow, check_metadata=True)
    assert ours_file.metadata.metadata == ref_file.metadata.metadata
    ours_md, ref_md = ours_file.metadata, ref_file.metadata
    assert ours_md.num_rows == ref_md.num_rows
    assert ours_md.num_row_groups == ref_md.num_row_groups
    for i in range(ours_md.num_row_groups):
        ours_rg, ref_rg = ours_md.row_group(i), ref_md.row_group(i)
        assert ours_rg.num_rows == ref_rg.num_rows
        for j in range(ours_rg.num_columns):
            ours_col, ref_col = ours_rg.column(j), ref_rg.column(j)
            assert ours_col.path_in_schema == ref_col.path_in_schema
            assert ours_col.num_values == ref_col.num_values
            assert ours_col.is_stats_set == ref_col.is_stats_set
            if ref_col.is_stats_set:
                ours_stats, ref_stats = ours_col.statistics, ref_col.statistics
                assert (ours_stats.min, ours_stats.max) == (ref_stats.min, ref_stats.max)
                assert ours_stats.null_count == ref_stats.null_count == 0
    table = pq.read_table(ours)
    assert table.equals(pq.read_table(reference))
    assert table.schema.equals(pq.read_table(reference).schema, check_metadata=True)


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
@pytest.mark.parametrize("value_dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("dim", [1, 3, 16])
def test_arrow_reads_what_arrow_would_have_written(tmp_path, key_dtype, value_dtype, dim):
    extras = (ExtraColumn("adam_m", value_dtype, dim), ExtraColumn("frequency", "int64"))
    schema_info = SchemaInfo("user/emb", dim, key_dtype, value_dtype, extras=extras)
    keys, values = make_keys(700, key_dtype), make_values(700, dim, value_dtype)
    extra_values = {"adam_m": make_values(700, dim, value_dtype, seed=5),
                    "frequency": np.arange(700, dtype=np.int64)}  # fmt: skip
    batches = [batch_from_numpy(keys, values, extra_values)]
    info, ours, reference = write_both(tmp_path, schema_info, batches, buffer_size=256)
    assert len(info.parts) == 3
    assert_same_file_view(ours, reference)
    got = pq.read_table(ours)
    assert same(got.column("key").to_numpy(), keys)
    assert same(np.stack(got.column("value").to_numpy(zero_copy_only=False)), values)


def test_row_groups_split_into_pages_of_whole_rows(tmp_path, monkeypatch):
    # 16 rows of 7 float32 (28 bytes): at most 3 rows a page, so 6 pages a row group.
    monkeypatch.setattr(_plain_parquet, "PAGE_BYTES", 100)
    schema_info = SchemaInfo("emb", 7)
    keys, values = make_keys(40, "int64"), make_values(40, 7, "float32")
    _, ours, reference = write_both(
        tmp_path, schema_info, [batch_from_numpy(keys, values)], buffer_size=16
    )
    assert_same_file_view(ours, reference)
    batches = list(pq.ParquetFile(ours).iter_batches(batch_size=5, columns=["value"]))
    assert same(np.stack(pa.concat_arrays([b.column(0) for b in batches]).to_numpy(
        zero_copy_only=False)), values)  # fmt: skip


def test_dataset_and_de_store_read_many_batches(tmp_path):
    schema_info = SchemaInfo("emb", 4)
    keys, values = make_keys(1000, "int64"), make_values(1000, 4, "float32")
    batches = [batch_from_numpy(keys[i : i + 300], values[i : i + 300]) for i in (0, 300, 600)]
    batches.append(batch_from_numpy(keys[900:], values[900:]))
    info, ours, reference = write_both(tmp_path, schema_info, batches, buffer_size=128)
    assert_same_file_view(ours, reference)
    positive = ds.dataset(ours).to_table(filter=ds.field("key") > 0)
    assert positive.num_rows == int((keys > 0).sum())
    read = get_format("parquet").read(
        open_backend(str(tmp_path)), "ours.parquet", expected=info, buffer_size=77
    )
    got_keys, got_values, _ = concat(list(read))
    assert same(got_keys, keys) and same(got_values, values)


def test_empty_shard_is_a_valid_parquet_file(tmp_path):
    schema_info = SchemaInfo("emb", 4)
    _, ours, _ = write_both(tmp_path, schema_info, [], buffer_size=128)
    table = pq.read_table(ours)
    assert table.num_rows == 0
    assert table.schema.equals(schema_info.arrow_schema(), check_metadata=True)
    assert pq.ParquetFile(ours).metadata.created_by == OURS


@pytest.mark.parametrize(
    ("schema_info", "compression"),
    [
        (SchemaInfo("emb", 4, "string"), "none"),
        (SchemaInfo("emb", 4, "int64", "bfloat16"), "none"),
        (SchemaInfo("emb", 4, "int64", "int8"), "zstd"),
        (SchemaInfo("emb", 4), "snappy"),
    ],
)
def test_other_shards_are_written_by_arrow(tmp_path, schema_info, compression):
    keys = make_keys(10, schema_info.key_dtype)
    values = make_values(10, 4, schema_info.value_dtype)
    get_format("parquet", compression=compression).write(
        open_backend(str(tmp_path)),
        "s.parquet",
        [batch_from_numpy(keys, values)],
        schema_info=schema_info,
    )
    assert pq.ParquetFile(tmp_path / "s.parquet").metadata.created_by.startswith("parquet-cpp")


PACKED = {"packed_bfloat16": ml_dtypes.bfloat16, "packed_float16": np.float16,
          "packed_int8": np.int8}  # fmt: skip


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
@pytest.mark.parametrize("value_dtype", [*PACKED, "float16"])
def test_packed_rows_and_float16_are_written_here_as_arrow_would(
    tmp_path, monkeypatch, value_dtype, compression
):
    """Values stored at a lower precision (each row's bytes one ``fixed_size_binary``
    value), their float16 scales, and float16 lists: Parquet's FIXED_LEN_BYTE_ARRAY, the
    schema, logical types and table Arrow's writer gives, read back here exactly."""
    rng = np.random.default_rng(3)
    n, dim = 700, 6
    if value_dtype in PACKED:
        values = (rng.standard_normal((n, dim)) * 50).astype(PACKED[value_dtype])
    else:
        values = rng.standard_normal((n, dim)).astype(np.float16)
    scale = rng.random(n).astype(np.float16)
    extras = (ExtraColumn("value_scale", "float16"), ExtraColumn("freq", "int64"))
    schema_info = SchemaInfo("emb", dim, "int64", value_dtype, extras=extras)
    keys, freq = make_keys(n, "int64"), np.arange(n, dtype=np.int64)
    batch = batch_from_numpy(keys, values, {"value_scale": scale, "freq": freq},
                             schema=schema_info.arrow_schema())  # fmt: skip
    info, ours, reference = write_both(tmp_path, schema_info, [batch], 256, compression)
    assert_same_file_view(ours, reference)
    schema = pq.ParquetFile(ours).schema
    scale_column = schema.column(schema.names.index("value_scale"))
    assert (scale_column.physical_type, scale_column.length) == ("FIXED_LEN_BYTE_ARRAY", 2)
    assert str(scale_column.logical_type) == "Float16"
    value_column = schema.column(schema.names.index("element" if value_dtype == "float16"
                                                    else "value"))  # fmt: skip
    assert value_column.physical_type == "FIXED_LEN_BYTE_ARRAY"
    assert value_column.length == values.itemsize * (1 if value_dtype == "float16" else dim)

    def no_arrow_reader(*args, **kwargs):
        raise AssertionError("Arrow's Parquet reader was used")

    monkeypatch.setattr("de_store.formats.parquet.pq.ParquetFile", no_arrow_reader)
    got_keys, got_values, got = _read_back(tmp_path, info, buffer_size=300)
    assert same(got_keys, keys) and same(got["freq"], freq)
    assert got_values.tobytes() == values.tobytes()
    assert got["value_scale"].tobytes() == scale.tobytes()


def test_null_values_are_refused_naming_the_shard_and_column(tmp_path):
    schema_info = SchemaInfo("emb", 2)
    values = pa.array([[1.0, 2.0], None, [3.0, 4.0]], pa.list_(pa.float32(), 2))
    batch = pa.RecordBatch.from_arrays(
        [pa.array([1, 2, 3], pa.int64()), values], names=["key", "value"]
    )
    with pytest.raises(FormatError, match=r"s\.parquet: column 'value' holds 1 null"):
        get_format("parquet").write(
            open_backend(str(tmp_path)), "s.parquet", [batch], schema_info=schema_info
        )
    assert not (tmp_path / "s.parquet").exists()


def _read_back(tmp_path, info, **kw):
    fmt = get_format("parquet")
    batches = fmt.read(open_backend(str(tmp_path)), info.path, expected=info, **kw)
    return concat(list(batches))


def test_de_store_decodes_its_own_pages_in_place(tmp_path, monkeypatch):
    schema_info = SchemaInfo("emb", 5, extras=(ExtraColumn("freq", "int64"),))
    keys, values = make_keys(900, "int64"), make_values(900, 5, "float32")
    freq = np.arange(900, dtype=np.int64)
    info, _, _ = write_both(
        tmp_path, schema_info, [batch_from_numpy(keys, values, {"freq": freq})], buffer_size=256
    )

    def no_arrow_reader(*args, **kwargs):
        raise AssertionError("Arrow's Parquet reader was used")

    monkeypatch.setattr("de_store.formats.parquet.pq.ParquetFile", no_arrow_reader)
    got_keys, got_values, extras = _read_back(tmp_path, info, buffer_size=100)
    assert same(got_keys, keys) and same(got_values, values) and same(extras["freq"], freq)
    got_keys, got_values, extras = _read_back(
        tmp_path, info, columns=["key", "value"], parts=[1, 3]
    )
    assert same(got_keys, np.concatenate([keys[256:512], keys[768:]]))
    assert same(got_values, np.concatenate([values[256:512], values[768:]])) and extras == {}


def test_chunks_of_several_pages_are_decoded_by_arrow(tmp_path, monkeypatch):
    monkeypatch.setattr(_plain_parquet, "PAGE_BYTES", 100)
    keys, values = make_keys(40, "int64"), make_values(40, 7, "float32")
    info, _, _ = write_both(
        tmp_path, SchemaInfo("emb", 7), [batch_from_numpy(keys, values)], buffer_size=16
    )
    got_keys, got_values, _ = _read_back(tmp_path, info)
    assert same(got_keys, keys) and same(got_values, values)


@pytest.mark.parametrize(("compression", "codec"), [("zstd", "ZSTD"), ("lz4", "LZ4_RAW")])
def test_compressed_shards_are_written_and_decoded_here(tmp_path, monkeypatch, compression, codec):
    """zstd and lz4 pages (Parquet's LZ4_RAW) are written here and read back here; Arrow
    and DuckDB read them as they read Arrow's own."""
    import duckdb

    schema_info = SchemaInfo("emb", 16, extras=(ExtraColumn("freq", "int64"),))
    keys, values = make_keys(700, "int64"), make_values(700, 16, "float32")
    freq = np.arange(700, dtype=np.int64)
    batches = [batch_from_numpy(keys, values, {"freq": freq})]
    info, ours, reference = write_both(tmp_path, schema_info, batches, 256, compression)
    assert_same_file_view(ours, reference)
    metadata = pq.ParquetFile(ours).metadata
    chunk = metadata.row_group(0).column(1)
    codecs = duckdb.sql(f"SELECT DISTINCT compression FROM parquet_metadata('{ours}')")
    assert codecs.fetchall() == [(codec,)]  # as the format names it (pyarrow: LZ4 for LZ4_RAW)
    assert chunk.total_compressed_size < chunk.total_uncompressed_size
    rows = duckdb.sql(f"SELECT key, value, freq FROM read_parquet('{ours}')").fetchall()
    assert [row[0] for row in rows] == keys.tolist()
    assert same(np.array([row[1] for row in rows], np.float32), values)
    assert [row[2] for row in rows] == freq.tolist()
    assert metadata.row_group(0).total_byte_size == sum(
        metadata.row_group(0).column(j).total_uncompressed_size for j in range(3)
    )

    def no_arrow_reader(*args, **kwargs):
        raise AssertionError("Arrow's Parquet reader was used")

    monkeypatch.setattr("de_store.formats.parquet.pq.ParquetFile", no_arrow_reader)
    got_keys, got_values, extras = _read_back(tmp_path, info, buffer_size=300)
    assert same(got_keys, keys) and same(got_values, values) and same(extras["freq"], freq)


def test_zstd_pages_in_several_frames_read_as_one_by_every_reader(tmp_path, monkeypatch):
    """A big page is compressed in frames side by side; Arrow, DuckDB and de_store read
    the frames of a page as one stream."""
    import duckdb

    monkeypatch.setattr(_plain_parquet, "FRAME_BYTES", 1000)
    monkeypatch.setattr(_plain_parquet, "_CODEC_THREADS", 3)
    keys, values = make_keys(2000, "int64"), make_values(2000, 8, "float32")
    info, ours, reference = write_both(
        tmp_path, SchemaInfo("emb", 8), [batch_from_numpy(keys, values)], 700, compression="zstd"
    )
    assert_same_file_view(ours, reference)
    chunk = pq.ParquetFile(ours).metadata.row_group(0).column(1)  # 700 rows x 8 values
    data = ours.read_bytes()[chunk.data_page_offset :][: chunk.total_compressed_size]
    assert data.count(b"\x28\xb5\x2f\xfd") >= 4  # zstd's frame magic: levels and 3 parts

    rows = duckdb.sql(f"SELECT key, value FROM read_parquet('{ours}')").fetchall()
    assert [row[0] for row in rows] == keys.tolist()
    assert same(np.array([row[1] for row in rows], np.float32), values)
    got_keys, got_values, _ = _read_back(tmp_path, info)
    assert same(got_keys, keys) and same(got_values, values)


ZSTD_MAGIC, SKIPPABLE_MAGIC = b"\x28\xb5\x2f\xfd", b"\x50\x2a\x4d\x18"


def _frames(data: bytes, start: int) -> list[tuple[int, int, bytes]]:
    """``(file offset, bytes, magic)`` of each zstd frame and skippable frame of a page
    body ``data`` at file offset ``start`` (a frame runs to the next one's magic)."""
    cuts = sorted(
        at
        for magic in (ZSTD_MAGIC, SKIPPABLE_MAGIC)
        for at in range(len(data))
        if data.startswith(magic, at)
    )
    ends = [*cuts[1:], len(data)]
    return [(start + at, end - at, data[at : at + 4]) for at, end in zip(cuts, ends, strict=True)]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="direct writes: Linux")
def test_big_zstd_frames_start_at_the_disks_alignment_where_written_straight_to_it(
    tmp_path, monkeypatch
):
    """Written to a local file straight to the disk, each zstd frame of JOIN_BYTES or
    more starts at an offset of the disk's alignment, after a skippable frame of zeros
    where the bytes before it end elsewhere, so the file writes it from the codec's
    memory; every reader steps over the padding and reads the rows the memory backend's
    file, written without it, holds."""
    import duckdb

    from de_store.backends.local import WRITE_ALIGNMENT

    monkeypatch.setattr(_plain_parquet, "JOIN_BYTES", 2048)
    monkeypatch.setattr(_plain_parquet, "FRAME_BYTES", 8192)
    keys, values = make_keys(3000, "int64"), make_values(3000, 16, "float32")
    batches = [batch_from_numpy(keys, values)]
    parquet = get_format("parquet", compression="zstd")
    shards = {}
    for name, backend in (
        ("disk", open_backend(str(tmp_path))),
        ("memory", open_backend("memory://aligned")),
    ):
        info = parquet.write(
            backend, "s.parquet", batches, schema_info=SchemaInfo("emb", 16), buffer_size=1000
        )
        shards[name] = (backend, info, backend.read_bytes("s.parquet"))
    body_frames = {}
    for name, (_, _, data) in shards.items():
        metadata = pq.ParquetFile(pa.py_buffer(data)).metadata
        frames = []
        for group in range(metadata.num_row_groups):
            chunk = metadata.row_group(group).column(1)  # 1000 rows x 16 values
            start = chunk.data_page_offset
            page = data[start : start + chunk.total_compressed_size]
            body = (
                page.index(ZSTD_MAGIC)
                if SKIPPABLE_MAGIC not in page
                else min(page.index(ZSTD_MAGIC), page.index(SKIPPABLE_MAGIC))
            )
            frames += _frames(page[body:], start + body)
        body_frames[name] = frames
    big = [
        (at, size)
        for at, size, magic in body_frames["disk"]
        if magic == ZSTD_MAGIC and size >= 2048
    ]
    assert len(big) >= 6  # the values of each of 3 row groups in frames of 8 KiB or more
    assert all(at % WRITE_ALIGNMENT == 0 for at, _ in big)
    padding = [(at, size) for at, size, magic in body_frames["disk"] if magic == SKIPPABLE_MAGIC]
    assert padding and all(size >= 8 for _, size in padding)
    data = shards["disk"][2]
    for at, size in padding:  # magic, the length of what follows, then zeros
        assert int.from_bytes(data[at + 4 : at + 8], "little") == size - 8
        assert data[at + 8 : at + size] == bytes(size - 8)
    assert all(magic == ZSTD_MAGIC for _, _, magic in body_frames["memory"])
    tables = {name: pq.read_table(pa.py_buffer(data)) for name, (_, _, data) in shards.items()}
    assert tables["disk"].equals(tables["memory"])
    assert tables["disk"].column("key").to_numpy().tolist() == keys.tolist()
    path = tmp_path / "s.parquet"
    rows = duckdb.sql(f"SELECT key, value FROM read_parquet('{path}')").fetchall()
    assert same(np.array([row[1] for row in rows], np.float32), values)
    for backend, info, data in shards.values():  # checked against the recorded crc32c
        assert info.files[0].crc32c == google_crc32c.value(data)
        got_keys, got_values, _ = concat(list(parquet.read(backend, "s.parquet", expected=info)))
        assert same(got_keys, keys) and same(got_values, values)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads' own nice: Linux")
def test_compressing_threads_run_below_the_thread_that_saves(tmp_path, monkeypatch):
    """Every frame is compressed by a thread CODEC_NICE nice steps below the threads that
    write (19 at most): the writes and a training loop take the cores first."""
    compress, seen = _plain_parquet._compress, set()

    def recording(*args):
        seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return compress(*args)

    monkeypatch.setattr(_plain_parquet, "_compress", recording)
    keys, values = make_keys(3000, "int64"), make_values(3000, 8, "float32")
    info, _, _ = write_both(
        tmp_path, SchemaInfo("emb", 8), [batch_from_numpy(keys, values)], 700, compression="zstd"
    )
    writer = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == {min(19, writer + _plain_parquet.CODEC_NICE)}
    got_keys, got_values, _ = _read_back(tmp_path, info)
    assert same(got_keys, keys) and same(got_values, values)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="threads' own cores: Linux")
def test_each_compressing_thread_keeps_to_its_own_share_of_the_cores():
    """The codec threads split the cores the process may run on between them, every
    n-th core to one thread: at their low priority none shares a core with another
    while a core idles."""
    workers = _plain_parquet._CODEC_THREADS
    all_started = threading.Barrier(workers, timeout=60)

    def where() -> tuple[int, tuple[int, ...]]:
        all_started.wait()  # each task holds its thread: every thread of the pool runs one
        return threading.get_native_id(), tuple(sorted(os.sched_getaffinity(0)))

    seen = dict(
        f.result() for f in [_plain_parquet._CODEC_POOL.submit(where) for _ in range(workers)]
    )
    cores = sorted(os.sched_getaffinity(0))
    assert len(seen) == workers
    assert sorted(seen.values()) == sorted(tuple(cores[i::workers]) for i in range(workers))


FORKED = """
import os, sys, time
import numpy as np
from de_store.backends import open_backend
from de_store.formats import SchemaInfo, batch_from_numpy, get_format

def write(name):
    keys = np.arange(50_000, dtype=np.int64)
    values = np.ones((50_000, 8), np.float32)
    fmt = get_format("parquet", compression="zstd")
    fmt.write(open_backend(sys.argv[1]), name, [batch_from_numpy(keys, values)],
              schema_info=SchemaInfo("emb", 8), buffer_size=10_000)

write("parent.parquet")  # the codec and crc32c threads run in the parent
child = os.fork()
if child == 0:
    write("child.parquet")
    os._exit(0)
for _ in range(600):  # a minute
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.1)
os.kill(child, 9)
sys.exit("the forked child's write never finished")
"""


def test_a_forked_child_writes_compressed_shards(tmp_path):
    """Thread pools inherited through fork have no threads: the child makes its own."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = pq.read_table(tmp_path / "child.parquet")
    assert table.column("key").to_pylist() == list(range(50_000))
