"""The optional compiled span core (``native/src/spancore/``): a span's open and close in C for the
case almost every span is in (one device, no synchronize), a few times cheaper than the
Python path; everything else is handed to the Python functions it replaces.

Built, cached and loaded like the heap pass (``cext``): nothing at import, a background
build at the first span, ``CUDAMEM_FAST_SPAN=0`` turns it off. This module owns the build;
``cudamem.spans.span`` owns the switch: ``init`` gives it a state of its own (from the one
table ``spans.core.core_table`` makes: its types, its ``SpanState``, its helpers and
containers; another copy of ``cudamem.spans`` in the process gets another), it
checks a span through each path field by field, and only then replaces its
``_open``/``_close`` with the state's.
"""

from __future__ import annotations

from .cext import Extension, ExtensionStatus

__all__ = ["EXTENSION", "SWITCH_ENV", "status"]

SWITCH_ENV = "CUDAMEM_FAST_SPAN"
#: The build's own check is that ``init`` is there: it makes the state whose functions
#: serve (``span._core_check`` checks those).
EXTENSION = Extension(
    stem="spancore",
    name="span core",
    switch_env=SWITCH_ENV,
    idle_reason="not needed yet (no span has opened)",
    exports=("init",),
)


def status() -> ExtensionStatus:
    """Which path opens and closes spans, and why."""
    return EXTENSION.status()
