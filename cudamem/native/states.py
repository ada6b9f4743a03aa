"""The build states of cudamem's optional native extensions, defined once: the C extensions
(``cudamem._cext``: the span core, the heap pass) and the C++ counter reader
(``cudamem._fastread``) go through the same life and report it with these words.

Standard library only, like everything the reader's build loads.
"""

from __future__ import annotations

import os

__all__ = [
    "ACTIVE",
    "BUILDING",
    "CACHED",
    "DISABLED",
    "DROPPED",
    "FAILED",
    "FINAL",
    "IDLE",
    "NOT_BUILT",
    "READY",
    "UNSUPPORTED",
    "switched_off",
]

# In the order a successful life goes through them.
IDLE = "idle"
BUILDING = "building"
READY = "ready"
ACTIVE = "active"
# Dead ends (Python, or the dict read, serves).
DISABLED = "disabled"
UNSUPPORTED = "unsupported"
FAILED = "failed"
DROPPED = "dropped"
# Seen from a process that has not started the reader (``cudamem status``).
CACHED = "cached"
NOT_BUILT = "not built"

#: States that no later call changes (nothing to poll for).
FINAL = frozenset({ACTIVE, DISABLED, UNSUPPORTED, FAILED, DROPPED})

_OFF = frozenset({"0", "false", "no", "off"})


def switched_off(env: str) -> bool:
    """Whether the switch variable ``env`` turns its extension off (``0``, ``false``,
    ``no``, ``off``, any case)."""
    return os.environ.get(env, "").strip().lower() in _OFF
