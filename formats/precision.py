"""Values stored at a lower precision than the variable's: what a shard holds, and back.

A float32 variable's ``value`` column can be stored narrower, by the user's choice
(``FileSystemSaver(value_precision=...)``); the manifest records the choice and a reader
converts the rows back to float32 as it reads them:

- ``"bfloat16"``, ``"float16"``: each value rounded to nearest, ties to even (as
  ``tf.cast`` and ``ml_dtypes`` round). Infinities and NaN are kept as such. A finite value
  past float16's range (``|x| > 65504``) is refused: float16 would turn it into infinity.
- ``"int8"``: each row ``x`` stored as ``q = round(x / s)`` in ``[-127, 127]`` with one
  scale ``s`` per row in the float16 column :data:`SCALE_COLUMN`: ``s`` is ``max|x| / 127``
  rounded up to the next float16, so no value is clipped. A reader gets ``q * s`` (exact in
  float32). Every value comes back within ``s * (1/2 + 2**-17)`` of the one saved (half a
  step, plus float32's rounding of ``x / s``), and ``s <= max|x| / 127 * (1 + 2**-10) +
  2**-24`` (float16's rounding up, in its normal and its subnormal range). A row of zeros
  has ``s = 0`` and comes back as zeros; a row whose values are ``q * s`` for such an ``s``
  comes back exactly. Rows holding infinities or NaN, and rows with ``max|x| / 127`` past
  float16's largest value (``max|x| > 127 * 65504``), are refused with the variable and the
  key named: int8 has no code for them.

Only the ``value`` column changes; optimizer slots and other columns stay at their dtype.
The conversions need numpy and ml_dtypes only. Where the process has imported TensorFlow
(a save does), its cast to float16 rounds the same values several times faster than
numpy's, which converts one value at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ._schema import ExtraColumn

#: The precisions a float32 ``value`` column can be stored at.
PRECISIONS = ("bfloat16", "float16", "int8")
#: The dtypes whose values can be stored at another precision.
FROM_DTYPES = ("float32",)
#: The column of an int8 shard holding each row's scale.
SCALE_COLUMN = "value_scale"
#: The dtype of :data:`SCALE_COLUMN`.
SCALE_DTYPE = "float16"
#: Largest code of an int8 value (the range is symmetric: -127..127).
INT8_STEPS = 127
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def stored_dtype(precision: str) -> str:
    """The dtype of the stored ``value`` column at ``precision``: its rows packed, each a
    ``fixed_size_binary`` of its elements' bytes (see ``_schema.PACKED_DTYPES``)."""
    return f"packed_{precision}"


def scale_columns(precision: str | None) -> tuple[ExtraColumn, ...]:
    """The columns a shard holds beside ``value`` for ``precision`` (int8: its scales)."""
    return (ExtraColumn(SCALE_COLUMN, SCALE_DTYPE),) if precision == "int8" else ()


def check_precision(precision: str | None, value_dtype: str, variable: str) -> None:
    """ValueError when variable ``variable`` of ``value_dtype`` cannot be stored at
    ``precision`` (None: at its own dtype, always possible)."""
    if precision is None:
        return
    if precision not in PRECISIONS:
        raise ValueError(
            f"value_precision {precision!r} for variable {variable!r} is not one of "
            f"{['float32', *PRECISIONS]}"
        )
    if value_dtype not in FROM_DTYPES:
        raise ValueError(
            f"value_precision={precision!r} cannot store variable {variable!r}: its values "
            f"are {value_dtype}, value_precision applies to float32 values only"
        )


def encode(
    values: np.ndarray, precision: str, keys: np.ndarray, variable: str
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``values [n, dim]`` (float32) as stored at ``precision``: the stored values and the
    columns they need beside them (int8: the scales).

    Raises
    ------
    ValueError
        A value the precision cannot hold (see the module's docstring); the message names
        the variable and the first such row's key.
    """
    if precision == "bfloat16":
        return values.astype(ml_dtypes.bfloat16), {}
    if precision == "float16":
        stored = _float16(values)
        infinite = (stored.view(np.uint16) & 0x7FFF) == 0x7C00  # float16's infinities
        overflow = infinite & np.isfinite(values) if infinite.any() else infinite
        if overflow.any():
            row = int(np.flatnonzero(overflow.any(axis=1))[0])
            found = float(values[row][overflow[row]][0])
            _refuse(variable, keys[row], f"holds {found!r}, past float16's largest value "
                    f"{_FLOAT16_MAX:g}; use value_precision='bfloat16'")  # fmt: skip
        return stored, {}
    return _int8(values, keys, variable)


def _eager_tensorflow() -> Any:
    """TensorFlow, where this process has imported it and this thread runs eagerly; else
    None (compaction runs without it)."""
    tf = sys.modules.get("tensorflow")
    eager = getattr(tf, "executing_eagerly", None)
    return tf if eager is not None and eager() else None


def _float16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to float16, a finite value past its range to infinity."""
    tf = _eager_tensorflow()
    if tf is None or not values.size:
        with np.errstate(over="ignore"):  # refused by the caller, by key
            return values.astype(np.float16)
    with tf.device("/cpu:0"):
        return np.asarray(tf.cast(values, tf.float16).numpy())


def _int8(
    values: np.ndarray, keys: np.ndarray, variable: str
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Each row as int8 codes and its float16 scale (see the module's docstring)."""
    largest = _row_abs_max(values).astype(np.float32, copy=False)
    if not np.isfinite(largest).all():
        row = int(np.flatnonzero(~np.isfinite(largest))[0])
        _refuse(variable, keys[row], "holds an infinity or NaN, which int8 cannot store; "
                "use value_precision='bfloat16' or 'float16'")  # fmt: skip
    wanted = largest / np.float32(INT8_STEPS)
    with np.errstate(over="ignore"):  # refused below, by key
        scale = wanted.astype(np.float16)
    low = scale.astype(np.float32) < wanted
    scale[low] = np.nextafter(scale[low], np.float16(np.inf))
    if np.isinf(scale).any():
        row = int(np.flatnonzero(np.isinf(scale))[0])
        _refuse(variable, keys[row], f"holds {float(largest[row])!r}: an int8 row's scale "
                f"(max|x| / 127) must fit float16, so max|x| <= {INT8_STEPS * _FLOAT16_MAX:g}; "
                "use value_precision='bfloat16'")  # fmt: skip
    divisor = scale.astype(np.float32)
    divisor[divisor == 0] = 1  # a row of zeros: every code 0
    codes = values / divisor[:, None]
    np.rint(codes, out=codes)  # in place: a new array would be new memory to touch
    np.clip(codes, -INT8_STEPS, INT8_STEPS, out=codes)
    return codes.astype(np.int8), {SCALE_COLUMN: scale}


#: Rows narrower than this get their largest magnitude a column at a time (see below).
_COLUMNWISE_WIDTH = 64


def _row_abs_max(values: np.ndarray) -> np.ndarray:
    """``max |x|`` of each row of ``values [n, dim]`` (NaN where a row holds one).

    numpy reduces along a short row one row at a time; for rows narrower than
    :data:`_COLUMNWISE_WIDTH` a running maximum over the columns, each a vectorized pass
    over every row, takes a few times less (the same values: max is exact).
    """
    if not values.shape[1]:
        return np.zeros(len(values), np.float32)
    if values.shape[1] >= _COLUMNWISE_WIDTH:
        return np.asarray(np.max(np.abs(values), axis=1))
    largest = np.abs(values[:, 0])
    column = np.empty_like(largest)
    for j in range(1, values.shape[1]):
        np.maximum(largest, np.abs(values[:, j], out=column), out=largest)
    return largest


def _refuse(variable: str, key: object, what: str) -> None:
    raise ValueError(f"variable {variable!r}: the row of key {_key_text(key)} {what}")


def _key_text(key: object) -> str:
    return repr(key.decode() if isinstance(key, bytes) else getattr(key, "item", lambda: key)())


def decode(
    values: np.ndarray, extras: Mapping[str, np.ndarray], precision: str
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Stored ``values`` (and the columns beside them) back as float32 rows, with the
    other extra columns as they were."""
    rest = {name: column for name, column in extras.items() if name != SCALE_COLUMN}
    if precision != "int8":
        return values.astype(np.float32), rest
    scale = np.asarray(extras[SCALE_COLUMN]).astype(np.float32)
    return values.astype(np.float32) * scale[:, None], rest


def error_bound(scale: np.ndarray) -> np.ndarray:
    """The most an int8 value of a row with ``scale`` differs from the value saved."""
    return np.asarray(scale, np.float32) * np.float32(0.5 + 2.0**-17)
