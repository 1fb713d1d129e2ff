"""Differentiable lookups: ``embedding_lookup`` and the per-batch ``TrainableWrapper``.

A lookup reads the rows of the batch's unique ids into a :class:`TrainableWrapper`, a
``tf.Variable`` of shape ``[u, dim]`` (a ``ResourceVariable`` subclass, as in TFRA), and
gathers the output from it, so ``tf.GradientTape`` sees an ordinary variable gradient
(``IndexedSlices``; duplicate ids aggregate) and any optimizer accepts the wrapper. A
de_store optimizer (:func:`de_store.DynamicEmbeddingOptimizer`) recognises the wrapper and
writes the update back to the tables for those ids. In inference mode
(:func:`de_store.enable_inference_mode`) a lookup reads the tables and touches no wrapper.

A Variable whose tables live on parameter servers (``ParameterServerStrategy``) gets a
:class:`BatchRows` instead: a fixed ``[1, dim]`` variable that receives the rows' gradient
with their ids, while the batch's rows and the optimizer's slot rows stay tensors of the
step (a worker's step can hold no variable of unknown shape on another task: TensorFlow
aborts the worker; and many workers run steps at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import resource_variable_ops

from de_store import modes
from de_store._slots import TensorSlot
from de_store.errors import VariableError
from de_store.variable import Variable


class TrainableWrapper(resource_variable_ops.ResourceVariable):
    """The rows of the last batch looked up under one name: a trainable ``tf.Variable``.

    Its value is ``[u, dim]``, the rows of the batch's ``u`` unique ids, read from the
    tables by the lookup. Hand it (or ``Variable.trainable_variables``) to
    ``tape.gradient`` and to the optimizer.

    Attributes
    ----------
    params: the :class:`~de_store.Variable` the rows came from.
    ids: ``[u]`` unique ids of the batch (a non-trainable variable).
    existed: ``[u]`` whether each id was in the table at lookup time.
    """

    def __init__(self, params: Variable, name: str) -> None:
        device = params.devices[0]
        with tf.init_scope(), tf.device(device):
            super().__init__(
                # one row, as TFRA's: optimizers that fill a slot in the variable's shape
                # (tf.compat.v1 Adagrad, RMSProp) then show the slot's initial row
                initial_value=tf.zeros([1, params.dim], params.value_dtype),
                shape=tf.TensorShape([None, params.dim]),
                trainable=params.trainable,
                name=f"{params.name}/{name}/rows".replace(":", "_"),
            )
            self.existed = tf.Variable(
                tf.zeros([0], tf.bool), shape=tf.TensorShape([None]), trainable=False
            )
            with tf.device("/device:CPU:0" if params.key_dtype == tf.string else device):
                self.ids = tf.Variable(
                    tf.zeros([0], params.key_dtype), shape=tf.TensorShape([None]), trainable=False
                )
        self.params = params
        self.lookup_name = name
        self.last_load: list[Any] = []  # in a graph: the assign ops of the last lookup built

    def _trackable_children(self, save_type: Any = "checkpoint", **kwargs: Any) -> Any:
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":  # the batch state a served lookup writes
            children.update(ids=self.ids, existed=self.existed)
        return children

    @property
    def rows(self) -> TrainableWrapper:
        """The variable holding the batch rows: the wrapper itself."""
        return self

    def load(self, unique_ids: tf.Tensor) -> list[Any]:
        """Read the rows of ``unique_ids`` from the tables into this variable; the assign
        ops (in a ``tf.compat.v1`` graph, reads must depend on them)."""
        values, existed = self.params.lookup(unique_ids, return_exists=True)
        ops = [self.ids.assign(unique_ids), self.existed.assign(existed), self.assign(values)]
        if not tf.executing_eagerly():  # reads of this batch's state in a graph follow them
            self.last_load = ops
        return ops


class BatchRows(resource_variable_ops.ResourceVariable):
    """The trainable stand-in for a lookup's rows when the Variable's tables live on
    parameter servers: a ``[1, dim]`` variable of zeros on the first table's task.

    A worker's step can hold no variable of unknown shape on another task (TensorFlow
    aborts the worker) and many workers run steps at once, so the batch rows stay tensors
    of the step. The lookup's output is tied to this variable so that its gradient for
    the variable is ``IndexedSlices(values=d loss / d rows, indices=ids)``
    (:func:`_rows_with_gradient`): ``tape.gradient`` and Keras reach it as they reach any
    variable, also through a ``tf.function``-decorated ``call``. The optimizer
    (:func:`de_store.DynamicEmbeddingOptimizer`) reads the ids from the indices, updates
    their rows and slots as tensors (:class:`RowsState`) and writes them to the tables;
    this variable itself never changes.
    """

    def __init__(self, params: Variable, name: str) -> None:
        if params.key_dtype == tf.string:
            raise VariableError(
                f"variable '{params.name}': its tables live on parameter servers, where "
                "training looks up int32 or int64 keys only; got string keys"
            )
        with tf.init_scope(), tf.device(params.devices[0]):
            super().__init__(
                initial_value=tf.zeros([1, params.dim], params.value_dtype),
                trainable=params.trainable,
                name=f"{params.name}/{name}/rows".replace(":", "_"),
            )
        self.params = params
        self.lookup_name = name
        self.state = RowsState(params, f"{params.name}/{name}/state")

    @property
    def rows(self) -> BatchRows:
        """What receives the batch rows' gradient: this variable."""
        return self

    def read_rows(self, unique_ids: tf.Tensor) -> tf.Tensor:
        """The rows of ``unique_ids``, differentiable through this variable."""
        values = self.params.lookup(unique_ids)
        return _rows_with_gradient(values, self, unique_ids)


class RowsState(TensorSlot):
    """The rows an update of :class:`BatchRows` works on, as tensors of the step: the
    current rows of the gradient's ids, with ``params``, ``ids`` and ``existed`` as a
    :class:`TrainableWrapper` holds them."""

    def __init__(self, params: Variable, name: str) -> None:
        super().__init__(name, params.value_dtype, params.dim)
        self.params = params
        self.ids = tf.zeros([0], params.key_dtype)
        self.existed = tf.zeros([0], tf.bool)

    def bind(self, grad: tf.IndexedSlices) -> tf.Tensor:
        """Hold the current rows of the ids ``grad`` names; return the gradient summed per
        id, in the order of ``ids``."""
        ids = tf.cast(grad.indices, self.params.key_dtype)
        self.ids, position = tf.unique(ids, out_idx=tf.int32)
        values, self.existed = self.params.lookup(self.ids, return_exists=True)
        self.assign(values)
        count = tf.size(self.ids)
        return tf.math.unsorted_segment_sum(tf.convert_to_tensor(grad.values), position, count)


def _rows_with_gradient(values: tf.Tensor, anchor: BatchRows, ids: tf.Tensor) -> tf.Tensor:
    """``values``, whose gradient goes to ``anchor`` as ``IndexedSlices(d values, ids)``.

    A gather of ``anchor``'s row 0 once per id (indices ``ids * 0``) is added and taken
    away again, so the value is ``values`` and the gradient of the gather's output is that
    of the rows. The gather's gradient gives the ids as its indices: recorded on the active
    tapes for a tape in the same function, and through the gradient registry
    (:func:`_rows_of_ids_gradient`) for the backward graph of a nested ``tf.function``
    (a gather's gradient is an ``IndexedSlices`` that crosses that boundary intact; one
    made by ``tf.custom_gradient`` does not).
    """
    zeros = tf.math.multiply(ids, tf.zeros([], ids.dtype))
    resource_variable_ops.variable_accessed(anchor)  # every active tape watches it
    graph = tf.compat.v1.get_default_graph()
    with record.stop_recording(), graph.gradient_override_map({"ResourceGather": _ROWS_OF_IDS}):
        gathered = tf.raw_ops.ResourceGather(
            resource=anchor.handle, indices=zeros, dtype=anchor.dtype
        )

    def backward(d_rows: tf.Tensor) -> list[Any]:
        return [_indexed_by_ids(d_rows, ids), None]

    record.record_operation(_ROWS_OF_IDS, [gathered], [anchor.handle, zeros], backward)
    return tf.stop_gradient(values) + (gathered - tf.stop_gradient(gathered))


def _indexed_by_ids(d_rows: Any, ids: tf.Tensor) -> tf.IndexedSlices:
    values = tf.convert_to_tensor(d_rows)
    dense_shape = tf.constant([1, values.shape[-1]], tf.int64)
    # identities: the backward graph of a nested tf.function takes only its own tensors out
    return tf.IndexedSlices(tf.identity(values), tf.identity(ids), dense_shape)


_ROWS_OF_IDS = "DeStoreRowsOfIds"


@tf_ops.RegisterGradient(_ROWS_OF_IDS)
def _rows_of_ids_gradient(op: Any, grad: Any) -> list[Any]:
    """The gradient of :func:`_rows_with_gradient`'s gather in a graph's gradient
    function: the rows' gradient, indexed by the ids (the first input of the ``ids * 0``
    that is the gather's indices)."""
    return [_indexed_by_ids(grad, op.inputs[1].op.inputs[0]), None]


def on_parameter_servers(params: Variable) -> bool:
    """Whether ``params`` keeps its tables on other tasks, in fixed-shape variables."""
    return any(getattr(shard, "fixed_shapes", False) for shard in params.shards)


def trainable_wrapper(params: Variable, name: str = "lookup") -> TrainableWrapper | BatchRows:
    """Get or create the wrapper of ``params`` for lookups called ``name``: a
    :class:`BatchRows` when its tables live on parameter servers."""
    wrappers: dict[str, Any] = params._wrappers  # type: ignore[attr-defined]
    wrapper = wrappers.get(name)
    if wrapper is None:
        kind = BatchRows if on_parameter_servers(params) else TrainableWrapper
        wrapper = wrappers[name] = kind(params, name)
    return wrapper  # type: ignore[no-any-return]


def wrapper_of(variable: Any) -> Any:
    """``variable`` if it holds batch rows (a :class:`TrainableWrapper`, :class:`BatchRows`
    or the :class:`RowsState` of one), else ``None``. The first and the last share what
    the optimizers use: ``params``, ``ids``, ``existed`` and the rows as their value."""
    return variable if isinstance(variable, (TrainableWrapper, BatchRows, RowsState)) else None


def trainable_wrapper_filter(
    items: Iterable[Any], test_unaggregated_function: Any = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Split ``items`` into ``(others, wrappers)``, as TFRA's function of this name does.

    ``test_unaggregated_function(item)`` picks the second group; by default, items that are
    :class:`TrainableWrapper` s.
    """
    test = test_unaggregated_function or (lambda item: wrapper_of(item) is not None)
    others: list[Any] = []
    wrappers: list[Any] = []
    for item in items:
        (wrappers if test(item) else others).append(item)
    return tuple(others), tuple(wrappers)


def embedding_lookup(
    params: Variable | list[Variable] | tuple[Variable, ...],
    ids: Any,
    partition_strategy: Any = None,
    name: str | None = None,
    validate_indices: Any = None,
    max_norm: float | None = None,
    return_trainable: bool = False,
) -> Any:
    """Look ``ids`` up in ``params``, differentiably; shape ``ids.shape + [dim]``.

    The arguments and their order are TFRA's (and ``tf.nn.embedding_lookup``'s).

    Parameters
    ----------
    params:
        The dynamic embedding :class:`~de_store.Variable`, or a list holding one.
    ids:
        Keys of any shape, of ``params.key_dtype``; a ``tf.RaggedTensor`` gives a ragged
        result of the same row structure.
    partition_strategy, validate_indices:
        Accepted for TFRA's signature; unused.
    name:
        Lookups with different names keep separate batch rows, so several lookups (or
        workers) on one Variable can be trained in one step. Default ``"lookup"``.
    max_norm:
        If set, rows whose L2 norm exceeds it are scaled down to it (in the output only).
    return_trainable:
        Also return the :class:`TrainableWrapper` that receives the gradient.
    """
    del partition_strategy, validate_indices
    params = _one_variable(params)
    if isinstance(ids, tf.RaggedTensor):
        flat = embedding_lookup(params, ids.flat_values, None, name, None, max_norm, True)
        out = ids.with_flat_values(flat[0])
        return (out, flat[1]) if return_trainable else out
    ids = params._keys(ids)
    if modes.get_model_mode() == modes.ModelMode.INFERENCE and not return_trainable:
        out = params.lookup(ids)
        return tf.clip_by_norm(out, max_norm, axes=[-1]) if max_norm is not None else out
    unique_ids, positions = tf.unique(tf.reshape(ids, [-1]), out_idx=tf.int32)
    wrapper = trainable_wrapper(params, name or "lookup")
    if isinstance(wrapper, BatchRows):
        flat = tf.gather(wrapper.read_rows(unique_ids), positions)
    else:
        with tf.control_dependencies(wrapper.load(unique_ids)):
            flat = tf.gather(wrapper, positions)
    if max_norm is not None:
        flat = tf.clip_by_norm(flat, max_norm, axes=[1])
    out = tf.reshape(flat, tf.concat([tf.shape(ids), [params.dim]], axis=0))
    return (out, wrapper) if return_trainable else out


def _one_variable(params: Any) -> Variable:
    """``params``, or the one Variable of a list of one (TFRA accepts both)."""
    if isinstance(params, (list, tuple)):
        if len(params) != 1:
            raise ValueError(
                f"embedding_lookup: expected one de_store Variable (or a list of one), "
                f"got a list of {len(params)}"
            )
        params = params[0]
    if not isinstance(params, Variable):
        raise TypeError(
            f"embedding_lookup: expected a de_store Variable as params, got {type(params).__name__}"
        )
    return params
