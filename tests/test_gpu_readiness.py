"""Every op HashTable runs has a GPU kernel for the dtypes it uses (checked on a CPU box).

The table's operations are traced as ``tf.function`` s; every node of the graphs, including
the bodies of nested functions (while/cond bodies, nested ``tf.function`` calls), must have
a kernel registered for ``GPU`` (or ``DEFAULT``, which TensorFlow registers for every
device, with host-memory inputs where needed) whose type constraints accept the node's
dtypes. The one exception is the string constants of an assertion's message, which
TensorFlow keeps in host memory next to the (GPU-capable) ``Assert`` kernel.
``kernels.get_registered_kernels_for_op`` lists no ``XLA_GPU_JIT`` kernels, so the ops of
the XLA-compiled functions (the first probe rounds of a big batch, and the race of an
insert's or a bulk load's keys for the empty slots those rounds found) are checked against
the plain GPU kernels too, which XLA's GPU backend covers. Inside a
``tf.function`` the table calls the same shared kernel functions its eager calls run
(each holding the table's mutex: ``MutexLock`` and ``ConsumeMutexLock`` have ``DEFAULT``
kernels), so tracing one graph covers both. The table is traced with the kernels it
would run on a GPU (unordered scatters: claim races confirmed with extra writes); on a
CPU it skips those extra steps, and runs a subset of the same ops.
"""

from __future__ import annotations

import itertools

import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2
from tensorflow.python.framework import kernels

from de_store.tables import HashTable
from de_store.testing.tables import with_unordered_scatters

KEY_DTYPES = [tf.int64, tf.int32]
VALUE_DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.float64, tf.int32, tf.int64]
_GPU_DEVICES = ("GPU", "DEFAULT")


def _kernel_accepts(kernel, attrs) -> bool:
    for constraint in kernel.constraint:
        allowed = set(constraint.allowed_values.list.type)
        attr: attr_value_pb2.AttrValue | None = attrs.get(constraint.name)
        if attr is None:
            return False
        used = list(attr.list.type) if attr.HasField("list") else [attr.type]
        if not set(used) <= allowed:
            return False
    return True


def _nodes(graph_def: graph_pb2.GraphDef):
    yield from graph_def.node
    for function in graph_def.library.function:
        function: function_pb2.FunctionDef
        yield from function.node_def


def _is_assert_message(node) -> bool:
    """A string constant of an assertion's message (host memory by design on GPU too)."""
    is_string = node.attr["dtype"].type == tf.string.as_datatype_enum
    return node.op == "Const" and is_string and "Assert" in node.name.split("/")


def cpu_only_ops(graph_def: graph_pb2.GraphDef) -> list[str]:
    """Describe every node of ``graph_def`` (and its library) lacking a matching GPU kernel."""
    library = {f.signature.name for f in graph_def.library.function}
    missing = []
    for node in _nodes(graph_def):
        if node.op in library or _is_assert_message(node):
            continue  # a call's body is walked as a library function
        registered = kernels.get_registered_kernels_for_op(node.op).kernel
        gpu = [k for k in registered if k.device_type in _GPU_DEVICES]
        if not any(_kernel_accepts(k, node.attr) for k in gpu):
            types = {
                name: tf.as_dtype(value.type).name
                for name, value in node.attr.items()
                if value.WhichOneof("value") == "type"
            }
            missing.append(f"{node.op} ({node.name}, {types})")
    return sorted(set(missing))


def _traced_graph(table: HashTable) -> graph_pb2.GraphDef:
    """One graph calling lookup, insert, accum, remove, export, the change tracking, size
    and clear."""

    def every_operation(keys, rows):
        values, exists = table.lookup(keys, default_value=rows)
        table.insert(keys, rows)
        table.load_distinct(keys + 1_000_000, rows)
        table.accum(keys, rows)
        table.accum(keys, rows, insert_missing=False)
        table.remove(keys)
        exported = table.export_all()
        changes = table.export_changes(0)
        table.forget_removed(0)
        table.clear()
        return values, exists, exported, changes, table.size()

    specs = [
        tf.TensorSpec([None], table.key_dtype),
        tf.TensorSpec([None, table.dim], table.value_dtype),
    ]
    traced = tf.function(every_operation, autograph=False).get_concrete_function(*specs)
    return traced.graph.as_graph_def()


@pytest.mark.parametrize(
    ("key_dtype", "value_dtype"),
    list(itertools.product(KEY_DTYPES, VALUE_DTYPES)),
    ids=lambda d: d.name,
)
def test_every_table_op_has_a_gpu_kernel(key_dtype, value_dtype):
    table = with_unordered_scatters(HashTable(key_dtype, value_dtype, 3, name="gpu_check"))
    graph_def = _traced_graph(table)
    called = {f.signature.name for f in graph_def.library.function}
    assert sum("probe" in name or "while" in name for name in called) > 0, called
    offenders = cpu_only_ops(graph_def)
    assert not offenders, f"ops without a GPU kernel: {offenders}"


def test_the_checker_walks_nested_bodies_and_catches_a_cpu_only_op():
    mutable = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)

    @tf.function(autograph=False)
    def inner(k):
        return mutable.lookup(k)

    def body(i, acc):
        return i + 1, acc + tf.reduce_sum(inner(tf.range(3, dtype=tf.int64)))

    @tf.function(autograph=False)
    def outer():
        return tf.while_loop(lambda i, _: i < 2, body, (tf.constant(0), tf.constant(0.0)))

    graph_def = outer.get_concrete_function().graph.as_graph_def()
    offenders = cpu_only_ops(graph_def)
    assert any(op.startswith("LookupTableFindV2") for op in offenders), offenders
    assert all(op.split()[0] not in ("While", "Add", "Sum") for op in offenders), offenders
