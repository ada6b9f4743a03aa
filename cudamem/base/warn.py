"""Warnings about cudamem's own bookkeeping: once per key, and never raised into user code."""

from __future__ import annotations

import contextlib
import warnings

__all__ = ["warn_once"]

#: Keys already warned about (a failing hook or reader warns once, not once per call).
_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 1) -> None:
    """A ``RuntimeWarning`` once per ``key``; ``stacklevel`` as the caller would give
    ``warnings.warn``. Under ``-W error`` the warning is dropped rather than raised: cudamem's
    own trouble must never end the user's training step."""
    if key in _warned:
        return
    _warned.add(key)
    with contextlib.suppress(Exception):
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
