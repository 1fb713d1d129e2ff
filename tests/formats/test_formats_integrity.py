"""Corrupt, truncated and foreign files raise clear errors, never garbage rows."""

from __future__ import annotations

import os
import threading

import google_crc32c
import numpy as np
import pytest
from formats_testdata import concat, make_keys, make_values, same

from de_store.backends import local
from de_store.errors import ChecksumError, FormatError
from de_store.formats import SchemaInfo, batch_from_numpy, get_format
from de_store.formats._shard import POSITIONAL_READ_BYTES
from de_store.formats._stream import OVERLAP_BYTES, ChecksummingWriter, crc32c_combine
from de_store.testing.page_cache import evict

FORMATS = ["parquet", "arrow", "binary"]


@pytest.fixture
def backend(local_location):
    return local_location.open()


def write(backend, fmt_name, n=256, buffer_size=64):
    f = get_format(fmt_name)
    batch = batch_from_numpy(make_keys(n, "int64"), make_values(n, 4, "float32"))
    info = f.write(
        backend, "v/s" + f.suffix, [batch], schema_info=SchemaInfo("v", 4), buffer_size=buffer_size
    )
    return f, info


def flip_byte(backend, path, offset):
    full = backend.local_path(path)
    with open(full, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_recorded_crc32c_is_the_files_crc32c(backend):
    for name in FORMATS:
        _, info = write(backend, name)
        for file in info.files:
            assert file.crc32c == google_crc32c.value(backend.read_bytes(file.path))
            assert file.bytes == backend.size(file.path)
            for part in info.parts:
                r = part.ranges[info.files.index(file)]
                data = backend.read_range(file.path, r.offset, r.end)
                assert r.crc32c == google_crc32c.value(data)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["part", "header", "footer"])
def test_flipped_bit_raises_checksum_error_naming_the_file(backend, fmt, where):
    f, info = write(backend, fmt)
    file = info.files[-1]
    r = info.parts[2].ranges[-1]
    offset = {"part": r.offset + r.length // 2, "header": 0, "footer": file.bytes - 1}[where]
    if fmt == "binary" and where != "part":
        offset = 3 if where == "header" else file.bytes - 1  # no header: first/last part
    flip_byte(backend, file.path, offset)
    with pytest.raises(ChecksumError, match=rf"crc32c mismatch in .*{file.path}: expected 0x"):
        list(f.read(backend, info.path, expected=info))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_part_read_verifies_header_footer_and_its_parts(backend, fmt):
    f, info = write(backend, fmt)
    r = info.parts[1].ranges[0]
    flip_byte(backend, info.path, r.offset + 10)
    assert len(list(f.read(backend, info.path, expected=info, parts=[0, 3]))) == 2
    with pytest.raises(ChecksumError, match=r"crc32c mismatch in part 1 of .*v/s"):
        list(f.read(backend, info.path, expected=info, parts=[1]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_file_raises_format_error(backend, fmt):
    f, info = write(backend, fmt)
    file = info.files[0]
    os.truncate(backend.local_path(file.path), file.bytes - 100)
    with pytest.raises(
        FormatError,
        match=rf"{file.path} is truncated or was modified: "
        rf"expected {file.bytes} bytes, found {file.bytes - 100}",
    ):
        list(f.read(backend, info.path, expected=info))
    if fmt != "binary":
        with pytest.raises(FormatError, match=rf"{file.path}"):
            list(f.read(backend, info.path))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_foreign_file_raises_format_error(backend, fmt):
    f = get_format(fmt)
    backend.write_bytes("foreign" + f.suffix, b"definitely not a shard, just some text" * 10)
    kind = {"parquet": "Parquet", "arrow": "Arrow IPC"}[fmt]
    with pytest.raises(FormatError, match=rf"foreign{f.suffix} is not an? {kind} file"):
        list(f.read(backend, "foreign" + f.suffix))


@pytest.mark.parametrize(("written", "read_as"), [("parquet", "arrow"), ("arrow", "parquet")])
def test_shard_of_another_format_raises_format_error(backend, written, read_as):
    _, info = write(backend, written)
    with pytest.raises(FormatError, match=r"is not an? (Parquet|Arrow IPC) file"):
        list(get_format(read_as).read(backend, info.path))
    with pytest.raises(
        FormatError, match=rf"expected describes a '{written}' shard, read as '{read_as}'"
    ):
        list(get_format(read_as).read(backend, info.path, expected=info))


def test_parquet_without_de_store_columns_is_refused(backend):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [1, 2]}), sink)
    backend.write_bytes("other.parquet", sink.getvalue().to_pybytes())
    with pytest.raises(
        FormatError,
        match=r"other.parquet is not a de_store shard: no 'key' and 'value' columns in \['id'\]",
    ):
        list(get_format("parquet").read(backend, "other.parquet"))


def test_crc32c_combine_matches_crc_of_concatenation():
    rng = np.random.default_rng(0)
    for la, lb in [(0, 0), (1, 7), (1000, 1), (4096, 123457), (10, 0)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        combined = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), lb)
        assert combined == google_crc32c.value(a + b)


@pytest.mark.parametrize("summed", [False, True], ids=["summed_here", "summed_by_the_caller"])
def test_checksumming_writer_sums_every_segment_and_the_whole_stream(summed):
    """Writes small and large (summed in a helper thread), cuts at write boundaries and
    cuts scheduled inside a later write (the bytes before such a cut, since the last one,
    are in no segment returned, as Arrow's header): each segment's crc32c and the whole
    stream's are those of their bytes. The same where the caller gives each write's
    crc32c (``write_summed``, as the codec threads do): combined into the sums, or the
    bytes summed after all where a scheduled cut falls inside them."""
    import io

    rng = np.random.default_rng(7)
    sink = io.BytesIO()
    writer = ChecksummingWriter(sink)
    ranges, scheduled = [], []
    for size, cut in [(10, "now"), (OVERLAP_BYTES + 5, "inside"), (3, None), (70_000, "now"),
                      (0, "now"), (OVERLAP_BYTES * 2, "inside"), (1, None)]:  # fmt: skip
        if cut == "inside":  # a cut a little way into the next write
            ranges.append(writer.cut())
            scheduled.append(writer.position + size // 3)
            writer.cut_at(scheduled[-1])
        data = rng.bytes(size)
        if summed:
            assert writer.write_summed(data, google_crc32c.value(data)) == size
        else:
            writer.write(data)
        if cut == "now":
            ranges.append(writer.cut())
    ranges.append(writer.cut())
    data = sink.getvalue()
    assert ranges[-1].end == len(data) == writer.position
    assert set(scheduled) <= {r.offset for r in ranges}
    for r in ranges:
        assert r.crc32c == google_crc32c.value(data[r.offset : r.end]), r
    assert writer.crc32c == google_crc32c.value(data)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_late_part_raises_even_while_earlier_parts_are_returned(backend, fmt):
    f, info = write(backend, fmt)
    r = info.parts[-1].ranges[-1]
    flip_byte(backend, info.files[-1].path, r.offset + r.length // 2)
    rows = 0
    with pytest.raises(ChecksumError, match=f"part {len(info.parts) - 1}"):
        for batch in f.read(backend, info.path, expected=info):
            rows += batch.num_rows
    assert rows <= sum(p.rows for p in info.parts[:-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_stopping_a_verified_read_early_releases_it(backend, fmt):
    f, info = write(backend, fmt, n=1024)  # 16 parts
    before = set(threading.enumerate())
    reader = f.read(backend, info.path, expected=info, buffer_size=64)
    first = next(reader)
    reader.close()  # the parts read ahead are dropped, no thread is left behind:
    for thread in set(threading.enumerate()) - before:  # each ends after its running read
        thread.join(10)
    assert first.num_rows == 64
    assert backend.stats.bytes_read < info.bytes / 2
    assert set(threading.enumerate()) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_large_parts_read_straight_from_the_disk_are_exact_and_checked(backend, fmt, monkeypatch):
    """Parts of ``POSITIONAL_READ_BYTES`` or more of a local file are read by position,
    straight from the disk once the file left the page cache (``backends.local``): the
    rows come back exact, and a flipped bit in one is caught as in any other read."""
    if not local.POSITIONAL_READS:
        pytest.skip("no preadv on this system")
    rows, part_rows = 150_000, 50_000  # parts of 1.6 MB of values (binary: keys apart)
    keys, values = make_keys(rows, "int64"), make_values(rows, 8, "float32")
    f = get_format(fmt)
    info = f.write(
        backend,
        "v/s" + f.suffix,
        [batch_from_numpy(keys, values)],
        schema_info=SchemaInfo("v", 8),
        buffer_size=part_rows,
    )
    assert min(p.ranges[-1].length for p in info.parts) >= POSITIONAL_READ_BYTES
    positional = []
    read_at = local.LocalReadFile.read_at

    def counted(self, view, offset):
        positional.append(offset)
        return read_at(self, view, offset)

    monkeypatch.setattr(local.LocalReadFile, "read_at", counted)
    for file in info.files:
        evict(backend.local_path(file.path))
    found_keys, found_values, _ = concat(list(f.read(backend, info.path, expected=info)))
    assert same(found_keys, keys) and same(found_values, values)
    assert len(positional) == len(info.parts)  # binary's 400 kB key parts: streamed
    r = info.parts[1].ranges[-1]
    flip_byte(backend, info.files[-1].path, r.offset + r.length // 2)
    evict(backend.local_path(info.files[-1].path))
    with pytest.raises(ChecksumError, match=r"crc32c mismatch in part 1 of .*v/s"):
        list(f.read(backend, info.path, expected=info))
