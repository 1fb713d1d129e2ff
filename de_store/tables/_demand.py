"""What the steps ask of fixed-shape tables: the live tables, and the calls each traced
step makes on them.

Every fixed-shape table's ``Growth`` registers here when it is created. While a
``tf.function`` is traced, each call that may add keys to such a table (or log removals)
is noted in the graph being traced, with a bound of its keys when the graph gives one
(:mod:`._key_bounds`: static, or in terms of the step's arguments), and in every graph
around it: a ``tf.cond`` branch runs at most
once a step, so its bound holds in the graph around it too; a loop body, or a
``tf.function`` called from the step (which can be called again without being traced
again), runs an unknown number of times, so the graphs around it note the call without
a bound. :mod:`._ps_growth` reads these notes for the step a coordinator schedules.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import func_graph
from tensorflow.python.ops import control_flow_v2_func_graphs

from de_store.tables._key_bounds import Bound

#: The two kinds of room a step can run out of: new keys, and entries of the removal log.
ADD, REMOVE = 0, 1
KINDS = (ADD, REMOVE)


@dataclass
class Sites:
    """The calls one traced graph makes on one table, by kind of room."""

    #: how many calls
    calls: list[int] = field(default_factory=lambda: [0, 0])
    #: the most keys they pass together, or None when one of them has no bound
    bounds: list[Bound | None] = field(default_factory=lambda: [Bound(), Bound()])

    def add(self, kind: int, bound: Bound | None) -> None:
        self.calls[kind] += 1
        total = self.bounds[kind]
        self.bounds[kind] = None if total is None or bound is None else total.plus(bound)


_tables: weakref.WeakSet[Any] = weakref.WeakSet()
_sites: weakref.WeakKeyDictionary[Any, dict[weakref.ref[Any], Sites]] = weakref.WeakKeyDictionary()
#: names of the kernel functions that fixed-shape tables' steps call
_kernel_names: set[str] = set()


def register(growth: Any) -> None:
    """Add a fixed-shape table's ``Growth`` to the live tables."""
    _tables.add(growth)


def live() -> list[Any]:
    """The ``Growth`` of every fixed-shape table alive in this process."""
    return list(_tables)


def note_call(growth: Any, kind: int, bound: Bound | None, kernel_name: str) -> None:
    """Note, in the graph being traced and every graph around it, a call on ``growth``'s
    table taking room of ``kind`` for at most ``bound`` keys (None: unknown), through
    the kernel function ``kernel_name``. A bound in terms of one graph's arguments holds
    in that graph only."""
    _kernel_names.add(kernel_name)
    graph: Any = tf.compat.v1.get_default_graph()
    key = weakref.ref(growth)
    while isinstance(graph, func_graph.FuncGraph):
        own = bound is not None and bound.graph_id in (0, id(graph))
        _sites.setdefault(graph, {}).setdefault(key, Sites()).add(kind, bound if own else None)
        if not isinstance(graph, control_flow_v2_func_graphs.CondBranchFuncGraph):
            bound = None  # a loop body or a nested function: any number of runs a step
        graph = graph.outer_graph


def sites_of(graph: Any) -> dict[Any, Sites]:
    """The calls ``graph`` makes, by live table's ``Growth``."""
    found = _sites.get(graph, {})
    return {ref(): sites for ref, sites in found.items() if ref() is not None}


def calls_kernels(graph: Any) -> bool:
    """Whether ``graph``'s function library holds a kernel that fixed-shape tables' steps
    call (a step reaching a table through a function traced before it)."""
    library = getattr(graph, "_functions", {})
    return any(name in _kernel_names for name in library)
