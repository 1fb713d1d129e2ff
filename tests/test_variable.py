"""get_variable and Variable: get-or-create, sharding, table operations, checkpoints, errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store.errors import VariableError
from de_store.tables import HashTable, MutableTable

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]  # 4, see conftest.py


def _sorted_export(var: ds.Variable) -> tuple[np.ndarray, np.ndarray]:
    keys, values = var.export()
    order = np.argsort(keys.numpy())
    return keys.numpy()[order], values.numpy()[order]


def test_get_variable_returns_the_same_variable_by_scoped_name() -> None:
    first = ds.get_variable("same", dim=3)
    assert ds.get_variable("same", dim=3) is first
    with tf.compat.v1.variable_scope("tower"):
        scoped = ds.get_variable("same", dim=3)
    assert scoped is not first
    assert scoped.name == "tower/same"
    with tf.name_scope("ops"):  # as in TFRA, a name scope does not name variables
        assert ds.get_variable("same", dim=3) is first


def test_get_variable_with_other_dim_or_dtype_names_both() -> None:
    held = ds.get_variable("mismatch", dim=4)
    with pytest.raises(VariableError, match=r"'mismatch'.*'float32', 4\).*'float32', 8\)"):
        ds.get_variable("mismatch", dim=8)
    with pytest.raises(VariableError, match=r"'int64'.*'int32'"):
        ds.get_variable("mismatch", key_dtype=tf.int32, dim=4)
    assert held.dim == 4


def test_default_device_is_cpu0_without_gpu() -> None:
    var = ds.get_variable("default_device")
    assert var.devices == [CPUS[0]] and len(var.shards) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": ["/GPU:7"]}, r"'bad_input': unknown device '/GPU:7'; expected one of"),
        ({"dim": 0}, r"'bad_input': expected dim >= 1, got 0"),
        ({"key_dtype": tf.float32}, r"'bad_input': expected key_dtype .* got float32"),
        ({"initializer": np.zeros(3)}, r"'bad_input': expected .* shape \[\] or \[2\], got \[3\]"),
        (
            {"initializer": lambda shape, dtype: tf.zeros([4], dtype)},
            r"'bad_input': expected initializer output of shape \[2, 2\] .* got \[4\]",
        ),
    ],
)
def test_bad_construction_names_variable_expected_and_given(kwargs: dict, message: str) -> None:
    with pytest.raises(VariableError, match=message):
        ds.get_variable("bad_input", **{"dim": 2, **kwargs})


def test_bad_keys_and_values_name_variable_expected_and_given() -> None:
    var = ds.get_variable("bad_calls", dim=2)
    with pytest.raises(
        VariableError, match=r"'bad_calls': expected keys of dtype int64, got int32"
    ):
        var.lookup(tf.constant([1], tf.int32))
    with pytest.raises(
        VariableError, match=r"'bad_calls': expected values of shape \[n, 2\], got \[1, 3\]"
    ):
        var.upsert([1], [[1.0, 2.0, 3.0]])
    with pytest.raises(VariableError, match=r"'bad_calls': expected keys of dtype int64, got <U1"):
        var.upsert(["a"], [[1.0, 2.0]])


@pytest.mark.parametrize(
    ("initializer", "expected"),
    [(None, [0.0, 0.0]), (2.5, [2.5, 2.5]), (np.array([1.0, -1.0]), [1.0, -1.0])],
)
def test_missing_keys_get_the_initializer_rows(initializer: object, expected: list) -> None:
    var = ds.Variable("init_rows", dim=2, initializer=initializer)
    values, exists = var.lookup([[5, 6]], return_exists=True)
    np.testing.assert_array_equal(values.numpy(), [[expected, expected]])
    np.testing.assert_array_equal(exists.numpy(), [[False, False]])
    assert int(var.size()) == 0


def test_callable_initializer_draws_rows_for_missing_keys_only() -> None:
    var = ds.Variable("init_callable", dim=3, initializer=tf.random_normal_initializer(seed=1))
    var.upsert([1], [[7.0, 7.0, 7.0]])
    values = var.lookup([1, 2, 3]).numpy()
    np.testing.assert_array_equal(values[0], [7.0, 7.0, 7.0])
    assert values.shape == (3, 3) and not np.array_equal(values[1], values[2])


@pytest.mark.parametrize(
    "initializer",
    [tf.constant_initializer([1.0, 2.0, 3.0]), tf.keras.initializers.Constant([1.0, 2.0, 3.0])],
    ids=["tf.constant_initializer", "keras Constant"],
)
def test_constant_initializers_fill_rows_in_functions_of_any_batch(initializer: object) -> None:
    """tf.constant(value, shape) needs the shape when the graph is built and a value of
    that many elements: the row is made once and broadcast, as TFRA does."""
    var = ds.Variable("init_constant", dim=3, initializer=initializer)
    lookup = tf.function(var.lookup, input_signature=[tf.TensorSpec([None], tf.int64)])
    for values in (lookup(tf.constant([4, 5], tf.int64)), var.lookup([4, 5])):
        np.testing.assert_array_equal(values.numpy(), [[1.0, 2.0, 3.0]] * 2)


def test_int_keys_go_to_floormod_shard_and_round_trip() -> None:
    var = ds.get_variable("sharded", dim=2, devices=CPUS[:4])
    keys = np.array([-7, -1, 0, 1, 2, 3, 4, 5, 10, 11], np.int64)
    values = np.stack([keys, -keys], axis=1).astype(np.float32)
    var.upsert(keys, values)
    for index, shard in enumerate(var.shards):
        np.testing.assert_array_equal(
            np.sort(shard.export_all()[0].numpy()), np.sort(keys[keys % 4 == index])
        )
    np.testing.assert_array_equal(var.lookup(keys).numpy(), values)
    exported = _sorted_export(var)
    np.testing.assert_array_equal(exported[0], np.sort(keys))
    np.testing.assert_array_equal(exported[1], values[np.argsort(keys)])
    assert int(var.size()) == 10


def test_partition_returns_shard_keys_with_their_positions() -> None:
    var = ds.get_variable("partition_helper", devices=CPUS[:3])
    parts = var.partition([5, -1, 3, 4])
    assert [p[0].numpy().tolist() for p in parts] == [[3], [4], [5, -1]]
    assert [p[1].numpy().tolist() for p in parts] == [[2], [3], [0, 1]]


def test_operations_work_eagerly_and_in_tf_function_across_shards() -> None:
    var = ds.get_variable("ops", dim=1, devices=CPUS[:2], initializer=-1.0)

    @tf.function
    def run(keys: tf.Tensor) -> tuple[tf.Tensor, ...]:
        var.upsert(keys, tf.ones([6, 1]))
        var.accum(keys[:3], tf.fill([3, 1], 2.0))
        var.remove(keys[-1:])
        looked, exists = var.lookup(keys, return_exists=True)
        exported_keys, _ = var.export()
        return looked, exists, var.size(), tf.size(exported_keys)

    looked, exists, size, exported = run(tf.constant([0, 1, 2, 3, 4, 5], tf.int64))
    np.testing.assert_array_equal(looked.numpy()[:, 0], [3, 3, 3, 1, 1, -1])
    np.testing.assert_array_equal(exists.numpy(), [True] * 5 + [False])
    assert int(size) == 5 and int(exported) == 5
    var.clear()
    assert int(var.size()) == 0


def test_string_keys_shard_by_hash_on_mutable_tables() -> None:
    var = ds.get_variable("strings", key_dtype=tf.string, dim=2, devices=CPUS[:3])
    assert all(isinstance(shard, MutableTable) for shard in var.shards)
    keys = [f"user{i}".encode() for i in range(50)]
    values = np.arange(100, dtype=np.float32).reshape(50, 2)
    var.upsert(keys, values)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), values)
    shard_sizes = [int(shard.size()) for shard in var.shards]
    assert sum(shard_sizes) == 50 and min(shard_sizes) > 0


class _RecordingCreator(ds.HashTableCreator):
    def __init__(self) -> None:
        super().__init__(saver="a saver")
        self.calls: list[tuple[str, int]] = []

    def create(self, key_dtype, value_dtype, dim, *, name, init_size):  # type: ignore[no-untyped-def]
        self.calls.append((name, init_size))
        return super().create(key_dtype, value_dtype, dim, name=name, init_size=init_size)


def test_kv_creator_gets_init_size_split_and_carries_saver() -> None:
    creator = _RecordingCreator()
    var = ds.get_variable("creator", devices=CPUS[:4], init_size=1000, kv_creator=creator)
    assert [size for _, size in creator.calls] == [250] * 4
    assert var.kv_creator.saver == "a saver"
    assert all(isinstance(shard, HashTable) for shard in var.shards)


def test_tf_checkpoint_restores_the_content_exactly() -> None:
    var = ds.get_variable("ckpt", dim=3, devices=CPUS[:2])
    keys = np.arange(-20, 20, dtype=np.int64)
    values = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    var.upsert(keys, values)
    checkpoint = tf.train.Checkpoint(embedding=var)
    path = checkpoint.write(str(_tmp_dir() / "ckpt"))
    var.remove(keys[:10])
    var.upsert([100], [[1.0, 2.0, 3.0]])
    checkpoint.read(path).assert_consumed()
    exported = _sorted_export(var)
    np.testing.assert_array_equal(exported[0], keys)
    np.testing.assert_array_equal(exported[1], values)


def test_checkpoint_false_leaves_the_variable_out() -> None:
    var = ds.get_variable("no_ckpt", dim=1, checkpoint=False)
    var.upsert([1], [[1.0]])
    checkpoint = tf.train.Checkpoint(embedding=var)
    path = checkpoint.write(str(_tmp_dir() / "no_ckpt"))
    var.upsert([2], [[2.0]])
    checkpoint.read(path)
    assert int(var.size()) == 2
    names = [name for name, _ in tf.train.list_variables(path)]
    assert not [name for name in names if name.startswith("embedding/")]


def _tmp_dir():  # type: ignore[no-untyped-def]
    import pathlib
    import tempfile

    return pathlib.Path(tempfile.mkdtemp(prefix="de_store_variable_"))
