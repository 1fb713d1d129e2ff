"""The conformance suite of the :class:`~de_store.formats.ShardFormat` contract.

A format's test file subclasses :class:`ShardFormatTests` (every format) or
:class:`ColumnarShardFormatTests` (a format that also stores string keys, extra columns,
its own schema and compressed data, as Parquet and Arrow IPC do) and names the format;
pytest then runs every test here against it, on a local folder and on fsspec's memory
filesystem::

    from de_store.testing.format_suite import ColumnarShardFormatTests

    class TestMyFormat(ColumnarShardFormatTests):
        format_name = "mine"            # registered with de_store.formats
        compressions = ("zstd",)

de_store's own formats (parquet, arrow, binary) run it the same way. This module needs
pytest (a test dependency); ``import de_store`` does not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pytest

from de_store.backends import Backend, open_backend
from de_store.formats import (
    ExtraColumn,
    SchemaInfo,
    ShardFormat,
    ShardInfo,
    batch_from_numpy,
    batch_to_numpy,
    get_format,
)
from de_store.testing.shard_data import concat, make_keys, make_values, same

#: Value dtypes every format stores.
VALUE_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")


class ShardFormatTests:
    """Behaviour every shard format must show. Subclasses set :attr:`format_name`."""

    #: The format's registry name (see ``de_store.formats.get_format``).
    format_name: ClassVar[str]
    #: Key dtypes the format stores.
    key_dtypes: ClassVar[tuple[str, ...]] = ("int64", "int32")
    #: Whether reads are tested with the writer's ShardInfo only (True), or also without
    #: it (False: the format reads its own schema).
    verified_reads: ClassVar[tuple[bool, ...]] = (True,)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrize the tests with what the subclass declares."""
        declared = {"key_dtype": self.key_dtypes, "verified": self.verified_reads}
        declared.update(self._declared_parameters())
        for name, values in declared.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, values)

    def _declared_parameters(self) -> dict[str, tuple[Any, ...]]:
        return {}

    def make_format(self, **options: Any) -> ShardFormat:
        """The format under test, built with ``options`` (e.g. ``compression``)."""
        return get_format(self.format_name, **options)

    @pytest.fixture(params=["local", "memory"])
    def backend(self, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
        """An empty local folder, or an empty prefix of the memory filesystem."""
        if request.param == "local":
            yield open_backend(str(tmp_path / "store"))
            return
        memory = open_backend(f"memory://de-store-format-suite-{uuid.uuid4().hex}")
        yield memory
        memory.delete("", recursive=True)

    def write_read(
        self,
        backend: Backend,
        keys: np.ndarray,
        values: np.ndarray,
        *,
        schema_info: SchemaInfo,
        extras: dict[str, np.ndarray] | None = None,
        buffer_size: int = 64,
    ) -> tuple[ShardInfo, list[pa.RecordBatch]]:
        """Write one batch as a shard, read it back verified in batches of 50 rows."""
        fmt = self.make_format()
        path = "emb/shard-0" + fmt.suffix
        batch = batch_from_numpy(keys, values, extras)
        info = fmt.write(backend, path, [batch], schema_info=schema_info, buffer_size=buffer_size)
        batches = list(fmt.read(backend, path, expected=info, buffer_size=50))
        assert all(b.num_rows <= 50 for b in batches)
        return info, batches

    @pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
    @pytest.mark.parametrize("dim", [1, 16])
    def test_round_trip_is_exact(
        self, backend: Backend, key_dtype: str, value_dtype: str, dim: int
    ) -> None:
        keys, values = make_keys(300, key_dtype), make_values(300, dim, value_dtype)
        schema = SchemaInfo("user/emb", dim, key_dtype, value_dtype)
        info, batches = self.write_read(backend, keys, values, schema_info=schema)
        got_keys, got_values, extras = concat(batches)
        assert same(got_keys, keys) and same(got_values, values) and extras == {}
        assert info.rows == 300 and [p.rows for p in info.parts] == [64, 64, 64, 64, 44]
        assert (info.min_key, info.max_key) == (min(keys.tolist()), max(keys.tolist()))
        assert info.bytes == sum(backend.size(f.path) for f in info.files)

    def test_some_parts_and_columns(self, backend: Backend, verified: bool) -> None:
        keys, values = make_keys(300, "int64"), make_values(300, 4, "float32")
        info, _ = self.write_read(backend, keys, values, schema_info=SchemaInfo("emb", 4))
        fmt = self.make_format()
        expected = info if verified else None
        batches = list(
            fmt.read(backend, info.path, parts=[3, 1], expected=expected, columns=["key"])
        )
        assert [b.schema.names for b in batches] == [["key"]] * len(batches)
        got = np.concatenate([b.column(0).to_numpy() for b in batches])
        assert same(got, np.concatenate([keys[192:256], keys[64:128]]))
        value_only = list(fmt.read(backend, info.path, expected=expected, columns=["value"]))
        assert same(_values_of(value_only), values)
        with pytest.raises(ValueError, match=r"has 5 parts .*cannot read parts \[7\]"):
            list(fmt.read(backend, info.path, parts=[7], expected=expected))

    def test_empty_shard(self, backend: Backend, verified: bool) -> None:
        fmt = self.make_format()
        empty = batch_from_numpy(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        for batches in ([], [empty]):
            info = fmt.write(backend, "empty" + fmt.suffix, batches, schema_info=SchemaInfo("e", 4))
            assert (info.rows, info.parts, info.min_key, info.max_key) == (0, (), None, None)
            assert list(fmt.read(backend, info.path, expected=info if verified else None)) == []

    def test_many_batches_become_parts_in_order(self, backend: Backend) -> None:
        fmt = self.make_format()
        keys, values = make_keys(500, "int64"), make_values(500, 2, "float16")
        batches = [
            batch_from_numpy(keys[i : i + 100], values[i : i + 100]) for i in range(0, 500, 100)
        ]
        schema = SchemaInfo("e", 2, value_dtype="float16")
        info = fmt.write(backend, "s" + fmt.suffix, batches, schema_info=schema, buffer_size=60)
        assert [p.rows for p in info.parts] == [60, 40] * 5
        assert [p.row_offset for p in info.parts] == [0, 60, 100, 160, 200, 260, 300, 360, 400, 460]
        third = info.parts[2]
        assert (third.min_key, third.max_key) == (keys[100:160].min(), keys[100:160].max())
        got_keys, got_values, _ = concat(list(fmt.read(backend, info.path, expected=info)))
        assert same(got_keys, keys) and same(got_values, values)

    def test_shard_info_survives_json(self, backend: Backend) -> None:
        keys, values = make_keys(100, "int32"), make_values(100, 3, "float32")
        info, _ = self.write_read(backend, keys, values, schema_info=SchemaInfo("e", 3, "int32"))
        again = ShardInfo.from_dict(json.loads(json.dumps(info.to_dict())))
        assert again == info
        assert len(list(self.make_format().read(backend, info.path, expected=again))) == 2


class ColumnarShardFormatTests(ShardFormatTests):
    """The suite of a format that also stores string keys, extra columns (optimizer
    slots, status), its own schema (readable without the writer's ShardInfo) and
    compressed data. Subclasses also set :attr:`compressions`."""

    key_dtypes: ClassVar[tuple[str, ...]] = ("int64", "int32", "string")
    verified_reads: ClassVar[tuple[bool, ...]] = (True, False)
    #: The format's ``compression`` options, each tested.
    compressions: ClassVar[tuple[str, ...]]

    def _declared_parameters(self) -> dict[str, tuple[Any, ...]]:
        return {"compression": self.compressions}

    def test_extra_columns_round_trip(self, backend: Backend) -> None:
        n, dim = 200, 8
        keys, values = make_keys(n, "int64"), make_values(n, dim, "float32")
        extras = {
            "adam_m": make_values(n, dim, "bfloat16", seed=2),
            "adam_v": make_values(n, dim, "float32", seed=3),
            "timestamp": np.arange(n, dtype=np.int64) + 1_700_000_000,
            "frequency": np.arange(n, dtype=np.int32),
        }
        columns = (
            ExtraColumn("adam_m", "bfloat16", dim),
            ExtraColumn("adam_v", "float32", dim),
            ExtraColumn("timestamp", "int64"),
            ExtraColumn("frequency", "int32"),
        )
        schema = SchemaInfo("emb", dim, extras=columns)
        info, batches = self.write_read(backend, keys, values, extras=extras, schema_info=schema)
        got_keys, got_values, got_extras = concat(batches)
        assert same(got_keys, keys) and same(got_values, values)
        assert list(got_extras) == list(extras)
        assert all(same(got_extras[name], extras[name]) for name in extras)
        assert info.columns == ("key", "value", "adam_m", "adam_v", "timestamp", "frequency")

    def test_compressions_round_trip(self, backend: Backend, compression: str) -> None:
        fmt = self.make_format(compression=compression)
        keys, values = make_keys(400, "string"), np.zeros((400, 16), np.float32)
        info = fmt.write(
            backend,
            "c" + fmt.suffix,
            [batch_from_numpy(keys, values)],
            schema_info=SchemaInfo("e", 16, "string"),
        )
        assert info.bytes < values.nbytes  # zeros compress
        got_keys, got_values, _ = concat(list(fmt.read(backend, info.path, expected=info)))
        assert same(got_keys, keys) and same(got_values, values)


def _values_of(batches: list[pa.RecordBatch]) -> np.ndarray:
    """The value rows of batches read without their key column."""
    return np.concatenate(
        [batch_to_numpy(b.add_column(0, "key", pa.nulls(b.num_rows)))[1] for b in batches]
    )
