"""The public face: what ``import cudamem`` exports, and where result types live."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import cudamem

API = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md").read_text()
DOCUMENTED = set(re.findall(r"^::: (cudamem[\w.]*)$", API, flags=re.M))

#: Result types, each in the module that defines it (imported there, documented there).
RESULTS = {
    "spans.record": ("SpanRecord", "DeviceSpan", "ExceptionInfo"),
    "spans.history": ("History", "SpanStats"),
    "allocator.stats": ("AllocatorStats", "DeviceCounters"),
    "holders.finder": ("Holders", "Holder", "GraphHolders", "GraphHolder"),
    "holders.census": ("Census", "LiveStorage"),
    "holders.unaccounted": ("Unaccounted",),
    "holders.culprits": ("Culprit",),
    "spans.leftovers": ("LeakReport",),
    "growth.report": ("Growth",),
    "growth.settings": ("LeakSettings",),
    "ledger.oom": ("OomReport", "OomEvent"),
    "ledger.oom_guard": ("OomGuard",),
    "ledger.device": ("Explanation", "DeviceLedger", "LedgerLine"),
    "ledger.status": ("MachineStatus", "StatusLine"),
    "ledger.free_space": (
        "Fragmentation",
        "PoolFragmentation",
        "OomJudgement",
        "OomFacts",
        "OomVerdict",
    ),
    "ledger.reclaim": ("ReleaseResult", "DeviceRelease"),
    "scalars.logger": ("Series",),
    "scalars.series": ("SeriesSummary", "LoggerStats"),
    "host.copy": ("HostCopy",),
    "host.workers": ("LoaderReport", "WorkerMemory", "WatchSettings"),
    "host.ledger": ("HostLedger", "PinnedPool", "HostRelease"),
    "run.runner": ("RunReport",),
    "growth.compare": ("MemoryDiff", "DiffEntry"),
    "ledger.memviz": ("SnapshotDump", "AutoDump"),
    "modules.profile": ("ModuleProfile", "ModuleStats", "Spread"),
    "modules.profiler": ("ModuleProfiler",),
    "distributed.results": (
        "DistributedReport",
        "RankReport",
        "RankDevice",
        "RankSpan",
        "RankGrowth",
        "HostGpu",
        "GpuHolding",
        "StrayMemory",
        "Outlier",
    ),
    "fit.memory_plan": ("MemoryPlan", "Prediction", "CheckpointAdvice", "NotLinearError"),
}


def test_at_most_thirty_three_names_and_each_resolves() -> None:
    # 33: fragmentation and plan (issue 34), HostMemoryWarning (issue 35); watch_workers
    # stays in cudamem.host.workers.
    assert len(cudamem.__all__) <= 33, cudamem.__all__
    for name in cudamem.__all__:
        assert hasattr(cudamem, name), name


def test_what_users_call_is_exported() -> None:
    for name in (
        "track",
        "MemorySpan",
        "who_holds",
        "live_tensors",
        "ScalarLogger",
        "log_scalar",
        "to_host",
        "explain",
        "release",
        "leaks",
        "LeakWarning",
        "HostMemoryWarning",
        "on_oom",
        "plot",
        "load_snapshot",
        "find_graph_holders",
        "dump_snapshot",
        "diff",
        "unaccounted",
        "history",
        "max_allocated",
        "configure_leaks",
        "machine_status",
        "track_modules",
        "fragmentation",
        "plan",
    ):
        assert name in cudamem.__all__, name


def test_every_exported_name_is_documented() -> None:
    for name in cudamem.__all__:
        if name == "__version__":
            continue
        obj = getattr(cudamem, name)
        home = f"cudamem.{obj.__module__.removeprefix('cudamem.')}.{name}"
        assert f"cudamem.{name}" in DOCUMENTED or home in DOCUMENTED, name


def test_result_types_live_in_their_modules() -> None:
    for module_name, names in RESULTS.items():
        module = importlib.import_module(f"cudamem.{module_name}")
        for name in names:
            obj = getattr(module, name)
            assert obj.__module__ == module.__name__, (module_name, name)
            assert name in module.__all__, (module_name, name)
            assert name not in cudamem.__all__, name
            assert f"{module.__name__}.{name}" in DOCUMENTED, (module_name, name)


def test_the_old_remaining_storage_name_is_live_storage() -> None:
    import pytest

    from cudamem.holders.census import LiveStorage

    release = importlib.import_module("cudamem.ledger.reclaim")  # cudamem.release is the function

    with pytest.warns(DeprecationWarning, match="LiveStorage"):
        assert release.RemainingStorage is LiveStorage
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        release.Missing


def test_the_package_docstring_import_paths_work_as_written() -> None:
    doc = cudamem.__doc__ or ""
    paths = re.findall(r"``(cudamem(?:\.\w+)+)``", doc)
    assert len(paths) >= 3, paths
    for path in paths:
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), path
