"""Values stored at a lower precision: the conversions, and shards pyarrow reads."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from de_store.backends import open_backend
from de_store.checkpoint import shards
from de_store.checkpoint.manifest import ColumnSpec
from de_store.checkpoint.variable_rows import ShardRows, VariableRows
from de_store.formats import precision
from de_store.formats.registry import compressed_format


def rows_like_trained(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Rows of varied scale, as trained embeddings have: normal values times a per-row
    norm spread over two orders of magnitude."""
    rng = np.random.default_rng(seed)
    norms = np.exp(rng.uniform(np.log(0.01), np.log(1.0), (n, 1)))
    return (rng.standard_normal((n, dim)) * norms).astype(np.float32)


def int8_round_trip(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = np.arange(len(values), dtype=np.int64)
    stored, beside = precision.encode(values, "int8", keys, "emb")
    back, rest = precision.decode(stored, beside, "int8")
    assert stored.dtype == np.int8 and rest == {}
    return back, beside[precision.SCALE_COLUMN]


def test_int8_stays_within_half_its_scale() -> None:
    values = rows_like_trained(2000, 16)
    values[0] = 0.0
    values[1, :] = 1e-30  # a subnormal scale
    values[2, :] = 60000.0  # a large normal scale
    back, scale = int8_round_trip(values)
    assert scale.dtype == np.float16
    assert (np.abs(back - values) <= precision.error_bound(scale)[:, None]).all()
    largest = np.abs(values).max(axis=1)
    assert (scale.astype(np.float32) >= largest / 127).all()  # rounded up: no code clips
    assert (scale.astype(np.float32) <= largest / 127 * (1 + 2**-10) + 2**-24).all()
    np.testing.assert_array_equal(back[0], np.zeros(16, np.float32))


def test_int8_is_exact_for_rows_of_codes_times_a_float16_scale() -> None:
    codes = np.random.default_rng(1).integers(-127, 128, (50, 8)).astype(np.float32)
    codes[:, 0] = 127
    values = codes * np.float32(2.0**-7)
    back, scale = int8_round_trip(values)
    np.testing.assert_array_equal(back, values)
    np.testing.assert_array_equal(scale, np.full(50, 2.0**-7, np.float16))


def test_16_bit_precisions_round_as_ml_dtypes() -> None:
    values = rows_like_trained(300, 8)
    keys = np.arange(300)
    for name, dtype in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        stored, beside = precision.encode(values, name, keys, "emb")
        back, _ = precision.decode(stored, beside, name)
        assert beside == {} and stored.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(back, values.astype(dtype).astype(np.float32))


def test_a_codec_the_format_lacks_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        compressed_format("arrow", "snappy")
    assert str(err.value) == (
        "shard format 'arrow' has no compression 'snappy': it offers ['none', 'lz4', 'zstd']"
    )
    with pytest.raises(ValueError) as err:
        compressed_format("parquet", "none", 3)
    assert str(err.value) == "compression_level 3 needs a compression, got 'none'"
    assert compressed_format("parquet", "zstd", 7).compression_level == 7


def written_int8(tmp_path: Path, format_name: str, compression: str) -> tuple[str, np.ndarray]:
    """One int8 shard of 1000 rows (dim 16) and an ``adam_m`` column; its file and values."""
    values = rows_like_trained(1000, 16)
    keys = np.arange(1000, dtype=np.int64) * 7
    columns = {"value": ColumnSpec("float32", 16), "adam_m": ColumnSpec("float32", 16)}
    rows = VariableRows("emb", "int64", "float32", 16, columns,
                        [ShardRows(keys, {"value": values, "adam_m": values * 2})])  # fmt: skip
    backend = open_backend(str(tmp_path))
    record = shards.write_shard(backend, rows, 0, rank=0, global_shard=0, format_name=format_name,
                                buffer_size=300, bucketed=False, compression=compression,
                                value_precision="int8")  # fmt: skip
    assert record.value_precision == "int8"
    read = list(shards.read_shard_rows(backend, record, list(range(4)), buffer_size=1000))
    np.testing.assert_array_equal(np.concatenate([r.keys for r in read]), keys)
    np.testing.assert_array_equal(np.concatenate([r.columns["adam_m"] for r in read]), values * 2)
    restored = np.concatenate([r.columns["value"] for r in read])
    assert restored.dtype == np.float32
    assert 0 < np.abs(restored - values).max() < np.abs(values).max() / 254 * 1.01
    return str(tmp_path / record.path), restored


@pytest.mark.parametrize(
    ("format_name", "compression"), [("parquet", "zstd"), ("parquet", "none"), ("arrow", "lz4")]
)
def test_pyarrow_reads_the_stored_columns_and_numpy_gets_float32_back(
    tmp_path: Path, format_name: str, compression: str
) -> None:
    path, restored = written_int8(tmp_path, format_name, compression)
    if format_name == "parquet":
        table = pq.read_table(path)
    else:
        table = ipc.open_file(pa.memory_map(path)).read_all()
    assert table.schema.names == ["key", "value", "value_scale", "adam_m"]
    assert table.schema.field("value").type == pa.binary(16)  # a row's 16 int8 codes
    assert table.schema.field("value").metadata == {b"de_store.dtype": b"packed_int8"}
    assert table.schema.field("value_scale").type == pa.float16()
    # as docs/reading_shards.md shows
    packed = table["value"].combine_chunks()
    codes = np.frombuffer(packed.buffers()[1], np.int8)[packed.offset * 16 :][: len(packed) * 16]
    scale = table["value_scale"].to_numpy().astype(np.float32)
    values = codes.reshape(-1, 16).astype(np.float32) * scale[:, None]
    np.testing.assert_array_equal(values, restored)


def edge_rows(dim: int) -> np.ndarray:
    """Trained-like rows, float16's subnormal range and its largest values, values halfway
    between two float16 neighbours (ties, to even), zeros and negative zeros."""
    rng = np.random.default_rng(7)
    halves = rng.standard_normal(300 * dim).astype(np.float16)
    above = np.nextafter(halves, np.float16(np.inf))
    ties = (halves.astype(np.float32) + above.astype(np.float32)) / 2  # exact in float32
    parts = [
        rows_like_trained(3000, dim, seed=3),
        (rng.standard_normal((200, dim)) * 1e-6).astype(np.float32),
        (rng.uniform(-65519, 65519, (200, dim))).astype(np.float32),
        ties.reshape(-1, dim),
        np.zeros((1, dim), np.float32),
        np.full((1, dim), -0.0, np.float32),
    ]
    return np.concatenate(parts)


@pytest.mark.parametrize("dim", [1, 3, 16, 33])
def test_tensorflow_and_numpy_store_the_same_float16_bytes(monkeypatch, dim) -> None:
    """A save rounds to float16 with TensorFlow's cast (it is loaded there), compaction
    (which runs without TensorFlow) with numpy's: the stored bytes are the same either
    way, and so are the refusals."""
    import tensorflow  # noqa: F401  (a save's process holds it)

    values = edge_rows(dim)
    keys = np.arange(len(values), dtype=np.int64)
    values[5, 0], values[6, -1] = np.inf, np.nan  # kept as they are
    assert precision._eager_tensorflow() is not None
    with_tf, _ = precision.encode(values, "float16", keys, "emb")
    monkeypatch.setattr(precision, "_eager_tensorflow", lambda: None)
    with_numpy, _ = precision.encode(values, "float16", keys, "emb")
    assert with_tf.dtype == with_numpy.dtype == np.float16
    assert with_tf.tobytes() == with_numpy.tobytes()
    monkeypatch.undo()
    bad = values.copy()
    bad[9, 0] = 70000.0
    errors = []
    for tf_loaded in (True, False):
        if not tf_loaded:
            monkeypatch.setattr(precision, "_eager_tensorflow", lambda: None)
        with pytest.raises(ValueError, match=r"row of key 9 holds 70000\.0, past float16") as got:
            precision.encode(bad, "float16", keys, "emb")
        errors.append(str(got.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("dim", [1, 3, 16, 33, 64, 100])
def test_int8_codes_and_scales_are_the_documented_ones(dim) -> None:
    """``s`` is ``max|x| / 127`` rounded up to a float16 and ``q = rint(x / s)``, row by
    row, whatever way the rows' largest magnitudes are found."""
    values = edge_rows(dim)
    values[0] = -0.0
    keys = np.arange(len(values), dtype=np.int64)
    codes, beside = precision.encode(values, "int8", keys, "emb")
    scale = beside[precision.SCALE_COLUMN]
    largest = np.array([max(abs(float(x)) for x in row) for row in values], np.float32)
    wanted = largest / np.float32(127)
    expected = wanted.astype(np.float16)
    low = expected.astype(np.float32) < wanted
    expected[low] = np.nextafter(expected[low], np.float16(np.inf))
    assert scale.tobytes() == expected.tobytes()  # +0.0 for a row of zeros, never -0.0
    for row in (0, 1, 7, len(values) // 2, len(values) - 1):
        step = np.float32(expected[row]) or np.float32(1)
        want = [round(float(np.float32(x) / step)) for x in values[row]]  # ties to even
        assert codes[row].tolist() == want
