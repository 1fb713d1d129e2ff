"""TFRA 0.8.1 FileSystemSaver folders: exact import of real checkpoints, byte-exact export."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pytest
from formats_testdata import make_keys, make_values, same

from de_store.errors import FormatError
from de_store.formats import batch_from_numpy, batch_to_numpy, tfra

SAMPLES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "interop" / "tfra-0.8.1"
if not SAMPLES.is_dir():
    SAMPLES = pathlib.Path("/work/shared/interop/tfra-0.8.1")

pytestmark = pytest.mark.skipif(not SAMPLES.is_dir(), reason="TFRA samples not available")


def expected(folder: str, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    data = [np.load(SAMPLES / folder / f"expected_rank{r}.npz") for r in range(ranks)]
    return np.concatenate([d["keys"] for d in data]), np.concatenate([d["values"] for d in data])


def sorted_by_key(keys, values):
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


@pytest.mark.parametrize(
    ("folder", "name", "dim", "ranks"),
    [("basic", "user_emb", 8, 1), ("two_procs", "item_emb", 4, 2)],
)
def test_real_tfra_checkpoints_import_exactly(folder, name, dim, ranks):
    table = tfra.read_table(str(SAMPLES / folder / tfra.FOLDER), name, dim=dim)
    keys, values, _ = batch_to_numpy(table)
    want_keys, want_values = sorted_by_key(*expected(folder, ranks))
    got_keys, got_values = sorted_by_key(keys, values)
    assert same(got_keys, want_keys) and same(got_values, want_values)
    assert table.schema.names == ["key", "value"]
    # the checkpoint folder itself works too (its TFRADynamicEmbedding is found)
    assert tfra.read_table(str(SAMPLES / folder), name, dim=dim).equals(table)


def test_written_files_equal_tfras_byte_for_byte(tmp_path):
    source = SAMPLES / "basic" / tfra.FOLDER
    table = tfra.read_table(str(source), "user_emb", dim=8)
    infos = tfra.write_table(str(tmp_path), "user_emb", table, num_tables=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in source.iterdir())
    for path in source.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
    assert [i.rows for i in infos] == [1477, 1488]


def test_two_ranks_write_into_one_folder(tmp_path):
    source = SAMPLES / "two_procs" / tfra.FOLDER
    for rank in range(2):
        keys_file = source / f"item_emb_mht_1of1_rank{rank}_size2-keys"
        keys = np.fromfile(keys_file, "<i8")
        values = np.fromfile(str(keys_file)[: -len("keys")] + "values", "<f4").reshape(-1, 4)
        tfra.write_table(
            str(tmp_path), "item_emb", batch_from_numpy(keys, values), proc_rank=rank, proc_size=2
        )
    for path in source.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16", "float64", "int64"])
@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
def test_write_then_read_round_trips(memory_location, key_dtype, value_dtype):
    keys, values = make_keys(1000, key_dtype), make_values(1000, 3, value_dtype)
    name = "tower/user_emb"
    tfra.write_table(
        memory_location.url,
        name,
        batch_from_numpy(keys, values),
        num_tables=3,
        proc_rank=1,
        proc_size=2,
    )
    files = memory_location.open().list()
    assert "tower_user_emb_mht_3of3_rank1_size2-values" in files and len(files) == 6
    with pytest.raises(
        FormatError, match=r"incomplete: missing \['tower_user_emb_mht_1of3_rank0_size2-keys'"
    ):
        tfra.read_table(
            memory_location.url, name, dim=3, key_dtype=key_dtype, value_dtype=value_dtype
        )
    tfra.write_table(
        memory_location.url,
        name,
        batch_from_numpy(keys[:0], values[:0]),
        num_tables=3,
        proc_rank=0,
        proc_size=2,
    )
    table = tfra.read_table(
        memory_location.url, name, dim=3, key_dtype=key_dtype, value_dtype=value_dtype
    )
    got_keys, got_values, _ = batch_to_numpy(table)
    want_keys, want_values = sorted_by_key(keys, values)
    got_keys, got_values = sorted_by_key(got_keys, got_values)
    assert same(got_keys, want_keys) and same(got_values, want_values)


def test_sizes_that_do_not_fit_dim_name_both_files():
    folder = str(SAMPLES / "basic" / tfra.FOLDER)
    with pytest.raises(FormatError) as err:
        tfra.read_table(folder, "user_emb", dim=7)
    message = str(err.value)
    assert "user_emb_mht_1of2_rank0_size1-keys (11816 bytes)" in message
    assert "user_emb_mht_1of2_rank0_size1-values (47264 bytes)" in message
    assert "dim=7" in message


def test_no_files_for_the_variable():
    with pytest.raises(FormatError, match=r"no TFRA files of variable 'nope' under"):
        tfra.read_table(str(SAMPLES / "basic"), "nope", dim=8)


def test_read_batches_streams_in_buffer_sized_batches():
    folder = str(SAMPLES / "basic" / tfra.FOLDER)
    batches = list(tfra.read_batches(folder, "user_emb", dim=8, buffer_size=500))
    assert [b.num_rows for b in batches] == [500, 500, 477, 500, 500, 488]
    assert pa.Table.from_batches(batches).equals(tfra.read_table(folder, "user_emb", dim=8))


#: What TFRA 0.8.1 (TF 2.16.2 stock wheel, CPU) wrote for get_variable("tower/emb",
#: devices=3 CPUs): the keys of each of its three tables, in file order.
TFRA_THREE_TABLES = [[-2, 3, -5], [1, 2**31 + 1, 7 * 2**33 + 4, -1], [2**31 + 2, 2]]


def test_three_tables_split_keys_as_tfras_default_partitioner(tmp_path):
    keys = np.array([k for table in TFRA_THREE_TABLES for k in table], np.int64)
    tables = tfra.table_of(keys, 3)
    assert tables.tolist() == [i for i, table in enumerate(TFRA_THREE_TABLES) for _ in table]
    assert tfra.table_of(keys, 3, cuda_wheel=False).tolist() == np.mod(keys, 3).tolist()
    values = np.repeat(keys[:, None], 2, axis=1).astype(np.float32)
    tfra.write_table(
        str(tmp_path),
        "tower/emb",
        pa.Table.from_batches([batch_from_numpy(keys, values)]),
        num_tables=3,
    )
    for i, table in enumerate(TFRA_THREE_TABLES):
        written = np.fromfile(tmp_path / f"tower_emb_mht_{i + 1}of3_rank0_size1-keys", np.int64)
        assert sorted(written.tolist()) == sorted(table)


def test_a_damaged_commit_record_is_refused_naming_it(tmp_path):
    keys, values = make_keys(20, "int64"), make_values(20, 2, "float32")
    tfra.write_table(str(tmp_path), "emb", batch_from_numpy(keys, values))
    record = tmp_path / f".{tfra.save_group('emb', 0, 1)}{tfra.COMMIT_SUFFIX}"
    record.write_text('{"staging": "../elsewhere", "files": ["emb_mht_1of1_rank0_size1-keys"]}')
    with pytest.raises(FormatError, match=r"TFRA commit record .*/\.emb_rank0_size1\.commit: "):
        tfra.read_table(str(tmp_path), "emb", dim=2)


def test_saves_leave_only_tfras_files_each_replacing_the_last(tmp_path):
    keys = make_keys(50, "int64")
    for version in range(3):
        values = make_values(50, 4, "float32") + version
        batch = batch_from_numpy(keys, values)
        tfra.write_table(str(tmp_path), "a/b", batch, num_tables=2, proc_rank=1, proc_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"a_b_mht_{i}of2_rank1_size2-{part}" for i in (1, 2) for part in ("keys", "values")
    )
    got = np.concatenate([np.fromfile(tmp_path / f"a_b_mht_{i}of2_rank1_size2-values", "<f4")
                          for i in (1, 2)])  # fmt: skip
    assert sorted(got.tolist()) == sorted((make_values(50, 4, "float32") + 2).ravel().tolist())
