"""cudamem: where your PyTorch GPU memory went, and why it does not come back.

Spans (``track``/``MemorySpan``) measure what code took and gave back per device;
``who_holds`` names what keeps a tensor alive; ``ScalarLogger`` logs losses without keeping
graphs; ``explain``/``release`` reconcile nvidia-smi with PyTorch.

This package exports what you call. The results those calls return are frozen values,
importable from the modules that define them (``cudamem.spans.record.SpanRecord``,
``cudamem.holders.census.Census``, ``cudamem.spans.leftovers.LeakReport``, ...): see the API
reference.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .allocator.snapshot import UnsafeSnapshotError, load_snapshot
from .growth._capture import leaks
from .growth.compare import diff
from .growth.detector import configure_leaks, leak_settings
from .growth.settings import LeakWarning
from .holders.census import live_tensors
from .holders.finder import find_graph_holders, who_holds
from .holders.unaccounted import unaccounted
from .host.copy import to_host
from .host.workers import HostMemoryWarning
from .ledger.memviz import dump_snapshot
from .ledger.oom import oom_report
from .ledger.oom_guard import on_oom
from .ledger.reading import explain, fragmentation
from .ledger.reclaim import release
from .ledger.status import machine_status
from .modules.profiler import track_modules
from .scalars.log import log_scalar
from .scalars.logger import ScalarLogger
from .spans.history import clear_history, history, set_history_size
from .spans.span import MemorySpan, StepSpan, max_allocated, track

if TYPE_CHECKING:
    from .fit.planner import plan
    from .render.plot import plot

__version__ = "0.1.0"

__all__ = [
    "HostMemoryWarning",
    "LeakWarning",
    "MemorySpan",
    "ScalarLogger",
    "StepSpan",
    "UnsafeSnapshotError",
    "__version__",
    "clear_history",
    "configure_leaks",
    "diff",
    "dump_snapshot",
    "explain",
    "find_graph_holders",
    "fragmentation",
    "history",
    "leak_settings",
    "leaks",
    "live_tensors",
    "load_snapshot",
    "log_scalar",
    "machine_status",
    "max_allocated",
    "on_oom",
    "oom_report",
    "plan",
    "plot",
    "release",
    "set_history_size",
    "to_host",
    "track",
    "track_modules",
    "unaccounted",
    "who_holds",
]


#: Names imported on first use (PEP 562): the renderers load with the first result drawn
#: (``cudamem.base.present``), not with ``import cudamem``.
#: Imported when first asked for: ``plan`` (the fit package: 10-20 ms of ``import cudamem``
#: that only a plan needs), ``plot`` (matplotlib) and ``render``.
_LAZY = {"plan": "cudamem.fit.planner", "plot": "cudamem.render.plot", "render": "cudamem.render"}


def __getattr__(name: str) -> Any:
    """``cudamem.plan``, ``cudamem.plot`` and ``cudamem.render``, imported when first asked
    for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cudamem' has no attribute {name!r}")
    value = importlib.import_module(module)
    if name != "render":
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext cudamem``: the notebook magics (``cudamem.integrations.notebook``)."""
    from .integrations.notebook import load_ipython_extension as load

    load(ipython)
