"""The build states of cudamem's optional native extensions, defined once, and what reports
them: the C extensions (``cext``: the span core, the heap pass) and the C++ counter reader
(``fastread``) go through the same life and say where they are with these words
(``ExtensionStatus``, ``ReaderStatus``; ``ReaderUnavailable`` carries a dead end's state).

Standard library only. The statuses' ``__str__`` finds the renderer registry in
``sys.modules`` instead of importing it (results never import a renderer).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import ClassVar

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
    "ExtensionStatus",
    "ReaderStatus",
    "ReaderUnavailable",
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


#: The module of cudamem's renderer registry, looked up (never imported) by ``__str__``.
_REGISTRY = "cudamem.base.present"


class ReaderUnavailable(Exception):
    """The reader cannot serve here; ``state`` says how (``failed``, ``unsupported``...)."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ReaderStatus:
    """Which counter reader serves this process, and why (``python -m cudamem status``).

    ``state`` is one of ``active`` (the C++ reader serves), ``ready``/``building`` (it
    will soon), ``cached``/``not built`` (seen from a process where CUDA has not started),
    ``disabled``, ``unsupported``, ``failed`` or ``dropped`` (the dict path serves).
    """

    json_properties: ClassVar[tuple[str, ...]] = ("reader",)

    #: Whether the C++ reader serves counter reads in this process now.
    active: bool
    state: str
    #: One sentence: why this reader, and what to do about it.
    reason: str
    #: The build directory for this torch/CUDA/ABI/source (``None`` when no build applies).
    cache_dir: str | None = None

    @property
    def reader(self) -> str:
        """``"C++"`` or ``"dict"``: what answers a counter read now."""
        return "C++" if self.active else "dict"

    def __str__(self) -> str:
        # One line (cudamem/render/reader.py), through the renderer registry where cudamem
        # has loaded it: this file imports no cudamem module (the build loads it by path).
        registry = sys.modules.get(_REGISTRY)
        return str(registry.present(self)) if registry is not None else repr(self)


@dataclass(frozen=True, slots=True)
class ExtensionStatus:
    """Whether a compiled extension serves now, and why (or why not)."""

    #: What it does, as ``cudamem status`` names it: "span core", "heap pass".
    name: str
    active: bool
    state: str
    reason: str
    path: str | None = None
