"""Where a table's variables live: whether the device in scope belongs to another task (a
parameter server), and variables created on that device past a distribution strategy's
variable creator."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops


def in_remote_scope() -> bool:
    """Whether the device scope in effect eagerly belongs to another job or task than this
    process (False without one, and in a graph)."""
    if not tf.executing_eagerly():
        return False
    return not on_this_task(context.context().device_name or "")


def on_this_task(device: str) -> bool:
    """Whether ``device`` (a device name, job and task where given) belongs to this
    process's job and task (True where it names neither)."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job is None:
        return True
    local = tf.DeviceSpec.from_string(context.context().host_address_space())
    return (spec.job, spec.task or 0) == (local.job, local.task or 0)


def fixed_variable(name: str, initial: tf.Tensor) -> tf.Variable:
    """A variable of ``initial``'s shape on the device in scope.

    Built as a plain ``ResourceVariable``, past any distribution strategy's variable
    creator: ``ParameterServerStrategy`` places each new variable on the next parameter
    server in turn, which would spread one table over several tasks.
    """
    return resource_variable_ops.ResourceVariable(
        initial, name=name, trainable=False, shape=initial.shape
    )
