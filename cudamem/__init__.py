"""cudamem: where your PyTorch GPU memory went, and why it does not come back.

Spans (``track``/``MemorySpan``) measure what code took and gave back per device;
``who_holds`` names what keeps a tensor alive; ``ScalarLogger`` logs losses without keeping
graphs; ``explain``/``release`` reconcile nvidia-smi with PyTorch.
"""

from __future__ import annotations

from ._history import History, SpanStats, clear_history, history, set_history_size
from .span import DeviceSpan, ExceptionInfo, MemorySpan, SpanRecord, max_allocated, track
from .stats import AllocatorStats, StatsDelta

# -- holders and census (issue 3) --
# -- scalars (issue 4) --
# -- device ledger (issue 5) --
# -- leaks (issue 6) --

__version__ = "0.1.0"

__all__ = [
    "AllocatorStats",
    "DeviceSpan",
    "ExceptionInfo",
    "History",
    "MemorySpan",
    "SpanRecord",
    "SpanStats",
    "StatsDelta",
    "__version__",
    "clear_history",
    "history",
    "max_allocated",
    "set_history_size",
    "track",
    # -- holders and census (issue 3) --
    # -- scalars (issue 4) --
    # -- device ledger (issue 5) --
    # -- leaks (issue 6) --
]
