"""``log_scalar``: one number off a tensor without keeping the tensor or its graph, and the
checks every logged value goes through (a 0-d real tensor or a plain number, a step an int).
"""

from __future__ import annotations

import decimal
import numbers
from typing import Any

import numpy as np
import torch

__all__ = ["log_scalar"]


def _shape(t: torch.Tensor | np.ndarray[Any, Any]) -> str:
    return "(" + ", ".join(str(int(d)) for d in t.shape) + ("," if t.ndim == 1 else "") + ")"


def _check_tensor(x: torch.Tensor) -> torch.Tensor:
    """A detached, dense, real, 0-d tensor sharing ``x``'s data; raises for anything else."""
    if x.is_complex():
        raise TypeError(f"cannot log a complex tensor ({x.dtype}) as one float")
    if x.numel() != 1:
        raise ValueError(
            f"expected a 0-d or one-element tensor, got shape {_shape(x)} "
            f"({x.numel()} elements); reduce it first (e.g. .mean())"
        )
    if x.is_meta:
        raise ValueError("a meta tensor has no value to log")
    t = x.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t if t.dim() == 0 else t.reshape(())


_PLAIN_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def _plain_0d(x: torch.Tensor) -> torch.Tensor | None:
    """``x.detach()`` when ``x`` is what a loss is (0-d, dense, a real dtype, not meta):
    four cheap checks instead of ``_check_tensor``'s nine. None: ask that one."""
    if x.dim() == 0 and x.layout is torch.strided and x.dtype in _PLAIN_DTYPES and not x.is_meta:
        return x.detach()
    return None


_STEP_MIN, _STEP_MAX = -(2**63), 2**63 - 2  # int64, and the next step still fits


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer, torch.Tensor)):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    value = int(step)
    if not _STEP_MIN <= value <= _STEP_MAX:
        raise ValueError(f"step must fit in 64 bits, got {value}")
    return value


def log_scalar(x: Any) -> float:
    """The value of ``x`` as a Python float, keeping nothing of ``x``.

    Accepts a 0-d or one-element tensor on any device (with or without ``requires_grad``;
    the graph is not kept), numpy scalars and one-element arrays, Python ``int``/``float``/
    ``bool``, ``fractions.Fraction`` and ``decimal.Decimal``. NaN and infinities pass through.
    ``bool`` values (and bool tensors) log as ``1.0``/``0.0``, as ``float(True)`` does.

    A device tensor is read with one transfer, which waits for the device (like ``.item()``);
    ``ScalarLogger`` avoids that wait.

    Raises:
        ValueError: a tensor or array with more or fewer than one element (the message names
            its shape), a meta tensor, or an integer too large for a float.
        TypeError: anything that is not a real number (strings, ``None``, lists, complex).
    """
    if isinstance(x, torch.Tensor):
        t = _check_tensor(x)
        return float(t.item())
    if isinstance(x, (bool, int, float)):
        return _real_to_float(x)
    if isinstance(x, np.ndarray):
        if x.size != 1:
            raise ValueError(f"expected a one-element array, got shape {_shape(x)}")
        x = x.reshape(())[()]
    if isinstance(x, np.generic):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"cannot log a numpy {x.dtype} value as a float")
        return _real_to_float(x.item())
    if isinstance(x, (numbers.Real, decimal.Decimal)):
        return _real_to_float(x)
    raise TypeError(
        f"cannot log a {type(x).__module__}.{type(x).__qualname__} as a float; "
        "pass a number, a numpy scalar or a one-element tensor"
    )


def _real_to_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{type(x).__name__} value is too large for a float") from None
