"""Checking a user's arguments: one rule per kind, errors that name the argument.

``bool`` is an ``int`` to Python, but never a count or a number of seconds here: ``True``
passed as ``top`` is a mistake worth a ``TypeError``.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

__all__ = ["check_bool", "check_int", "check_seconds"]


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``.

    Raises:
        TypeError: not an int, naming ``name``.
        ValueError: below ``minimum``, naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as float seconds: a real number (not a bool), ``>= 0``, not NaN.

    Raises:
        TypeError: not a number, naming ``name``.
        ValueError: negative or NaN, naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return seconds
