"""The table core suite on HashTable (serial and unordered scatters), plus its own
behaviour: growth, kernels shared between tables, compiled probe rounds, bulk loads."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from de_store.tables import HashTable
from de_store.tables._index import capacity_for
from de_store.testing.table_suite import TableCoreTests, content, rows
from de_store.testing.tables import with_row_growth, with_unordered_scatters


class TestHashTable(TableCoreTests):
    def make_table(self, key_dtype, value_dtype, dim, name):
        return HashTable(key_dtype, value_dtype, dim, name=name)


class TestHashTableUnorderedScatters(TableCoreTests):
    """The kernels of a table on a GPU (unordered scatters), run here on the CPU."""

    def make_table(self, key_dtype, value_dtype, dim, name):
        return with_unordered_scatters(HashTable(key_dtype, value_dtype, dim, name=name))


class TestHashTableGatheredRows(TableCoreTests):
    """A table whose row store grows by a gather into a store ``row_growth`` times bigger,
    as on a GPU (a table on a CPU grows into unwritten stores sized for its index)."""

    def make_table(self, key_dtype, value_dtype, dim, name):
        return with_row_growth(HashTable(key_dtype, value_dtype, dim, name=name), False)


class TestHashTableFixedShapes(TableCoreTests):
    """The layout of a table on a parameter server: every variable keeps its shape, and
    the table grows into new variables."""

    def make_table(self, key_dtype, value_dtype, dim, name):
        return HashTable(key_dtype, value_dtype, dim, name=name, fixed_shapes=True)


def test_dynamic_length_mismatch_fails_before_any_change():
    table = HashTable(tf.int64, tf.float32, 3, name="emb/user")
    insert = tf.function(
        table.insert,
        input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, 3], tf.float32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="emb/user"):
        insert(tf.constant([1, 2], tf.int64), tf.ones([3, 3]))
    assert int(table.size()) == 0


def test_checkpoint_restores_into_a_table_of_another_capacity(tmp_path):
    big = HashTable(tf.int64, tf.float16, 2, name="big")
    keys = tf.range(0, 5000, 3, dtype=tf.int64)
    big.insert(keys, tf.cast(tf.stack([keys, -keys], 1) % 1000, tf.float16))
    big.remove(keys[:100])
    path = tf.train.Checkpoint(table=big).write(str(tmp_path / "ckpt"))
    small = HashTable(tf.int64, tf.float16, 2, name="small")
    assert small.capacity() < big.capacity()
    tf.train.Checkpoint(table=small).read(path).assert_consumed()
    assert small.capacity() == big.capacity()
    assert content(small) == content(big)
    small.insert(tf.constant([1], tf.int64), tf.ones([1, 2], tf.float16))  # still usable
    assert int(small.size()) == int(big.size()) + 1


def test_variables_live_on_the_creation_device():
    with tf.device("/CPU:0"):
        table = HashTable(tf.int64, tf.float32, 3)
    assert all("CPU:0" in v.device for v in table.variables)
    assert len(table.trainable_variables) == 0


def test_tables_of_one_config_share_kernels_not_contents():
    first = HashTable(tf.int64, tf.float32, 3, name="first")
    first.insert(tf.constant([1, 2], tf.int64), rows(2))
    second = HashTable(tf.int64, tf.float32, 3, name="second")
    second.insert(tf.constant([3], tf.int64), rows(1, 10.0))
    del first
    third = HashTable(tf.int64, tf.float32, 3, name="third")

    @tf.function
    def grow_both(keys):
        third.insert(keys, rows(40))
        second.remove(keys[:1])

    grow_both(tf.range(3, 43, dtype=tf.int64))
    assert content(second) == {}
    assert sorted(content(third)) == list(range(3, 43))
    third.insert(tf.constant([99], tf.int64), rows(1))  # eager again, after the trace
    with tf.GradientTape():  # a taped eager call must not reach the deleted table
        _, exists = third.lookup(tf.constant([99, 1], tf.int64))
    assert exists.numpy().tolist() == [True, False]
    assert int(third.size()) == 41 and int(second.size()) == 0


def test_reserve_grows_once_for_a_bulk_load():
    table = HashTable(tf.int64, tf.float32, 2, name="bulk")
    table.insert(np.array([7], np.int64), np.ones([1, 2], np.float32))
    table.reserve(5000)
    capacity, store = table.capacity(), table.memory_bytes()
    keys = np.arange(5000, dtype=np.int64)
    table.insert(keys, np.stack([keys, -keys], axis=1).astype(np.float32))
    assert (table.capacity(), table.memory_bytes()) == (capacity, store)  # no growth
    values, exists = table.lookup(np.array([7, 4999, 5000], np.int64))
    assert exists.numpy().tolist() == [True, True, False]
    assert values.numpy().tolist() == [[7, -7], [4999, -4999], [0, 0]]


@pytest.mark.parametrize("scatters", ["serial", "unordered"])
def test_big_batches_agree_with_a_dict(scatters):
    """Batches of many thousand keys (long probe chains, many claim races, growth)."""
    table = HashTable(tf.int64, tf.float32, 2, name="big_batches")
    table = with_unordered_scatters(table) if scatters == "unordered" else table
    rng = np.random.default_rng(7)
    n = 70_000
    keys = rng.integers(-(1 << 40), 1 << 40, n, dtype=np.int64)
    keys[::7] = keys[: len(keys[::7])]  # repeated keys, some in the same batch
    rows = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)
    model: dict[int, list[float]] = {}
    for start in (0, n // 3):
        batch, values = keys[start:], rows[start:] + start
        table.insert(batch, values)
        model.update(zip(batch.tolist(), values.tolist(), strict=True))
        table.accum(batch[::2], np.ones([len(batch[::2]), 2], np.float32))
        for key in batch[::2].tolist():
            model[key] = [model[key][0] + 1, model[key][1] + 1]
    table.remove(keys[: n // 4])
    for key in keys[: n // 4].tolist():
        model.pop(key, None)
    probe = np.concatenate([keys, keys + 1])
    values, exists = table.lookup(probe)
    expected = [key in model for key in probe.tolist()]
    assert exists.numpy().tolist() == expected
    present = np.asarray(expected)
    want = np.array([model[key] for key in probe[present].tolist()], np.float32)
    np.testing.assert_array_equal(values.numpy()[present], want)
    assert int(table.size()) == len(model)


def test_keys_past_the_compiled_probe_rounds_are_found_by_the_loop():
    """Big batches start with XLA-compiled probe rounds; the keys they leave unresolved
    (long chains at a 0.9 load factor, missing keys) go on in the graph loop."""
    from de_store.tables import _index

    table = HashTable(tf.int32, tf.float64, 1, name="dense_load", max_load_factor=0.9)
    rng = np.random.default_rng(3)
    keys = rng.choice(np.iinfo(np.int32).max, 40_000, replace=False).astype(np.int32)
    present, missing = keys[:30_000], keys[30_000:]
    table.insert(present, present[:, None].astype(np.float64))
    batch = np.concatenate([present, missing, present[:5000]])  # repeats too
    _, _, next_pos = _index.first_probes(table._state.index.handle, batch.astype(np.int64))
    assert (next_pos.numpy()[:30_000] >= 0).sum() > 100  # present keys reach the loop

    lookup = tf.function(lambda k: table.lookup(k), autograph=False)
    for values, exists in (table.lookup(batch), lookup(tf.constant(batch))):
        expected = np.isin(batch, present)
        assert exists.numpy().tolist() == expected.tolist()
        np.testing.assert_array_equal(values.numpy()[:, 0], np.where(expected, batch, 0))

    table.accum(batch, np.ones([len(batch), 1]), insert_missing=False)
    values, _ = table.lookup(present)
    np.testing.assert_array_equal(values.numpy()[:, 0], present + 1 + (np.arange(30_000) < 5000))
    assert int(table.size()) == 30_000

    table.remove(np.concatenate([present[::2], missing]))
    values, exists = table.lookup(present)
    assert exists.numpy().tolist() == [i % 2 == 1 for i in range(30_000)]
    assert int(table.size()) == 15_000


@pytest.fixture(params=["one chunk", "chunks of 512"])
def race_chunk(request, monkeypatch):
    """The keys a big batch leaves to the loop race in chunks of ``_claim_loop.CHUNK``: the
    default (one chunk here), or chunks of 512, each race seeing the claims of the ones
    before. Kernels are traced again for the patched size."""
    from de_store.tables import _claim_loop, _kernels

    if request.param != "one chunk":
        monkeypatch.setattr(_claim_loop, "CHUNK", 512)
    _kernels.kernels_for.cache_clear()
    yield request.param
    _kernels.kernels_for.cache_clear()


@pytest.mark.parametrize("scatters", ["serial", "unordered"])
def test_big_batch_claims_left_to_the_loop_agree_with_a_dict(scatters, race_chunk):
    """A big insert claims the empty slots its compiled probe rounds stopped at in one
    race; keys past those rounds (a 0.9 load factor) and the race's losers (repeats, keys
    of one home slot) go on in the loop, which races them in chunks. Present, new and
    repeated keys mixed."""
    from de_store.tables import _index

    # sized for the 40,000 keys first inserted: 65,536 slots (an insert that grows the
    # index would leave room for more batches, and the load would stay low)
    table = HashTable(tf.int64, tf.int64, 1, name="claims", max_load_factor=0.9, init_size=40_000)
    table = with_unordered_scatters(table) if scatters == "unordered" else table
    rng = np.random.default_rng(11)
    keys = rng.choice(1 << 50, 50_000, replace=False).astype(np.int64)
    table.insert(keys[:40_000], keys[:40_000, None])  # load 0.61
    model = dict(zip(keys[:40_000].tolist(), keys[:40_000].tolist(), strict=True))
    batch = np.concatenate([keys[35_000:], keys[42_000:44_000], keys[49_000:]])
    assert len(batch) >= _index.COMPILED_MIN_KEYS
    batch = rng.permutation(batch)  # present keys, new keys, new keys repeated
    _, stop, next_pos = _index.first_probes(table._state.index.handle, batch)
    assert (next_pos.numpy() >= 0).sum() > 2000  # keys left to the loop
    assert (stop.numpy() >= 0).sum() > 6000  # keys that stopped at a hit or a claim
    values = np.arange(len(batch), dtype=np.int64)[:, None]
    table.insert(batch, values)
    model.update(zip(batch.tolist(), values[:, 0].tolist(), strict=False))  # last wins
    assert table.capacity() == 65_536  # no rehash: the claims met the first probes' index
    content = dict(zip(*(x.numpy().tolist() for x in table.export_all()), strict=True))
    assert {key: value[0] for key, value in content.items()} == model
    assert int(table.size()) == len(model) == 50_000


@pytest.mark.parametrize("size", [64, 20_000])  # the graph loop; the compiled race
@pytest.mark.parametrize("op", ["insert", "accum"])
def test_a_batch_of_mostly_new_keys_keeps_its_rows_dense(size, op):
    """A batch with few present or repeated keys (at most 1/16) gives its new keys the
    rows their claims named, moving the new keys named past the batch's new rows into the
    rows of the keys found: every row up to ``next_row`` belongs to a key, none is freed."""
    table = HashTable(tf.int64, tf.int64, 1, name="dense_rows")
    rng = np.random.default_rng(5)
    keys = rng.choice(1 << 40, 2 * size, replace=False).astype(np.int64)
    held = keys[: size // 2]
    table.insert(held, held[:, None])
    model = dict(zip(held.tolist(), held.tolist(), strict=True))
    # new keys, some present keys and some new keys again, spread over the batch
    batch = np.concatenate([keys[size:], held[: size // 40], keys[size : size + size // 40]])
    batch = rng.permutation(batch)
    assert 16 * (len(batch) - len(set(batch.tolist()) - set(model))) <= len(batch)
    deltas = np.arange(len(batch), dtype=np.int64)[:, None] + 1
    if op == "insert":
        table.insert(batch, deltas)
        model.update(zip(batch.tolist(), deltas[:, 0].tolist(), strict=True))
    else:
        table.accum(batch, deltas)
        for key, delta in zip(batch.tolist(), deltas[:, 0].tolist(), strict=True):
            model[key] = model.get(key, 0) + delta
    content = dict(zip(*(x.numpy().tolist() for x in table.export_all()), strict=True))
    assert {key: value[0] for key, value in content.items()} == model
    state = table._state
    assert int(state.next_row) == int(table.size()) == len(model)
    assert int(state.num_free) == 0
    live_rows = state.index.numpy()[:, 1]
    assert sorted(live_rows[live_rows >= 0].tolist()) == list(range(len(model)))


@pytest.mark.parametrize("scatters", ["serial", "unordered"])
def test_load_distinct_bulk_loads_big_batches_with_growth(scatters):
    table = HashTable(tf.int64, tf.float32, 2, name="bulk_load")
    table = with_unordered_scatters(table) if scatters == "unordered" else table
    rng = np.random.default_rng(11)
    keys = rng.permutation(np.arange(-150_000, 150_000, 3, dtype=np.int64))
    rows = np.stack([keys, -keys], axis=1).astype(np.float32)
    for start in range(0, len(keys), 40_000):  # grows several times on the way
        table.load_distinct(keys[start : start + 40_000], rows[start : start + 40_000])
    assert int(table.size()) == len(keys)
    values, exists = table.lookup(np.concatenate([keys, keys + 1]))
    assert exists.numpy().tolist() == [True] * len(keys) + [False] * len(keys)
    np.testing.assert_array_equal(values.numpy()[: len(keys)], rows)


@pytest.mark.parametrize(
    "keys",
    [
        [4, 8, 15, 8],  # repeated in the batch
        [16, 23, 42, 42, 42],
        [7],  # present already
        # a batch that starts with the compiled probe rounds: 500 repeats, 1 present
        list(range(1000, 21_000)) + list(range(5000, 5500)) + [7],
    ],
    ids=["repeat", "repeats", "present", "big"],
)
def test_load_distinct_refuses_repeated_or_present_keys_and_clears(keys):
    from de_store.errors import RepeatedKeysError

    table = HashTable(tf.int64, tf.float32, 3, name="emb/restore")
    table.insert(tf.constant([7], tf.int64), rows(1))
    batch = tf.constant(keys, tf.int64)
    repeated = len(keys) - len(set(keys)) + (7 in keys)
    with pytest.raises(
        RepeatedKeysError,
        match=rf"table 'emb/restore': load_distinct expects keys absent from the table and "
        rf"distinct; {repeated} keys were present already or repeated \(the table was cleared\)",
    ):
        table.load_distinct(batch, rows(len(keys)))
    assert int(table.size()) == 0
    table.insert(batch, rows(len(keys)))  # usable again
    assert int(table.size()) == len(set(keys))


def test_clear_returns_index_and_row_store_to_their_initial_sizes():
    table = HashTable(tf.int64, tf.float32, 2, name="cleared", init_size=1000)
    initial = (table.capacity(), table.memory_bytes())
    keys = np.arange(5000, dtype=np.int64)
    table.insert(keys, np.ones([5000, 2], np.float32))
    table.remove(keys[:10])
    assert table.capacity() > initial[0]
    table.clear()
    assert (table.capacity(), table.memory_bytes(), int(table.size())) == (*initial, 0)
    _, exists = table.lookup(keys)
    assert not exists.numpy().any()
    table.clear()  # already empty and at the initial sizes: nothing to do
    table.insert(keys[:3], np.full([3, 2], 7.0, np.float32))
    assert content(table) == {0: (7.0, 7.0), 1: (7.0, 7.0), 2: (7.0, 7.0)}


def test_clear_keeps_the_room_of_a_table_grown_for_rows_to_come():
    """A restore grows an empty table while it reads the shards, then clears it: the
    room stays, and the table still holds nothing."""
    table = HashTable(tf.int64, tf.float32, 2, name="reserved")
    table.reserve(50_000)
    grown = (table.capacity(), table.memory_bytes())
    table.clear()
    assert (table.capacity(), table.memory_bytes(), int(table.size())) == (*grown, 0)
    keys = np.arange(50_000, dtype=np.int64)
    table.load_distinct(keys, np.ones([50_000, 2], np.float32))
    assert (table.capacity(), table.memory_bytes()) == grown  # no growth
    _, exists = table.lookup(keys)
    assert exists.numpy().all()


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_a_hash_table_snapshot_looks_keys_up(fixed_shapes: bool) -> None:
    """Async saves read a variable's optimizer slots by looking its keys up in the slot
    tables' snapshots; the conformance suite checks what the lookups return."""
    table = HashTable(tf.int64, tf.float32, 2, name="emb/slot", fixed_shapes=fixed_shapes)
    table.insert(tf.constant([3, 4], tf.int64), tf.ones([2, 2]))
    snapshot = table.snapshot()
    assert snapshot.lookup is not None
    table.insert(tf.constant([5], tf.int64), tf.ones([1, 2]))
    assert snapshot.lookup(tf.constant([4, 5], tf.int64)).numpy().tolist() == [[1, 1], [0, 0]]


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.int32])
def test_a_snapshot_read_in_store_order_holds_the_rows_of_its_moment(key_dtype) -> None:
    """A one-process save writes a snapshot's rows as the row store holds them: row ``i``
    of a batch of new keys is the batch's key ``i``. Writes after the snapshot (updates,
    new keys, a growth) never show in it."""
    table = HashTable(key_dtype, tf.float32, 2, name="emb/ordered")
    keys = np.random.default_rng(5).permutation(np.arange(-500, 1500)).astype(np.int64)
    table.insert(tf.constant(keys, key_dtype), tf.constant(np.stack([keys, keys], 1), tf.float32))
    snapshot = table.snapshot()
    assert snapshot.read_in_store_order is not None
    table.insert(tf.constant(keys[:100], key_dtype), tf.zeros([100, 2]))
    table.insert(tf.range(5000, 90_000, dtype=key_dtype), tf.ones([85_000, 2]))
    read = snapshot.read_in_store_order()
    assert read is not None
    got_keys, got_values = read
    assert got_keys.dtype == key_dtype.as_numpy_dtype
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_values, np.stack([keys, keys], 1).astype(np.float32))


def test_a_snapshot_with_freed_rows_is_not_read_in_store_order() -> None:
    """Removed keys free their rows: the live rows are no longer the store's first ones,
    and ``read_rows`` serves instead (the writer then gathers the live rows)."""
    table = HashTable(tf.int64, tf.float32, 1, name="emb/holes")
    table.insert(tf.range(10, dtype=tf.int64), tf.zeros([10, 1]))
    table.remove(tf.constant([3], tf.int64))
    snapshot = table.snapshot()
    assert snapshot.read_in_store_order is not None and snapshot.read_in_store_order() is None
    table.insert(tf.constant([42], tf.int64), tf.ones([1, 1]))  # takes the freed row 3
    read = table.snapshot().read_in_store_order()
    assert read is not None
    assert read[0].tolist() == [0, 1, 2, 42, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_a_snapshot_with_freed_rows_reads_its_live_rows_in_store_order(
    fixed_shapes: bool,
) -> None:
    """``read_rows`` gives the live rows' keys and row ids front to back (the rows on the
    free list left out), as of the snapshot: removals and new keys after it (which take
    freed rows and free others) never show in it."""
    table = HashTable(tf.int64, tf.float32, 1, name="emb/free", fixed_shapes=fixed_shapes)
    keys = np.arange(100, 0, -1, dtype=np.int64)
    table.insert(tf.constant(keys), tf.constant(keys[:, None], tf.float32))
    table.remove(tf.constant(keys[::4]))
    snapshot = table.snapshot()
    assert snapshot.read_rows is not None
    table.remove(tf.constant(keys[1::4]))
    table.insert(tf.range(1000, 1100, dtype=tf.int64), tf.zeros([100, 1]))
    got_keys, rows, store = (np.asarray(x) for x in snapshot.read_rows())
    kept = np.delete(np.arange(100), np.s_[::4])
    np.testing.assert_array_equal(rows, kept)
    np.testing.assert_array_equal(got_keys, keys[kept])
    np.testing.assert_array_equal(store[rows, 0], keys[kept].astype(np.float32))


def test_a_fixed_shape_table_reads_in_store_order_across_its_growth() -> None:
    """A fixed-shape table grows into new variables: the key of each row moves with it."""
    table = HashTable(tf.int64, tf.float32, 1, name="emb/fixed_order", fixed_shapes=True)
    keys = np.arange(40, 0, -1, dtype=np.int64)
    for start in range(0, 40, 10):  # each batch grows the table
        batch = keys[start : start + 10]
        table.insert(tf.constant(batch), tf.constant(batch[:, None], tf.float32))
    read = table.snapshot().read_in_store_order
    assert read is not None
    got = read()
    assert got is not None
    np.testing.assert_array_equal(got[0], keys)
    np.testing.assert_array_equal(got[1][:, 0], keys.astype(np.float32))


def test_an_insert_that_grows_the_index_leaves_room_for_three_more_like_it() -> None:
    """Each capacity costs a rehash and XLA compiles: a table filled batch after batch
    grows once for four batches. A bulk load (a restore) sizes the index exactly."""
    table = HashTable(tf.int64, tf.float32, 2, name="emb/filled")
    batches = [tf.range(i * 1000, (i + 1) * 1000, dtype=tf.int64) for i in range(4)]
    table.insert(batches[0], tf.ones([1000, 2]))
    assert capacity_for(1000, table.max_load_factor) == 2048
    assert table.capacity() == capacity_for(4000, table.max_load_factor) == 8192
    for batch in batches[1:]:
        table.insert(batch, tf.ones([1000, 2]))
        assert table.capacity() == 8192
    assert content(table) == {k: (1.0, 1.0) for k in range(4000)}
    loaded = HashTable(tf.int64, tf.float32, 2, name="emb/loaded")
    loaded.reserve(1000)
    loaded.load_distinct(batches[0], tf.ones([1000, 2]))
    assert loaded.capacity() == 2048


def test_compile_load_writes_nothing():
    """A restore has XLA compile its load batches' first race on the real index while it
    reads: no key takes part, so the table is as it was."""
    table = HashTable(tf.int64, tf.float32, 2, name="compiled")
    keys = np.arange(40_000, dtype=np.int64) * 3
    table.load_distinct(keys[:20_000], np.ones([20_000, 2], np.float32))
    before = content(table)
    table.compile_load(20_000)
    assert content(table) == before
    table.load_distinct(keys[20_000:], np.full([20_000, 2], 2.0, np.float32))
    assert int(table.size()) == 40_000
    values, exists = table.lookup(keys)
    assert exists.numpy().all()
    assert values.numpy()[:, 0].tolist() == [1.0] * 20_000 + [2.0] * 20_000


def _rows_held(table: HashTable) -> int:
    return int(tf.raw_ops.VariableShape(input=table.values.handle)[0])


@pytest.mark.parametrize("row_growth", [1.25, 1.01])
def test_a_reserving_row_store_grows_with_its_index_and_keeps_every_row(row_growth) -> None:
    """A table on a CPU filled batch after batch grows its row store into unwritten
    stores, for every key its index holds, not by ``row_growth`` a time: at most once per
    capacity of the index. Each growth keeps every row in use, freed rows too, which
    inserts take first."""
    table = HashTable(tf.int64, tf.float32, 2, name="emb/rows", row_growth=row_growth)
    keys = np.arange(20_000, dtype=np.int64)
    values = np.stack([keys, -keys], axis=1).astype(np.float32)
    table.insert(keys[:100], values[:100])
    table.remove(keys[:10])
    sizes = [(table.capacity(), _rows_held(table))]
    for start in range(100, 20_000, 300):
        table.insert(keys[start : start + 300], values[start : start + 300])
        capacity, rows = table.capacity(), _rows_held(table)
        if rows != sizes[-1][1]:
            assert rows >= int(capacity * table.max_load_factor)
        sizes.append((capacity, rows))
    row_growths = sum(a[1] != b[1] for a, b in itertools.pairwise(sizes))
    index_growths = sum(a[0] != b[0] for a, b in itertools.pairwise(sizes))
    assert 0 < row_growths <= index_growths
    expected = {int(k): (float(k), float(-k)) for k in keys[10:]}
    assert content(table) == expected


def test_a_gathering_row_store_grows_by_row_growth() -> None:
    """A table that grows its row store by a gather (on a GPU) grows it by ``row_growth``
    times the rows a batch needs, however big the index is."""
    table = with_row_growth(HashTable(tf.int64, tf.float32, 1, name="emb/gather"), False)
    keys = np.arange(5_000, dtype=np.int64)
    growths = []
    for start in range(0, 5_000, 10):
        held = _rows_held(table)
        table.insert(keys[start : start + 10], keys[start : start + 10, None].astype(np.float32))
        if _rows_held(table) != held:
            growths.append((start + 10, _rows_held(table)))
    assert len(growths) > 10
    assert all(rows == math.ceil(needed * 1.25) for needed, rows in growths)
    assert content(table) == {int(k): (float(k),) for k in keys}
