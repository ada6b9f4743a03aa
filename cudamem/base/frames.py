"""Which code is cudamem's own (or torch's), and so never the user's line or holder.

The holder search hides cudamem's frames; leak warnings, OOM allocation sites and the
``cudamem run`` traceback point past cudamem and torch at the user's code.
"""

from __future__ import annotations

import os
import types

import torch

__all__ = ["PACKAGE_DIR", "is_library_file", "is_own_file", "own_frame"]

#: cudamem's directory (one up from ``cudamem/base/``), with a trailing separator (its
#: subpackages are under it).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = (PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def is_own_file(filename: str) -> bool:
    """Whether ``filename`` (a code object's ``co_filename``) is part of cudamem."""
    try:
        return os.path.abspath(filename).startswith(PACKAGE_DIR)
    except Exception:
        return False


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is part of cudamem or torch: not where the user's code is."""
    try:
        return os.path.abspath(filename).startswith(_LIBRARY_DIRS)
    except Exception:
        return False


def own_frame(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs cudamem's own code (never shown as a holder or a site)."""
    try:
        return is_own_file(frame.f_code.co_filename)
    except Exception:
        return False
