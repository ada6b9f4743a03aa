"""Telling of a growth: the hooks integrations add (``add_growth_hook``), then one
``LeakWarning`` pointing at the user's code, and the same text to the ``cudamem.leaks``
logger where anyone listens."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable

from ..base.frames import is_library_file
from .report import Growth
from .settings import LeakWarning

__all__ = ["add_growth_hook", "emit", "remove_growth_hook", "stacklevel"]


logger = logging.getLogger("cudamem.leaks")


def stacklevel() -> int:
    """The stack level of the first frame outside cudamem and torch: the user's ``with``, or
    the user's ``optimizer.step()`` when ``cudamem run`` closed the span from torch's hook."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


#: Called with every ``Growth`` about to be warned about (integrations count culprits
#: and dump snapshots there). Replaced, never mutated.
_growth_hooks: tuple[Callable[[Growth], None], ...] = ()


def add_growth_hook(hook: Callable[[Growth], None]) -> None:
    """Call ``hook(growth)`` before each ``LeakWarning`` (errors are swallowed)."""
    global _growth_hooks
    if hook not in _growth_hooks:
        _growth_hooks = (*_growth_hooks, hook)


def remove_growth_hook(hook: Callable[[Growth], None]) -> None:
    """Undo ``add_growth_hook``."""
    global _growth_hooks
    _growth_hooks = tuple(h for h in _growth_hooks if h is not hook)


def emit(growth: Growth) -> None:
    """One warning, and the same text to logging when anyone listens."""
    for hook in _growth_hooks:
        try:
            hook(growth)
        except Exception as exc:  # an integration's hook must not stop the warning
            logger.debug("cudamem: growth hook %r failed: %r", hook, exc)
    text = str(growth)
    warnings.warn(LeakWarning(text, growth), stacklevel=stacklevel())
    # Only when logging is configured: Python's last-resort handler would otherwise print
    # the same text a second time under the warning.
    if logger.hasHandlers():
        logger.warning(text)
