"""Restrict policies: keep the newest / most frequent keys in values, slots and status."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import de_store as ds
from de_store import optimizers
from de_store.errors import VariableError


def _train(var: ds.Variable, optimizer, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ds.embedding_lookup(var, ids))
    variables = var.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))


def _keys(var: ds.Variable) -> list[int]:
    return sorted(var.export()[0].numpy().tolist())


def test_timestamp_policy_keeps_the_newest_keys_everywhere() -> None:
    var = ds.Variable("restrict_ts", dim=2, restrict_policy=ds.TimestampRestrictPolicy)
    optimizer = optimizers.Adam(0.1)
    for batch in ([1, 2, 3], [4, 5], [2, 6]):
        _train(var, optimizer, batch)
    var.restrict(num_reserved=4)
    assert _keys(var) == [2, 4, 5, 6]
    assert sorted(var.companions()) == ["adam_m", "adam_v", "timestamp"]
    for companion in var.companions().values():
        assert _keys(companion) == [2, 4, 5, 6]


def test_frequency_policy_keeps_the_most_frequent_keys() -> None:
    var = ds.Variable("restrict_freq", dim=1, restrict_policy=ds.FrequencyRestrictPolicy)
    optimizer = optimizers.Adagrad(0.1)
    for batch in ([1, 2, 3, 3], [3, 2], [3, 4]):
        _train(var, optimizer, batch)
    status = var.companions()["frequency"]
    np.testing.assert_array_equal(status.lookup([1, 2, 3, 4]).numpy()[:, 0], [1, 2, 3, 1])
    var.restrict(num_reserved=2, trigger=3)
    assert _keys(var) == [2, 3]
    assert _keys(status) == [2, 3] and _keys(var.companions()["adagrad_accumulator"]) == [2, 3]


def test_restrict_does_nothing_until_size_exceeds_trigger() -> None:
    var = ds.Variable("restrict_trigger", dim=1, restrict_policy=ds.FrequencyRestrictPolicy)
    _train(var, optimizers.SGD(0.1), [1, 2, 3])
    var.restrict(num_reserved=1, trigger=3)
    assert _keys(var) == [1, 2, 3]


def test_restrict_without_policy_or_with_bad_bounds_raises() -> None:
    var = ds.Variable("restrict_none", dim=1)
    with pytest.raises(VariableError, match=r"'restrict_none': restrict\(\) needs a"):
        var.restrict(1)
    var = ds.Variable("restrict_bad", dim=1, restrict_policy=ds.TimestampRestrictPolicy)
    with pytest.raises(VariableError, match=r"'restrict_bad': expected 0 <= num_res"):
        var.restrict(5, trigger=2)


def test_policy_status_is_checkpointed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    var = ds.Variable("restrict_ckpt", dim=1, restrict_policy=ds.FrequencyRestrictPolicy)
    optimizer = optimizers.SGD(0.1)
    _train(var, optimizer, [1, 2])
    checkpoint = tf.train.Checkpoint(embedding=var)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    _train(var, optimizer, [2, 9])
    checkpoint.read(path).assert_consumed()
    status = var.companions()["frequency"]
    assert _keys(status) == [1, 2]
    np.testing.assert_array_equal(status.lookup([1, 2]).numpy()[:, 0], [1, 1])
