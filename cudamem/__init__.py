"""cudamem: where your PyTorch GPU memory went, and why it does not come back.

Spans (``track``/``MemorySpan``) measure what code took and gave back per device;
``who_holds`` names what keeps a tensor alive; ``ScalarLogger`` logs losses without keeping
graphs; ``explain``/``release`` reconcile nvidia-smi with PyTorch.
"""

from __future__ import annotations

from typing import Any

from ._history import History, SpanStats, clear_history, history, set_history_size
from .census import Census, LiveStorage, Unaccounted, live_tensors, unaccounted
from .culprits import Culprit
from .diff import DiffEntry, MemoryDiff, diff
from .holders import GraphHolder, GraphHolders, Holder, Holders, find_graph_holders, who_holds
from .host import HostCopy, to_host
from .leaks import (
    Growth,
    LeakReport,
    LeakSettings,
    LeakWarning,
    configure_leaks,
    leak_settings,
    leaks,
)
from .ledger import DeviceLedger, Explanation, LedgerLine, MachineStatus, explain, machine_status
from .memviz import SnapshotDump, dump_snapshot
from .oom import OomEvent, OomGuard, OomReport, on_oom, oom_report
from .plot import plot
from .release import DeviceRelease, ReleaseResult, RemainingStorage, release
from .scalars import (
    LoggerStats,
    ScalarLogger,
    Series,
    SeriesSummary,
    log_scalar,
)
from .snapshot import UnsafeSnapshotError, load_snapshot
from .span import DeviceSpan, ExceptionInfo, MemorySpan, SpanRecord, max_allocated, track
from .stats import AllocatorStats, StatsDelta

__version__ = "0.1.0"

__all__ = [
    "AllocatorStats",
    "Census",
    "Culprit",
    "DeviceLedger",
    "DeviceRelease",
    "DeviceSpan",
    "DiffEntry",
    "ExceptionInfo",
    "Explanation",
    "GraphHolder",
    "GraphHolders",
    "Growth",
    "History",
    "Holder",
    "Holders",
    "HostCopy",
    "LeakReport",
    "LeakSettings",
    "LeakWarning",
    "LedgerLine",
    "LiveStorage",
    "LoggerStats",
    "MachineStatus",
    "MemoryDiff",
    "MemorySpan",
    "OomEvent",
    "OomGuard",
    "OomReport",
    "ReleaseResult",
    "RemainingStorage",
    "ScalarLogger",
    "Series",
    "SeriesSummary",
    "SnapshotDump",
    "SpanRecord",
    "SpanStats",
    "StatsDelta",
    "Unaccounted",
    "UnsafeSnapshotError",
    "__version__",
    "clear_history",
    "configure_leaks",
    "diff",
    "dump_snapshot",
    "explain",
    "find_graph_holders",
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
    "plot",
    "release",
    "set_history_size",
    "to_host",
    "track",
    "unaccounted",
    "who_holds",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext cudamem``: the notebook magics (:mod:`cudamem.integrations.notebook`)."""
    from .integrations.notebook import load_ipython_extension as load

    load(ipython)
