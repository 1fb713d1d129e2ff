"""The arguments of a :class:`~de_store.variable.Variable` (both orders: de_store's and
TFRA's), their checks, its initializer rows, and the lock, values errors, key and row
checks and graph-mode results its methods share."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from de_store.errors import VariableError
from de_store.partition import Partitioner, default_partition_fn

INT_KEYS = (tf.int32, tf.int64)
_T = TypeVar("_T")


def holding_lock(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` holding its object's ``_lock`` (:meth:`Variable.exclusive
    <de_store.variable.Variable.exclusive>`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


def grouped(ops: list[Any]) -> Any:
    """In a ``tf.compat.v1`` graph, one op that runs ``ops`` (for ``Session.run``); else
    ``None`` (eagerly, and in a ``tf.function``, which runs every stateful op)."""
    if tf.executing_eagerly() or tf.compat.v1.get_default_graph().building_function:
        return None
    return tf.group(*[op for op in ops if op is not None])


def after(op: Any) -> list[Any]:
    """Control inputs that order a graph's next ops after ``op`` (none eagerly)."""
    return [] if op is None else [op]


class InvalidValuesError(VariableError, tf.errors.InvalidArgumentError):
    """Values of the wrong dtype or shape for a Variable.

    Also TensorFlow's ``InvalidArgumentError``, the error TFRA raises there, so code
    written for TFRA catches it.
    """

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def own_order(
    name: str,
    key_dtype: tf.DType = tf.int64,
    value_dtype: tf.DType = tf.float32,
    dim: int = 1,
    devices: str | Sequence[str] | None = None,
    partitioner: Partitioner = default_partition_fn,
    shared_name: str | None = "get_variable",
    initializer: Any = None,
    trainable: bool = True,
    checkpoint: bool = True,
    init_size: int = 0,
    kv_creator: Any = None,
    restrict_policy: Callable[[Any], Any] | None = None,
    bp_v2: bool = False,
    short_file_name: bool = False,
) -> dict[str, Any]:
    """The Variable's arguments in de_store's order (the name first)."""
    return dict(locals())


def tfra_order(
    key_dtype: tf.DType = tf.int64,
    value_dtype: tf.DType = tf.float32,
    dim: int = 1,
    devices: str | Sequence[str] | None = None,
    partitioner: Partitioner = default_partition_fn,
    shared_name: str | None = None,
    name: str = "DynamicEmbedding_Variable",
    initializer: Any = None,
    trainable: bool = True,
    checkpoint: bool = True,
    init_size: int = 0,
    kv_creator: Any = None,
    restrict_policy: Callable[[Any], Any] | None = None,
    bp_v2: bool = False,
    short_file_name: bool = False,
) -> dict[str, Any]:
    """The Variable's arguments in TFRA's order (the dtypes first)."""
    return dict(locals())


class Initializer:
    """The rows given to missing keys: zeros, a constant, a ``[dim]`` row or a callable."""

    def __init__(self, name: str, initializer: Any, value_dtype: tf.DType, dim: int) -> None:
        self.name, self.value_dtype, self.dim = name, value_dtype, dim
        self.function: Callable[..., Any] | None = None
        self.constant: tf.Tensor | None = None
        if initializer is None:
            self.constant = tf.zeros([], value_dtype)
        elif callable(initializer):
            self.function = initializer
            self._check_shape(self.rows(tf.constant(2)), "initializer output")
        else:
            array = np.asarray(initializer)
            if array.ndim == 1 and array.shape[0] == 1:  # TFRA broadcasts a [1] row
                array = array.reshape([])
            if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != dim):
                raise VariableError(
                    f"variable '{name}': expected an initializer of shape [] or [{dim}], "
                    f"got {list(array.shape)}"
                )
            self.constant = tf.constant(array, dtype=value_dtype)

    def _check_shape(self, rows: tf.Tensor, what: str) -> None:
        if rows.shape.as_list() != [2, self.dim]:
            raise VariableError(
                f"variable '{self.name}': expected {what} of shape [2, {self.dim}] "
                f"for 2 keys, got {rows.shape.as_list()}"
            )

    def constant_default(self) -> tf.Tensor | None:
        """The default row for the table cores, or ``None`` when it is random."""
        return self.constant

    def rows(self, count: tf.Tensor) -> tf.Tensor:
        """``count`` fresh rows, shape ``[count, dim]``.

        An initializer that cannot make them (tf_keras's ``Constant`` and
        ``tf.constant_initializer`` build ``tf.constant(value, shape)``, which needs a shape
        known when a graph is built, and a value of that many elements) gives one
        ``[1, dim]`` row, broadcast to every key's, as TFRA fills new keys from one row.
        """
        shape = tf.stack([count, self.dim])
        if self.function is None:
            return tf.broadcast_to(self.constant, shape)
        try:
            rows = self.function(shape=shape, dtype=self.value_dtype)
        except (NotImplementedError, TypeError, ValueError) as err:
            try:
                row = self.function(shape=[1, self.dim], dtype=self.value_dtype)
            except (NotImplementedError, TypeError, ValueError):
                raise err from None
            rows = tf.broadcast_to(row, shape)
        return tf.cast(rows, self.value_dtype)


def module_name(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"v_{cleaned}"


def check_dtypes(name: str, key_dtype: Any, value_dtype: Any) -> tuple[tf.DType, tf.DType]:
    key_dtype, value_dtype = tf.as_dtype(key_dtype), tf.as_dtype(value_dtype)
    if key_dtype not in (*INT_KEYS, tf.string):
        raise VariableError(
            f"variable '{name}': expected key_dtype int32, int64 or string, got {key_dtype.name}"
        )
    if not (value_dtype.is_floating or value_dtype.is_integer):
        raise VariableError(
            f"variable '{name}': expected a numeric value_dtype, got {value_dtype.name}"
        )
    return key_dtype, value_dtype


def check_dim(name: str, dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise VariableError(f"variable '{name}': expected dim >= 1, got {dim!r}")
    return int(dim)


def resolve_devices(name: str, devices: str | Sequence[str] | None) -> list[str]:
    if devices is None:
        gpus = tf.config.list_logical_devices("GPU")
        return [gpus[0].name if gpus else tf.config.list_logical_devices("CPU")[0].name]
    if isinstance(devices, str):
        devices = [devices]
    if not devices:
        raise VariableError(f"variable '{name}': expected at least one device, got []")
    known = {
        (spec.device_type, spec.device_index): device.name
        for device in tf.config.list_logical_devices()
        for spec in [tf.DeviceSpec.from_string(device.name)]
    }
    return [resolve_device(name, device, known) for device in devices]


def resolve_device(name: str, device: str, known: dict[tuple[Any, Any], str]) -> str:
    spec = tf.DeviceSpec.from_string(device if device.startswith("/") else f"/{device}")
    if spec.job not in (None, "localhost"):
        return device  # a remote device: placed by the cluster, not checked here
    resolved = known.get(((spec.device_type or "").upper(), spec.device_index or 0))
    if resolved is None:
        raise VariableError(
            f"variable '{name}': unknown device {device!r}; "
            f"expected one of {sorted(known.values())}"
        )
    return resolved


def checked_keys(name: str, key_dtype: tf.DType, keys: Any) -> tf.Tensor:
    """``keys`` as a tensor of ``key_dtype``; VariableError naming the variable ``name``
    when they are of another dtype (a tensor's is never cast)."""
    if isinstance(keys, (tf.Tensor, tf.Variable)) and keys.dtype != key_dtype:
        raise VariableError(
            f"variable '{name}': expected keys of dtype {key_dtype.name}, got {keys.dtype.name}"
        )
    try:
        return tf.convert_to_tensor(keys, dtype=key_dtype)
    except (TypeError, ValueError) as err:
        raise VariableError(
            f"variable '{name}': expected keys of dtype {key_dtype.name}, "
            f"got {np.asarray(keys).dtype}"
        ) from err


def checked_rows(
    name: str, value_dtype: tf.DType, dim: int, values: Any, what: str = "values"
) -> tf.Tensor:
    """``values`` as ``[n, dim]`` rows of ``value_dtype`` (numbers are cast);
    InvalidValuesError naming the variable ``name`` and ``what`` they are otherwise."""
    values = tf.convert_to_tensor(values)
    if values.dtype != value_dtype:
        if values.dtype.is_floating or values.dtype.is_integer:
            values = tf.cast(values, value_dtype)
        else:
            raise InvalidValuesError(
                f"variable '{name}': expected {what} of dtype "
                f"{value_dtype.name}, got {values.dtype.name}"
            )
    last = values.shape[-1] if values.shape.rank else None
    if last is not None and last != dim:
        raise InvalidValuesError(
            f"variable '{name}': expected {what} of shape [n, {dim}], got {values.shape.as_list()}"
        )
    return tf.reshape(values, [-1, dim])
