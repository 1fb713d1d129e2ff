"""Keras layers over a dynamic embedding Variable, with TFRA 0.8's names and arguments:
layers of the Keras ``tf.keras`` is (:mod:`de_store._keras`), Keras 3 or Keras 2.

``Embedding`` looks ids up (``ids.shape + [embedding_size]``); ``SquashedEmbedding``
reduces every dimension between the batch and the row with ``combiner``;
``FieldWiseEmbedding`` pools the rows of each sample by field (``slot_map_fn(ids)`` in
``[0, nslots)``), giving ``[batch, nslots, embedding_size]``.

A layer's table is its weights for Keras: ``model.save("m.keras")`` writes every key and
row (and the optimizer slots kept beside them) through ``save_own_variables``, and
``keras.models.load_model`` puts them back (Keras 2's TF checkpoints and SavedModels save
the tables as the Variable's TensorFlow trackables), after checking the file's entries against the
layer (:mod:`de_store.keras._weights`). ``get_config`` holds the layer's arguments;
``kv_creator`` is not in it (a saver names storage of the saving process), so a loaded
layer has the default creator until one is given.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from de_store import restrict
from de_store._keras import keras
from de_store.embedding import BatchRows, embedding_lookup, trainable_wrapper
from de_store.errors import FormatError
from de_store.keras import _weights
from de_store.partition import Partitioner, default_partition_fn
from de_store.table_creators import HashTableCreator
from de_store.variable import get_variable

_COMBINERS = ("sum", "mean", "sqrtn")


@keras.saving.register_keras_serializable(package="de_store")
class Embedding(keras.layers.Layer):
    """Map ids of any shape to ``ids.shape + [embedding_size]`` rows of a dynamic table.

    Parameters
    ----------
    embedding_size:
        The row width (the Variable's ``dim``).
    key_dtype, value_dtype, devices, initializer:
        As :func:`de_store.get_variable`; ``initializer`` defaults to TFRA's
        ``RandomNormal()``. The Variable is named after the layer.
    combiner:
        ``"sum"``, ``"mean"`` or ``"sqrtn"``: how :class:`SquashedEmbedding` and
        :class:`FieldWiseEmbedding` pool rows (``Embedding`` itself does not pool).
    with_unique, short_file_name:
        TFRA's; every lookup reads each distinct id once.
    init_capacity (or init_size), partitioner, checkpoint, kv_creator, restrict_policy,
    bp_v2, max_norm, trainable:
        Keyword arguments as TFRA's layer takes them; the rest go to ``keras.layers.Layer``.
    """

    def __init__(
        self,
        embedding_size: int,
        key_dtype: Any = tf.int64,
        value_dtype: Any = tf.float32,
        combiner: str = "sum",
        initializer: Any = None,
        devices: str | Sequence[str] | None = None,
        name: str = "DynamicEmbeddingLayer",
        with_unique: bool = True,
        short_file_name: bool = False,
        *,
        partitioner: Partitioner = default_partition_fn,
        init_capacity: int = 0,
        init_size: int = 0,
        checkpoint: bool = True,
        kv_creator: HashTableCreator | None = None,
        restrict_policy: Any = None,
        bp_v2: bool = False,
        max_norm: float | None = None,
        keep_distribution: bool = False,
        distribute_strategy: Any = None,
        **kwargs: Any,
    ) -> None:
        del keep_distribution, distribute_strategy  # TFRA's; no meaning in one process
        _check_combiner(name, combiner)
        kwargs.pop("dtype", None)
        super().__init__(name=name, **kwargs)
        self.supports_jit = False  # hash table ops do not compile with XLA
        self.embedding_size = int(embedding_size)
        self.combiner, self.with_unique, self.max_norm = combiner, with_unique, max_norm
        self.initializer = _initializer(initializer)
        self._arguments = {
            "key_dtype": tf.as_dtype(key_dtype).name,
            "value_dtype": tf.as_dtype(value_dtype).name,
            "devices": devices,
            "short_file_name": short_file_name,
            "init_capacity": init_capacity or init_size,
            "checkpoint": checkpoint,
            "bp_v2": bp_v2,
            "restrict_policy": restrict_policy.__name__ if restrict_policy else None,
        }
        self.params = get_variable(
            self.name,
            key_dtype=key_dtype,
            value_dtype=value_dtype,
            dim=self.embedding_size,
            devices=devices,
            partitioner=partitioner,
            initializer=self.initializer,
            trainable=self.trainable,
            checkpoint=checkpoint,
            init_size=init_capacity or init_size,
            kv_creator=kv_creator,
            restrict_policy=restrict_policy,
            bp_v2=bp_v2,
            short_file_name=short_file_name,
        )
        self._track_batch_rows()

    def _track_batch_rows(self) -> None:
        """Wrap the table for training and track what a call writes: the batch's rows, ids
        and flags. Tracked, a SavedModel of a model that calls the layer keeps them (it
        refuses functions using untracked ones)."""
        self._wrapper = trainable_wrapper(self.params, self.name)
        self._wrapper.regularizer = None  # Keras reads it on every weight
        self._batch = [self._wrapper]  # tables on parameter servers: BatchRows, only read
        if not isinstance(self._wrapper, BatchRows):
            self._batch += [self._wrapper.ids, self._wrapper.existed]

    def call(self, ids: Any) -> tf.Tensor:
        return embedding_lookup(self.params, ids, name=self.name, max_norm=self.max_norm)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return (*tuple(input_shape), self.embedding_size)

    @property
    def trainable_weights(self) -> list[Any]:
        _refuse_legacy_hdf5(self.name)
        return super().trainable_weights  # type: ignore[no-any-return]

    @property
    def weights(self) -> list[Any]:
        # Keras 2 tracks the batch rows as a weight of the layer already, Keras 3 does not
        return _unique([*super().weights, self._wrapper])

    @property
    def variables(self) -> list[Any]:
        # the tables' own variables too: model.export tracks a layer's variables only
        return _unique([*super().variables, self._wrapper, *self.params.variables])

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("dtype", None)
        config.update(self._arguments)
        config.update(
            embedding_size=self.embedding_size,
            combiner=self.combiner,
            with_unique=self.with_unique,
            max_norm=self.max_norm,
            initializer=keras.saving.serialize_keras_object(self.initializer),
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Embedding:
        config = dict(config)
        config["initializer"] = keras.initializers.deserialize(config["initializer"])
        policy = config.get("restrict_policy")
        config["restrict_policy"] = getattr(restrict, policy) if policy else None
        return cls(**config)

    # -- the table as the layer's weights in a .keras file -----------------------------
    def save_own_variables(self, store: Any) -> None:
        """Write every key and row of the table, and of its companions (optimizer slots),
        with their crc32c (see :mod:`de_store.keras._weights`)."""
        _weights.save_tables(store, self.params, self.name)

    def load_own_variables(self, store: Any) -> None:
        """Replace the table's content (and its companions') by what ``store`` holds.

        Every entry is checked against the layer (the saving layer's name, entry names, key
        dtype, width, row counts, crc32c) before any table changes: a file that does not
        fit raises, naming the layer, and leaves the tables as they were.
        """
        _weights.load_tables(store, self.params, self.name)


@keras.saving.register_keras_serializable(package="de_store")
class SquashedEmbedding(Embedding):
    """:class:`Embedding` whose output is pooled with ``combiner`` over every dimension
    between the batch and the row: ``[batch, embedding_size]``."""

    def call(self, ids: Any) -> tf.Tensor:
        rows = super().call(ids)
        axes = list(range(1, rows.shape.rank - 1))
        if not axes:
            raise ValueError(f"layer {self.name!r}: expected ids of rank >= 2, got rank 1")
        return _pool(rows, axes, self.combiner)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return (input_shape[0], self.embedding_size)


@keras.saving.register_keras_serializable(package="de_store")
class FieldWiseEmbedding(Embedding):
    """:class:`Embedding` of ``[batch, n]`` ids pooled by field: ``[batch, nslots,
    embedding_size]``, field ``slot_map_fn(ids)`` (ints in ``[0, nslots)``)."""

    def __init__(
        self,
        embedding_size: int,
        nslots: int,
        slot_map_fn: Callable[[tf.Tensor], tf.Tensor] | None = None,
        key_dtype: Any = tf.int64,
        value_dtype: Any = tf.float32,
        combiner: str = "sum",
        **kwargs: Any,
    ) -> None:
        name = kwargs.get("name", "DynamicEmbeddingLayer")
        if not callable(slot_map_fn):
            raise ValueError(f"layer {name!r}: slot_map_fn is not callable")
        super().__init__(embedding_size, key_dtype, value_dtype, combiner, **kwargs)
        self.nslots, self.slot_map_fn = int(nslots), slot_map_fn

    def call(self, ids: Any) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if ids.shape.rank != 2:
            raise ValueError(
                f"layer {self.name!r}: expected ids of shape [batch, n], got rank {ids.shape.rank}"
            )
        rows = super().call(tf.reshape(ids, [-1]))
        batch = tf.shape(ids, out_type=ids.dtype)[0]
        fields = tf.cast(self.slot_map_fn(ids), ids.dtype)
        segments = fields + tf.range(batch, dtype=ids.dtype)[:, None] * self.nslots
        count = batch * self.nslots
        pooled = _SEGMENT[self.combiner](rows, tf.reshape(segments, [-1]), count)
        return tf.reshape(pooled, [-1, self.nslots, self.embedding_size])

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return (input_shape[0], self.nslots, self.embedding_size)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            nslots=self.nslots,
            slot_map_fn=keras.saving.serialize_keras_object(self.slot_map_fn),
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FieldWiseEmbedding:
        config = dict(config)
        config["slot_map_fn"] = keras.saving.deserialize_keras_object(config["slot_map_fn"])
        return super().from_config(config)  # type: ignore[return-value]


BasicEmbedding = Embedding

_SEGMENT = {
    "sum": tf.math.unsorted_segment_sum,
    "mean": tf.math.unsorted_segment_mean,
    "sqrtn": tf.math.unsorted_segment_sqrt_n,
}


def _refuse_legacy_hdf5(layer: str) -> None:
    """Raise FormatError when Keras 2's legacy HDF5 saving or loading asks for the weights.

    A ``.h5`` file of ``save_weights``, ``model.save`` or ``load_weights`` (tf_keras's
    ``hdf5_format``) holds fixed-shape variables by position; a table's rows are not one.
    Its writer would store the table's internal buffers and its reader assign them back
    only into a table of the same capacity, so both are refused. tf_keras asks for the
    weights through ``_legacy_weights``, after it has opened the file.
    """
    caller = sys._getframe(2).f_code
    if caller.co_name == "_legacy_weights" and caller.co_filename.endswith("hdf5_format.py"):
        raise FormatError(
            f"layer {layer!r}: Keras 2's legacy HDF5 format (a '.h5' file) holds fixed-shape "
            "weights by position and cannot hold a dynamic table's rows; use a TensorFlow "
            "checkpoint (a path without '.h5'), a '.weights.h5' or a '.keras' file"
        )


def _unique(variables: list[Any]) -> list[Any]:
    """``variables`` without repeats (by identity), in order."""
    return list({id(v): v for v in variables}.values())


def _pool(rows: tf.Tensor, axes: list[int], combiner: str) -> tf.Tensor:
    if combiner == "sum":
        return tf.reduce_sum(rows, axes)
    if combiner == "mean":
        return tf.reduce_mean(rows, axes)
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(rows), axes)), rows.dtype)
    return tf.reduce_sum(rows, axes) / tf.sqrt(count)


def _check_combiner(layer: str, combiner: str) -> None:
    if combiner not in _COMBINERS:
        raise ValueError(
            f"layer {layer!r}: combiner must be one of {', '.join(_COMBINERS)}, got {combiner!r}"
        )


def _initializer(initializer: Any) -> Any:
    """A Keras initializer (serialisable in a model's config) for what TFRA's layer takes:
    None (TFRA's default, ``RandomNormal()``), a Keras or TensorFlow initializer, a number,
    or a ``[dim]`` row."""
    if initializer is None:
        return keras.initializers.RandomNormal()
    if isinstance(initializer, keras.initializers.Initializer):
        return initializer
    if isinstance(initializer, (int, float)):
        return keras.initializers.Constant(float(initializer))
    config = getattr(initializer, "get_config", None)
    if config is not None:  # a tf.initializers object: the Keras one of the same name
        keras_class = getattr(keras.initializers, type(initializer).__name__, None)
        if keras_class is not None:
            return keras_class(**config())
    if isinstance(initializer, (list, tuple, np.ndarray)):
        return _RowInitializer(np.asarray(initializer).tolist())
    return initializer


@keras.saving.register_keras_serializable(package="de_store")
class _RowInitializer(keras.initializers.Initializer):
    """Every row equal to ``row`` (a ``[dim]`` or ``[1]`` list)."""

    def __init__(self, row: list[float]) -> None:
        self.row = list(row)

    def __call__(self, shape: Any, dtype: Any = None) -> tf.Tensor:
        return tf.broadcast_to(tf.constant(self.row, dtype or tf.float32), shape)

    def get_config(self) -> dict[str, Any]:
        return {"row": self.row}
