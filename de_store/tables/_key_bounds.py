"""Upper bounds on how many keys a tensor of a traced step holds.

A fixed-shape table's keys reach its kernels as tensors of unknown length (after a
``tf.unique``, a boolean mask, a ``tf.dynamic_partition``), but they usually come from a
batch of a known size: ids drawn in the step, a dataset batched with
``drop_remainder=True``, or a tensor argument of the step, whose size is known each time
the step is scheduled. :func:`element_bound` walks back from the keys through ops whose
output holds at most as many elements as one of their inputs (times a static factor), to
tensors of static shape or to the step's arguments, and returns a :class:`Bound`: a
count plus, per argument, a factor of its element count. Every rule is an upper bound: an
op not listed, a tensor of unknown shape that is no argument, or a walk deeper than
:data:`MAX_DEPTH` gives ``None`` (no bound), never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import func_graph

#: Ops whose first output holds exactly as many elements as their first input.
SAME_COUNT = frozenset(
    {
        "Identity",
        "Snapshot",
        "StopGradient",
        "PreventGradient",
        "EnsureShape",
        "Reshape",
        "Squeeze",
        "ExpandDims",
        "Cast",
        "Neg",
        "Abs",
        "LogicalNot",
        "FloorMod",
    }
)
#: Ops each of whose outputs holds at most as many elements as their first input.
AT_MOST_FIRST = frozenset(
    {
        "Unique",
        "UniqueV2",
        "UniqueWithCounts",
        "UniqueWithCountsV2",
        "DynamicPartition",
        "StridedSlice",
        "Slice",
    }
)
#: How many ops a walk goes back through at most.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Bound:
    """At most ``constant`` elements plus, for each ``(name, factor)`` of ``per_argument``,
    ``factor`` times the elements of the argument placeholder ``name`` of the graph
    ``graph_id`` (``id`` of the graph whose arguments they are, 0 when there are none)."""

    constant: int = 0
    per_argument: tuple[tuple[str, int], ...] = ()
    graph_id: int = 0

    def plus(self, other: Bound) -> Bound | None:
        """The sum (None: terms of two graphs' arguments)."""
        if self.graph_id and other.graph_id and self.graph_id != other.graph_id:
            return None
        return Bound(
            self.constant + other.constant,
            self.per_argument + other.per_argument,
            self.graph_id or other.graph_id,
        )

    def times(self, factor: int) -> Bound:
        terms = tuple((name, count * factor) for name, count in self.per_argument)
        return Bound(self.constant * factor, terms, self.graph_id)

    def value(self, counts: Mapping[str, int | None]) -> int | None:
        """The bound for arguments of ``counts`` elements, by placeholder name (None: an
        argument of unknown size)."""
        total = self.constant
        for name, factor in self.per_argument:
            count = counts.get(name)
            if count is None:
                return None
            total += factor * count
        return total


def element_bound(tensor: tf.Tensor) -> Bound | None:
    """The most elements ``tensor`` can hold when its graph runs, or ``None``."""
    return _bound(tensor, MAX_DEPTH)


def _bound(tensor: Any, depth: int) -> Bound | None:
    known = tensor.shape.num_elements()
    if known is not None:
        return Bound(int(known))
    if depth <= 0:
        return None
    op = tensor.op
    if op.type in SAME_COUNT:
        # FloorMod broadcasts its second input: the same count only for a scalar divisor
        if op.type == "FloorMod" and op.inputs[1].shape.num_elements() != 1:
            return None
        return _bound(op.inputs[0], depth - 1)
    if op.type in AT_MOST_FIRST:
        return _bound(op.inputs[0], depth - 1)
    if op.type == "Where":  # [true elements, rank]
        rank, inner = op.inputs[0].shape.rank, _bound(op.inputs[0], depth - 1)
        return None if rank is None or inner is None else inner.times(max(rank, 1))
    if op.type == "GatherV2":
        return _gather_bound(op, depth - 1)
    if op.type == "ConcatV2":
        return _sum_bound(op.inputs[:-1], depth - 1)
    if op.type == "Placeholder":
        return _placeholder_bound(tensor, depth - 1)
    return None


def _sum_bound(tensors: Any, depth: int) -> Bound | None:
    total: Bound | None = Bound()
    for tensor in tensors:
        part = _bound(tensor, depth)
        if part is None or total is None:
            return None
        total = total.plus(part)
    return total


def _gather_bound(op: Any, depth: int) -> Bound | None:
    """A gather along axis 0: as many rows as indices, or, for indices from ``tf.where``
    (a boolean mask: distinct rows), at most the rows of the gathered tensor."""
    axis = tf.get_static_value(op.inputs[2])
    if axis is None or int(axis) != 0 or op.get_attr("batch_dims") != 0:
        return None
    params, indices = op.inputs[0], op.inputs[1]
    if _from_where(indices, depth):
        return _bound(params, depth)
    inner, count = params.shape[1:].num_elements(), _bound(indices, depth)
    return None if inner is None or count is None else count.times(inner)


def _from_where(tensor: Any, depth: int) -> bool:
    """Whether ``tensor`` is ``tf.where``'s output of a vector, reshaped or cast
    (distinct indices)."""
    while depth > 0 and tensor.op.type in ("Reshape", "Squeeze", "Cast", "Identity"):
        tensor, depth = tensor.op.inputs[0], depth - 1
    return bool(tensor.op.type == "Where" and tensor.op.inputs[0].shape.rank == 1)


def _placeholder_bound(placeholder: Any, depth: int) -> Bound | None:
    """The outer tensor's bound for a capture; an argument of its function by name."""
    graph = placeholder.graph
    if not isinstance(graph, func_graph.FuncGraph):
        return None
    for external, internal in graph.captures:
        if internal is placeholder:
            outer = isinstance(getattr(external, "graph", None), tf.Graph)
            return _bound(external, depth) if outer else None
    if any(placeholder is argument for argument in graph.inputs):
        return Bound(0, ((placeholder.name, 1),), id(graph))
    return None
