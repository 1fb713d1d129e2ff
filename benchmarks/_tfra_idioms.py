"""TFRA users' idioms, run under TFRA 0.8.1 or under de_store, to compare their values.

Each idiom is a small program written as a TFRA user writes it, with TFRA's names (tables
and their methods, ``embedding_lookup`` and its sparse forms, ``DynamicEmbeddingOptimizer``
training, the Keras 2 layers with ``fit``, ``predict`` and saving, TF checkpoints, serving
exports, restrict policies). Every value is deterministic and independent of the library:
constant initializers, fixed numpy data and dense weights, tables read back sorted by key.

The script runs in a child process, once per library; ``IDIOMS_LIBRARY`` picks the import,
the only line that differs between the two runs::

    TF_USE_LEGACY_KERAS=1 IDIOMS_LIBRARY=tfra /work/tfra_venv/bin/python \\
        benchmarks/_tfra_idioms.py tfra.json
    TF_USE_LEGACY_KERAS=1 IDIOMS_LIBRARY=de_store python benchmarks/_tfra_idioms.py ds.json

It writes ``{"library", "tf", "idioms": {name: {"ok": true, "values": {key: list},
"dtype": {key: str}} or {"ok": false, "error": "Type: message"}}}``. The idioms run one
after another in the process, each in its own folder of a temporary directory, each with
its own variable and layer names (TFRA keeps names globally).
"""

from __future__ import annotations

import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # TFRA 0.8's Keras programs are Keras 2 programs

import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

Values = dict[str, Any]
Idiom = Callable[[Any, Any, str], Values]
IDIOMS: list[tuple[str, Idiom]] = []

TRAIN_IDS = np.array([[1, 2, 3], [6, 4, 5]], np.int64)
DUPLICATE_IDS = np.array([[1, 2, 3], [3, 4, 1]], np.int64)  # keys 1 and 3 twice
TARGET = np.linspace(-0.5, 0.5, 24, dtype=np.float32).reshape(2, 3, 4)
FIT_IDS = np.array([[1, 2], [2, 3], [3, 4], [4, 5], [5, 1], [1, 3], [2, 4], [3, 5]], np.int64)
FIT_LABELS = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(8, 1)
PREDICT_IDS = np.array([[1, 5], [4, 2], [9, 9]], np.int64)  # 9 never trained


def idiom(fn: Idiom) -> Idiom:
    """Register ``fn`` (named ``idiom_<name>``) in run order."""
    IDIOMS.append((fn.__name__.removeprefix("idiom_"), fn))
    return fn


def idioms_of(prefix: str, make: Callable[[str, Any], Idiom], cases: dict[str, Any]) -> None:
    """Register ``make(label, case)`` as ``<prefix>_<label>`` for every case, in order."""
    IDIOMS.extend((f"{prefix}_{label}", make(label, case)) for label, case in cases.items())


def import_library(library: str) -> Any:
    """The ``dynamic_embedding`` module of ``library`` (``tfra`` or ``de_store``)."""
    if library == "tfra":
        from tensorflow_recommenders_addons import dynamic_embedding as de
    else:
        import de_store as de
        import de_store.keras  # makes de.keras an attribute
    return de


# --- helpers --------------------------------------------------------------------------------
def keys64(values: Any) -> tf.Tensor:
    return tf.constant(values, tf.int64)


def rows(keys: list[int], dim: int) -> tf.Tensor:
    """Distinct rows: key k holds ``k + j / 10`` in column j."""
    return tf.constant([[k + j / 10 for j in range(dim)] for k in keys], tf.float32)


def sorted_table(var: Any, prefix: str = "") -> Values:
    """A table's keys and values, sorted by key (export order is the table's own)."""
    keys, values = (t.numpy() for t in var.export())
    order = np.argsort(keys, kind="stable")
    return {f"{prefix}keys": keys[order], f"{prefix}values": values[order]}


def ramp(shape: tuple[int, ...], low: float = -0.3, high: float = 0.4) -> np.ndarray:
    return np.linspace(low, high, int(np.prod(shape)), dtype=np.float32).reshape(shape)


def set_ramp_weights(layer: Any) -> None:
    """Give a built dense layer fixed, distinct weights."""
    layer.set_weights([ramp(w.shape) for w in layer.get_weights()])


def constant(value: float) -> Any:
    return tf.keras.initializers.Constant(value)


def ones() -> Any:
    return tf.keras.initializers.Ones()


# --- tables ---------------------------------------------------------------------------------
@idiom
def idiom_table_int64_upsert_lookup(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_int64", key_dtype=tf.int64, dim=4, initializer=constant(0.1))
    var.upsert(keys64([3, 1, 2, 5, 4]), rows([3, 1, 2, 5, 4], 4))
    found = var.lookup(keys64([1, 3, 99, -7]))
    return {"lookup": found.numpy(), "size": var.size().numpy(), **sorted_table(var)}


@idiom
def idiom_table_string_keys(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_str", key_dtype=tf.string, dim=3, initializer=-1.0)
    var.upsert(tf.constant(["b", "a", "cc"]), rows([2, 1, 3], 3))
    found = var.lookup(tf.constant(["a", "zz", "cc"]))
    return {"lookup": found.numpy(), "size": var.size().numpy(), **sorted_table(var)}


@idiom
def idiom_table_variable_constructor(de: Any, tf: Any, workdir: str) -> Values:
    var = de.Variable(
        key_dtype=tf.int64, value_dtype=tf.float32, dim=2, name="idm_ctor", initializer=0.5
    )
    var.upsert(keys64([10, 20]), rows([10, 20], 2))
    var.upsert(keys64([20, 30]), rows([21, 31], 2))  # overwrites 20
    return {"lookup": var.lookup(keys64([20, 40])).numpy(), **sorted_table(var)}


@idiom
def idiom_table_remove_clear(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_remove", dim=2, initializer=0.0)
    var.upsert(keys64([1, 2, 3, 4]), rows([1, 2, 3, 4], 2))
    var.remove(keys64([2, 4, 8]))
    after_remove = {"size_after_remove": var.size().numpy(), **sorted_table(var)}
    found = var.lookup(keys64([1, 2]))
    var.clear()
    return {**after_remove, "lookup": found.numpy(), "size_after_clear": var.size().numpy()}


@idiom
def idiom_table_lookup_return_exists(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_exists", dim=2, initializer=7.0)
    var.upsert(keys64([5, 6]), rows([5, 6], 2))
    values, exists = var.lookup(keys64([6, 1, 5]), return_exists=True)
    return {"values": values.numpy(), "exists": exists.numpy()}


@idiom
def idiom_table_accum(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_accum", dim=2, initializer=0.0)
    var.upsert(keys64([1, 2]), rows([1, 2], 2))
    keys = keys64([1, 2, 3])
    old, exists = var.lookup(keys, return_exists=True)
    var.upsert(keys64([2]), rows([20], 2))  # another worker writes key 2 meanwhile
    var.accum(keys, old, old + 0.5, exists)
    return sorted_table(var)


@idiom
def idiom_table_initializer_forms(de: Any, tf: Any, workdir: str) -> Values:
    forms = {
        "number": 0.25,
        "tf_row": tf.constant([1.0, 2.0, 3.0]),
        "numpy_row": np.array([1.0, 2.0, 3.0], np.float32),
        "list_row": [4.0, 5.0, 6.0],
        "keras_constant": constant(0.75),
        "keras_zeros": tf.keras.initializers.Zeros(),
        "keras_ones": tf.keras.initializers.Ones(),
        "none": None,
    }
    out = {}
    for label, init in forms.items():
        var = de.get_variable(f"idm_init_{label}", dim=3, initializer=init)
        out[label] = var.lookup(keys64([11, 12])).numpy()
    return out


@idiom
def idiom_table_int32_keys(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_int32", key_dtype=tf.int32, dim=2, initializer=0.0)
    var.upsert(tf.constant([7, 3], tf.int32), rows([7, 3], 2))
    return {"lookup": var.lookup(tf.constant([3, 4], tf.int32)).numpy(), **sorted_table(var)}


@idiom
def idiom_table_float64_values(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_f64", value_dtype=tf.float64, dim=2, initializer=0.5)
    var.upsert(keys64([1, 2]), tf.constant([[1.0, 1e-12], [2.0, 3.0]], tf.float64))
    return {"lookup": var.lookup(keys64([1, 9])).numpy(), **sorted_table(var)}


@idiom
def idiom_table_partitioned_devices(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_part", dim=2, initializer=-1.0, devices=["/CPU:0", "/CPU:0"])
    keys = list(range(-3, 10))
    var.upsert(keys64(keys), rows(keys, 2))
    var.remove(keys64([4]))
    return {
        "lookup": var.lookup(keys64([0, 4, 7, -3])).numpy(),
        "size": var.size().numpy(),
        "shard_sizes": np.array([var.size(i).numpy() for i in range(len(var.tables))]),
        **sorted_table(var),
    }


# --- lookups --------------------------------------------------------------------------------
def lookup_in_tf_function(de: Any, name: str, initializer: Any) -> Values:
    """Absent keys looked up in a traced function of any batch size (as a serving
    function is): the initializer is called with a symbolic shape."""
    var = de.get_variable(name, dim=3, initializer=initializer)
    var.upsert(keys64([1]), rows([1], 3))
    lookup = tf.function(var.lookup, input_signature=[tf.TensorSpec([None], tf.int64)])
    return {"lookup": lookup(keys64([1, 2, 3])).numpy()}


def lookup_in_tf_function_with(label: str, make_initializer: Callable[[], Any]) -> Idiom:
    return lambda de, tf, workdir: lookup_in_tf_function(de, f"idm_tff_{label}", make_initializer())


idioms_of(
    "tf_function_lookup",
    lookup_in_tf_function_with,
    {
        "keras_constant": lambda: constant(0.3),
        "constant_initializer": lambda: tf.constant_initializer(0.3),
        "keras_zeros": lambda: tf.keras.initializers.Zeros(),
    },
)


@idiom
def idiom_embedding_lookup_2d(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_lookup2d", dim=3, initializer=0.0)
    var.upsert(keys64([1, 2, 3]), rows([1, 2, 3], 3))
    ids = keys64([[1, 2], [3, 8], [2, 2]])
    out = de.embedding_lookup(var, ids, name="idm_lookup2d_lk")
    clipped = de.embedding_lookup(var, ids, name="idm_lookup2d_norm", max_norm=1.5)
    return {"lookup": out.numpy(), "max_norm": clipped.numpy(), "size": var.size().numpy()}


@idiom
def idiom_embedding_lookup_unique(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_unique", dim=2, initializer=0.5)
    var.upsert(keys64([1, 2]), rows([1, 2], 2))
    out = de.embedding_lookup_unique(var, keys64([[2, 1, 2], [3, 1, 1]]), name="idm_unique_lk")
    return {"lookup": out.numpy()}


def sparse_ids_and_weights() -> tuple[tf.SparseTensor, tf.SparseTensor]:
    indices = [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    ids = tf.SparseTensor(indices, keys64([1, 2, 3, 1, 4, 5]), [3, 3])
    weights = tf.SparseTensor(indices, tf.constant([1.0, 2.0, 0.5, 1.0, 1.0, 3.0]), [3, 3])
    return ids, weights


def sparse_lookups(de: Any, combiner: str) -> Values:
    """embedding_lookup_sparse with and without weights."""
    var = de.get_variable(f"idm_sparse_{combiner}", dim=2, initializer=0.0)
    var.upsert(keys64([1, 2, 3, 4, 5]), rows([1, 2, 3, 4, 5], 2))
    ids, weights = sparse_ids_and_weights()
    weighted = de.embedding_lookup_sparse(
        var, ids, weights, name=f"idm_sparse_{combiner}_w", combiner=combiner
    )
    unweighted = de.embedding_lookup_sparse(
        var, ids, None, name=f"idm_sparse_{combiner}_u", combiner=combiner
    )
    return {"weighted": weighted.numpy(), "unweighted": unweighted.numpy()}


def sparse_lookups_with(label: str, combiner: str) -> Idiom:
    return lambda de, tf, workdir: sparse_lookups(de, combiner)


idioms_of("embedding_lookup_sparse", sparse_lookups_with, {c: c for c in ("sum", "mean", "sqrtn")})


@idiom
def idiom_safe_embedding_lookup_sparse(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_safe", dim=2, initializer=0.0)
    var.upsert(keys64([1, 2, 3]), rows([1, 2, 3], 2))
    indices = [[0, 0], [0, 1], [2, 0], [3, 0]]  # row 1 empty, row 3 holds only an invalid id
    ids = tf.SparseTensor(indices, keys64([1, 2, 3, -1]), [4, 2])
    weights = tf.SparseTensor(indices, tf.constant([1.0, 3.0, 2.0, 1.0]), [4, 2])
    out = {}
    for combiner in ("sum", "mean", "sqrtn"):
        found = de.safe_embedding_lookup_sparse(
            var, ids, weights, combiner=combiner, name=f"idm_safe_{combiner}"
        )
        out[combiner] = found.numpy()
    with_default = de.safe_embedding_lookup_sparse(
        var, ids, None, combiner="sum", default_id=2, name="idm_safe_default"
    )
    return {**out, "sum_default_id_2": with_default.numpy()}


# --- training with DynamicEmbeddingOptimizer ------------------------------------------------
def train_eagerly(
    de: Any, var: Any, optimizer: Any, name: str, steps: int = 3, ids: np.ndarray = TRAIN_IDS
) -> Values:
    """``steps`` eager steps of a squared loss on ``ids`` with ``optimizer`` (wrapped by
    DynamicEmbeddingOptimizer); the losses and the table after."""
    losses = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            emb, wrapper = de.embedding_lookup(var, keys64(ids), name=name, return_trainable=True)
            loss = tf.reduce_sum(tf.square(emb - TARGET))
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
        losses.append(loss.numpy())
    return {"losses": np.array(losses), **sorted_table(var)}


def slot_tables(var: Any, optimizer: Any) -> Values:
    out = {}
    for i, slot in enumerate(var.get_slot_variables(optimizer)):
        out.update(sorted_table(slot, prefix=f"slot{i}_"))
    return out


def train_with(label: str, make_optimizer: Callable[[], Any]) -> Idiom:
    """An idiom: three eager steps with the wrapped optimizer ``make_optimizer()``."""

    def train(de: Any, tf: Any, workdir: str) -> Values:
        var = de.get_variable(f"idm_train_{label}", dim=4, initializer=constant(0.1))
        optimizer = de.DynamicEmbeddingOptimizer(make_optimizer())
        return train_eagerly(de, var, optimizer, name=f"idm_train_{label}_lk")

    return train


idioms_of(
    "train",
    train_with,
    {
        "legacy_sgd": lambda: tf.keras.optimizers.legacy.SGD(0.1),
        "legacy_sgd_momentum": lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
        "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(0.1),
        "legacy_adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.1),
        "legacy_ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
        "keras_sgd": lambda: tf.keras.optimizers.SGD(0.1),
        "keras_adam": lambda: tf.keras.optimizers.Adam(0.1),
        "v1_adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
    },
)


@idiom
def idiom_train_optimizer_wrapped_in_place(de: Any, tf: Any, workdir: str) -> Values:
    """TFRA's DynamicEmbeddingOptimizer returns the optimizer it was given, made able to
    train dynamic embeddings: code that keeps using the original object trains too."""
    var = de.get_variable("idm_train_in_place", dim=4, initializer=constant(0.1))
    optimizer = tf.keras.optimizers.legacy.Adam(0.1)
    wrapped = de.DynamicEmbeddingOptimizer(optimizer)
    out = train_eagerly(de, var, optimizer, name="idm_train_in_place_lk")
    return {"same_object": np.array(wrapped is optimizer), **out}


@idiom
def idiom_train_duplicate_ids(de: Any, tf: Any, workdir: str) -> Values:
    """A key twice in a batch: its two gradients add up, as in a dense embedding."""
    var = de.get_variable("idm_train_dup", dim=4, initializer=constant(0.1))
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    return train_eagerly(de, var, optimizer, name="idm_train_dup_lk", ids=DUPLICATE_IDS)


@idiom
def idiom_slots_keras_adam(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_slots_keras", dim=4, initializer=constant(0.1))
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1))
    train_eagerly(de, var, optimizer, name="idm_slots_keras_lk")
    return slot_tables(var, optimizer)


@idiom
def idiom_slots_legacy_adam(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_slots_legacy", dim=4, initializer=constant(0.1))
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.1))
    train_eagerly(de, var, optimizer, name="idm_slots_legacy_lk")
    return slot_tables(var, optimizer)


@idiom
def idiom_train_in_tf_function(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_tff", dim=4, initializer=0.1)
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.1))

    @tf.function
    def step(ids: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            emb = de.embedding_lookup(var, ids, name="idm_tff_lk")
            loss = tf.reduce_sum(tf.square(emb - TARGET))
        wrapper = var.get_trainable_by_name("idm_tff_lk")
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
        return loss

    losses = [step(keys64(TRAIN_IDS)).numpy() for _ in range(3)]
    return {"losses": np.array(losses), **sorted_table(var)}


@idiom
def idiom_checkpoint_with_optimizer_slots(de: Any, tf: Any, workdir: str) -> Values:
    """Restore the table and Adam's slots, then one more step: as if never interrupted."""
    var = de.get_variable("idm_ckslots", dim=4, initializer=constant(0.1))
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.1))
    train_eagerly(de, var, optimizer, name="idm_ckslots_lk", steps=2)
    ckpt = tf.train.Checkpoint(var=var, optimizer=optimizer)
    path = ckpt.write(os.path.join(workdir, "ckpt"))
    continued = train_eagerly(de, var, optimizer, name="idm_ckslots_lk", steps=1)
    var.upsert(keys64([1, 2, 3, 4]), rows([1, 2, 3, 4], 4))  # spoil the table
    ckpt.read(path)
    resumed = train_eagerly(de, var, optimizer, name="idm_ckslots_lk", steps=1)
    return {"continued": continued["values"], "resumed": resumed["values"]}


# --- restrict policies ----------------------------------------------------------------------
def train_steps(de: Any, var: Any, batches: list[list[int]], pause_s: float = 0.0) -> Any:
    """One Adam step per batch, ``pause_s`` apart; the optimizer."""
    optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1))
    for batch in batches:
        with tf.GradientTape() as tape:
            emb, wrapper = de.embedding_lookup(
                var, keys64(batch), name=f"{var.name}_lk", return_trainable=True
            )
            loss = tf.reduce_sum(emb)
        optimizer.apply_gradients([(tape.gradient(loss, wrapper), wrapper)])
        time.sleep(pause_s)
    return optimizer


def restricted(var: Any, optimizer: Any, num_reserved: int, trigger: int) -> Values:
    """Restrict ``var``; what is left of its table, its status and its slots."""
    var.restrict(num_reserved, trigger=trigger)
    out = {**sorted_table(var), **sorted_table(var.restrict_policy.status, "status_")}
    for i, slot in enumerate(var.get_slot_variables(optimizer)):
        out[f"slot{i}_keys"] = sorted_table(slot)["keys"]
    return out


@idiom
def idiom_restrict_frequency(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable(
        "idm_freq", dim=2, initializer=0.0, restrict_policy=de.FrequencyRestrictPolicy
    )
    batches = [list(range(1, 8 - k)) for k in range(1, 7)]  # key k is trained 7 - k times
    optimizer = train_steps(de, var, batches)
    not_yet = sorted_table(var.restrict_policy.status, "before_")
    var.restrict(3, trigger=7)  # 6 keys: not over the trigger
    size_untriggered = var.size().numpy()
    return {**not_yet, "size_untriggered": size_untriggered, **restricted(var, optimizer, 3, 4)}


@idiom
def idiom_restrict_timestamp(de: Any, tf: Any, workdir: str) -> Values:
    """Batches a second apart: TFRA's timestamps are whole seconds."""
    var = de.get_variable(
        "idm_tstp", dim=2, initializer=0.0, restrict_policy=de.TimestampRestrictPolicy
    )
    optimizer = train_steps(de, var, [[1, 2, 3, 4], [3, 4, 5], [5, 6]], pause_s=1.05)
    out = restricted(var, optimizer, 4, 5)
    del out["status_values"]  # clock readings
    return out


# --- checkpoints ----------------------------------------------------------------------------
def checkpoint_round_trip(de: Any, name: str, workdir: str, kv_creator: Any) -> Values:
    """Write a checkpoint, change the table (remove, overwrite, add), read it back."""
    var = de.get_variable(name, dim=3, initializer=0.0, kv_creator=kv_creator)
    var.upsert(keys64([1, 2, 3, 4]), rows([1, 2, 3, 4], 3))
    ckpt = tf.train.Checkpoint(var=var)
    path = ckpt.write(os.path.join(workdir, "ckpt"))
    var.remove(keys64([1, 2]))
    var.upsert(keys64([3, 9]), rows([30, 90], 3))
    ckpt.read(path)
    return {"size": var.size().numpy(), **sorted_table(var)}


@idiom
def idiom_checkpoint_plain(de: Any, tf: Any, workdir: str) -> Values:
    return checkpoint_round_trip(de, "idm_ckpt_plain", workdir, None)


@idiom
def idiom_checkpoint_file_system_saver(de: Any, tf: Any, workdir: str) -> Values:
    creator = de.CuckooHashTableCreator(saver=de.FileSystemSaver())
    return checkpoint_round_trip(de, "idm_ckpt_fs", workdir, creator)


@idiom
def idiom_checkpoint_partitioned(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_ckpt_part", dim=2, devices=["/CPU:0", "/CPU:0", "/CPU:0"])
    keys = list(range(20))
    var.upsert(keys64(keys), rows(keys, 2))
    ckpt = tf.train.Checkpoint(var=var)
    path = ckpt.write(os.path.join(workdir, "ckpt"))
    var.clear()
    ckpt.read(path)
    return {"size": var.size().numpy(), **sorted_table(var)}


# --- Keras ----------------------------------------------------------------------------------
def functional_model(layer: Any, n_ids: int) -> Any:
    """ids [batch, n_ids] -> layer -> Flatten -> Dense(1) with fixed weights."""
    inputs = tf.keras.Input(shape=(n_ids,), dtype=tf.int64)
    dense = tf.keras.layers.Dense(1)
    outputs = dense(tf.keras.layers.Flatten()(layer(inputs)))
    model = tf.keras.Model(inputs, outputs)
    set_ramp_weights(dense)
    return model


def compile_fit(de: Any, model: Any, ids: np.ndarray, optimizer: Any = None) -> Values:
    """Compile with a wrapped optimizer, fit 3 epochs on fixed data, unshuffled."""
    optimizer = optimizer or tf.keras.optimizers.legacy.Adam(1e-2)
    model.compile(optimizer=de.DynamicEmbeddingOptimizer(optimizer), loss="mse")
    history = model.fit(ids, FIT_LABELS, batch_size=4, epochs=3, shuffle=False, verbose=0)
    return {
        "fit_loss": np.array(history.history["loss"]),
        "evaluate": np.array(model.evaluate(ids, FIT_LABELS, batch_size=4, verbose=0)),
    }


def fit_layer(de: Any, layer: Any, ids: np.ndarray, predict_ids: np.ndarray) -> Values:
    model = functional_model(layer, ids.shape[1])
    out = compile_fit(de, model, ids)
    out["predict"] = model.predict(predict_ids, verbose=0)
    return {**out, **sorted_table(layer.params)}


@idiom
def idiom_keras_embedding_functional(de: Any, tf: Any, workdir: str) -> Values:
    """The layer of TFRA's docs, with a Keras ``Constant`` initializer (the other Keras
    idioms use ``Ones``)."""
    layer = de.keras.layers.Embedding(4, initializer=constant(0.1), name="idm_k_emb")
    return fit_layer(de, layer, FIT_IDS, PREDICT_IDS)


@idiom
def idiom_keras_basic_embedding(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.BasicEmbedding(3, initializer=ones(), name="idm_k_basic")
    return fit_layer(de, layer, FIT_IDS, PREDICT_IDS)


@idiom
def idiom_keras_squashed_sum(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.SquashedEmbedding(
        4, initializer=ones(), combiner="sum", name="idm_k_sq_sum"
    )
    return fit_layer(de, layer, FIT_IDS, PREDICT_IDS)


@idiom
def idiom_keras_squashed_mean(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.SquashedEmbedding(
        4, initializer=ones(), combiner="mean", name="idm_k_sq_mean"
    )
    return fit_layer(de, layer, FIT_IDS, PREDICT_IDS)


def field_of(ids: tf.Tensor) -> tf.Tensor:
    return tf.math.floormod(ids, 2)


@idiom
def idiom_keras_field_wise(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.FieldWiseEmbedding(
        3, 2, slot_map_fn=field_of, initializer=ones(), name="idm_k_field"
    )
    ids = np.concatenate([FIT_IDS, FIT_IDS[::-1, :1] + 6], axis=1)
    return fit_layer(de, layer, ids, np.array([[1, 2, 3], [4, 6, 9]], np.int64))


@idiom
def idiom_keras_current_adam(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.Embedding(4, initializer=ones(), name="idm_k_adam")
    model = functional_model(layer, 2)
    out = compile_fit(de, model, FIT_IDS, tf.keras.optimizers.Adam(1e-2))
    return {**out, "predict": model.predict(PREDICT_IDS, verbose=0), **sorted_table(layer.params)}


class TwoTower(tf.keras.Model):
    """A subclassed model as TFRA's demos write one: ``call`` under ``tf.function``."""

    def __init__(self, de: Any, name: str) -> None:
        super().__init__()
        self.embedding = de.keras.layers.SquashedEmbedding(
            4, initializer=ones(), combiner="mean", name=f"{name}_emb"
        )
        self.dense = tf.keras.layers.Dense(1)

    @tf.function
    def call(self, ids: tf.Tensor) -> tf.Tensor:
        return self.dense(self.embedding(ids))


def subclassed_model(de: Any, name: str) -> Any:
    model = TwoTower(de, name)
    model(keys64(FIT_IDS[:1]))  # builds the dense layer (and looks up one batch)
    set_ramp_weights(model.dense)
    return model


@idiom
def idiom_keras_subclassed_tf_function(de: Any, tf: Any, workdir: str) -> Values:
    model = subclassed_model(de, "idm_k_sub")
    out = compile_fit(de, model, FIT_IDS)
    out["predict"] = model.predict(PREDICT_IDS, verbose=0)
    return {**out, **sorted_table(model.embedding.params)}


@idiom
def idiom_keras_save_load_weights(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.Embedding(4, initializer=ones(), name="idm_k_w")
    model = functional_model(layer, 2)
    compile_fit(de, model, FIT_IDS)
    before = model.predict(PREDICT_IDS, verbose=0)
    model.save_weights(os.path.join(workdir, "weights", "ckpt"))
    tf.keras.backend.clear_session()  # as a new process builds the same model
    fresh_layer = de.keras.layers.Embedding(4, initializer=ones(), name="idm_k_w")
    fresh = functional_model(fresh_layer, 2)
    fresh.load_weights(os.path.join(workdir, "weights", "ckpt"))
    after = fresh.predict(PREDICT_IDS, verbose=0)
    return {"before": before, "after": after, **sorted_table(fresh_layer.params)}


@idiom
def idiom_keras_saved_model_load_model(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.Embedding(4, initializer=ones(), name="idm_k_sm")
    model = functional_model(layer, 2)
    compile_fit(de, model, FIT_IDS)
    before = model.predict(PREDICT_IDS, verbose=0)
    model.save(os.path.join(workdir, "saved_model"))
    loaded = tf.keras.models.load_model(os.path.join(workdir, "saved_model"))
    return {"before": before, "after": loaded.predict(PREDICT_IDS, verbose=0)}


# --- serving exports ------------------------------------------------------------------------
@idiom
def idiom_inference_keras_saved_model(de: Any, tf: Any, workdir: str) -> Values:
    layer = de.keras.layers.Embedding(4, initializer=ones(), name="idm_k_inf")
    model = functional_model(layer, 2)
    compile_fit(de, model, FIT_IDS)
    before = model.predict(PREDICT_IDS, verbose=0)
    de.enable_inference_mode()
    mode = str(de.get_model_mode())
    tf.saved_model.save(model, os.path.join(workdir, "export"))
    loaded = tf.saved_model.load(os.path.join(workdir, "export"))
    serve = loaded.signatures["serving_default"]
    (after,) = serve(keys64(PREDICT_IDS)).values()
    return {"before": before, "after": after.numpy(), "mode": np.array(mode)}


class Server(tf.Module):
    """A serving module: one lookup, pooled by sum."""

    def __init__(self, de: Any, var: Any) -> None:
        super().__init__()
        self.de, self.var = de, var

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    def __call__(self, ids: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(self.de.embedding_lookup(self.var, ids, name="idm_serve_lk"), 1)


@idiom
def idiom_inference_module_saved_model(de: Any, tf: Any, workdir: str) -> Values:
    var = de.get_variable("idm_serve", dim=3, initializer=-1.0)
    var.upsert(keys64([1, 2, 3]), rows([1, 2, 3], 3))
    de.enable_inference_mode()
    server = Server(de, var)
    before = server(keys64([[1, 2], [3, 7]]))
    tf.saved_model.save(server, os.path.join(workdir, "export"))
    loaded = tf.saved_model.load(os.path.join(workdir, "export"))
    after = loaded(keys64([[1, 2], [3, 7]]))
    return {"before": before.numpy(), "after": after.numpy(), "size": var.size().numpy()}


# --- runner ---------------------------------------------------------------------------------
def run_idiom(fn: Idiom, de: Any, workdir: str) -> dict[str, Any]:
    """Run one idiom; its values as JSON lists, or its error."""
    os.makedirs(workdir, exist_ok=True)
    tf.keras.backend.clear_session()
    try:
        values = {key: np.asarray(value) for key, value in fn(de, tf, workdir).items()}
    except Exception as err:  # an idiom's failure is one of its results
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        de.enable_train_mode()  # an idiom that failed in inference mode leaves it set
    return {
        "ok": True,
        "values": {key: to_json(value) for key, value in values.items()},
        "dtype": {key: str(value.dtype) for key, value in values.items()},
    }


def to_json(value: np.ndarray) -> Any:
    if value.dtype.kind in "SO":
        return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else str(v))(
            value
        ).tolist()
    return value.tolist()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: IDIOMS_LIBRARY=tfra|de_store {argv[0]} OUT.json", file=sys.stderr)
        return 2
    library = os.environ.get("IDIOMS_LIBRARY", "de_store")
    de = import_library(library)
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"tfra_idioms_{library}_") as root:
        for name, fn in IDIOMS:
            results[name] = run_idiom(fn, de, os.path.join(root, name))
            status = "ok" if results[name]["ok"] else results[name]["error"]
            print(f"{name}: {status}", flush=True)
    report = {"library": library, "tf": tf.__version__, "idioms": results}
    with open(argv[1], "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
