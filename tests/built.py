"""Frozen results built by hand, for the renderer tests (no collection, no torch calls).

Each factory returns one result with round, known figures, so a test can assert the exact
text, JSON or HTML a renderer makes of it. Override fields with keyword arguments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cudamem.allocator.cache_split import CacheSplit, PrivatePool
from cudamem.allocator.stats import AllocatorStats
from cudamem.growth.report import Growth
from cudamem.holders.census import Census, LiveStorage
from cudamem.holders.culprits import Culprit
from cudamem.holders.finder import GraphHolder, GraphHolders, Holder, Holders
from cudamem.holders.unaccounted import Unaccounted
from cudamem.ledger.device import DeviceLedger, Explanation, LedgerLine
from cudamem.ledger.nvml import DeviceMemory, GpuProcess, NvmlDevice, NvmlStatus
from cudamem.ledger.oom import OomReport, StrandedCache
from cudamem.ledger.reclaim import DeviceRelease, ReleaseResult
from cudamem.ledger.status import MachineStatus
from cudamem.run.runner import RunReport
from cudamem.scalars.series import LoggerStats, SeriesSummary
from cudamem.spans.history import History, SpanStats
from cudamem.spans.leftovers import LeakReport
from cudamem.spans.record import DeviceSpan, ExceptionInfo, SpanRecord

from .routes import split

MiB = 1024**2
GiB = 1024**3

#: A time.time() value (2026-12-01 10:00:00 UTC).
T0 = 1_796_119_200.0


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is UTC (reports print local time): their text is exact anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def stats(device: int = 0, allocated: int = 0, reserved: int = 0, **kw: int) -> AllocatorStats:
    """Counters of one device; the rest zero unless given."""
    return AllocatorStats.zero(device)._replace(allocated=allocated, reserved=reserved, **kw)


def device_span(
    device: int = 0,
    before: tuple[int, int] = (100 * MiB, 128 * MiB),
    after: tuple[int, int] = (356 * MiB, 640 * MiB),
    peak: int | None = 612 * MiB,
) -> DeviceSpan:
    """A span on one device: ``before``/``after`` are (allocated, reserved)."""
    return DeviceSpan(device, stats(device, *before), stats(device, *after), peak)


def span(name: str = "step", **kw: Any) -> SpanRecord:
    """A finished span on cuda:0 that kept 256 MiB, 3.2 ms long."""
    devices = kw.pop("devices", (device_span(),))
    kw.setdefault("duration", 0.0032)
    kw.setdefault("started_at", T0)
    return SpanRecord.build(name, devices, **kw)


def oom_exception() -> ExceptionInfo:
    return ExceptionInfo(
        "torch.OutOfMemoryError",
        "CUDA out of memory. Tried to allocate 2.00 GiB.\nSee the documentation.",
        True,
    )


def span_stats(name: str = "step", **kw: Any) -> SpanStats:
    values: dict[str, Any] = dict(
        name=name,
        calls=10,
        errors=0,
        mean_allocated_delta=4 * MiB,
        max_allocated_delta=8 * MiB,
        mean_reserved_delta=2 * MiB,
        max_reserved_delta=20 * MiB,
        mean_peak=300 * MiB,
        max_peak=512 * MiB,
        mean_peak_delta=100 * MiB,
        max_peak_delta=256 * MiB,
        total_allocated_delta=40 * MiB,
        mean_duration=0.0015,
        max_duration=0.004,
        measured=10,
    )
    values.update(kw)
    return SpanStats(**values)


def history(*stats_: SpanStats, spans: tuple[SpanRecord, ...] = (), dropped: int = 0) -> History:
    return History(spans=spans, stats=stats_, dropped=dropped, maxlen=1000)


def holder(path: str = "__main__.saved[0]", root_kind: str = "global", **kw: Any) -> Holder:
    """A holder of ``path`` (split into steps by ``tests.routes.split``)."""
    values: dict[str, Any] = dict(
        route=split(path, root_kind),
        root="__main__",
        via="itself",
        nbytes=4 * MiB,
        device="cuda:0",
        caller=False,
    )
    values.update(kw)
    return Holder(**values)


def holders(*items: Holder, notes: tuple[str, ...] = ()) -> Holders:
    return Holders(
        target="Tensor float32[1024, 1024] on cuda:0",
        nbytes=4 * MiB,
        device="cuda:0",
        holders=items,
        notes=notes,
        elapsed=0.25,
    )


def live_storage(nbytes: int = 4 * MiB, **kw: Any) -> LiveStorage:
    values: dict[str, Any] = dict(
        device="cuda:0",
        nbytes=nbytes,
        dtype="float32",
        shape=(1024, 1024),
        tensors=1,
        saved_by_autograd=False,
        data_ptr=0x7F00_0000_0000,
        holders=None,
    )
    values.update(kw)
    return LiveStorage(**values)


def census(*storages: LiveStorage, notes: tuple[str, ...] = ()) -> Census:
    return Census(storages=storages, notes=notes, elapsed=0.5)


def unaccounted() -> Unaccounted:
    return Unaccounted(
        device=0,
        allocated=300 * MiB,
        python=200 * MiB,
        autograd=40 * MiB,
        cublas_workspaces=32 * MiB,
        workspace_count=1,
        unknown=28 * MiB,
        method="snapshot",
        notes=("memory history was off: no allocation stacks",),
    )


def culprit(holder: str = "__main__.loss_history", **kw: Any) -> Culprit:
    values: dict[str, Any] = dict(
        holder=holder,
        tensors=10,
        storages=10,
        nbytes=40 * MiB,
        autograd_bytes=40 * MiB,
        example="__main__.loss_history[3] → grad_fn MeanBackward0 → saved self",
    )
    values.update(kw)
    return Culprit(**values)


def growth(*culprits: Culprit, **kw: Any) -> Growth:
    values: dict[str, Any] = dict(
        name="train_step",
        per_call=4 * MiB,
        calls=12,
        levels=(100 * MiB, 104 * MiB, 108 * MiB),
        culprits=culprits,
        retained=4 * MiB,
        notes=(),
    )
    values.update(kw)
    return Growth(**values)


def paths(*items: str) -> Holders | None:
    """Holders of a storage, by path (``None``: nobody asked)."""
    return holders(*(holder(p) for p in items))


def leaked(nbytes: int = 4 * MiB, holders_: tuple[str, ...] = (), **kw: Any) -> LiveStorage:
    """A storage a span left behind, held by ``holders_`` (paths)."""
    kw.setdefault("holders", paths(*holders_))
    return live_storage(nbytes, **kw)


def leak_report(*storages: LiveStorage, **kw: Any) -> LeakReport:
    values: dict[str, Any] = dict(
        span="step",
        checked="at exit",
        count=len(storages),
        nbytes=sum(s.nbytes for s in storages),
        storages=storages,
        culprits=(),
        notes=(),
    )
    values.update(kw)
    return LeakReport(**values)


def oom_report(**kw: Any) -> OomReport:
    values: dict[str, Any] = dict(
        created_at=T0,
        source="span 'train_step'",
        exception_type="torch.OutOfMemoryError",
        message="CUDA out of memory. Tried to allocate 2.00 GiB.",
        device=0,
        requested=2 * GiB,
        total=80 * GiB,
        free=1 * GiB,
        allocated=70 * GiB,
        reserved=78 * GiB,
        inactive_split=6 * GiB,
        largest_free_block=512 * MiB,
        fragmentation=0.75,
        non_pytorch=700 * MiB,
        other_processes=324 * MiB,
        stranded=(StrandedCache(stream=0x7F00, reserved=64 * MiB, segments=2),),
        storages=(
            live_storage(
                8 * GiB,
                dtype="float16",
                shape=(4, 1024, 1024, 1024),
                holders=paths("__main__.cache['kv']", "__main__.model.kv"),
                allocated_at="train.py:42 in build",
            ),
            live_storage(1 * GiB, dtype="float16", shape=(), holders=paths()),
        ),
        advice=("free the cache: del cache['kv']",),
        notes=(),
        file=None,
    )
    values.update(kw)
    return OomReport(**values)


def ledger_line(key: str, label: str, nbytes: int | None, group: str, **kw: Any) -> LedgerLine:
    values: dict[str, Any] = dict(
        key=key,
        label=label,
        nbytes=nbytes,
        basis="measured",
        source="nvml",
        frees="nothing",
        group=group,
        note="",
    )
    values.update(kw)
    return LedgerLine(**values)


def device_ledger(**kw: Any) -> DeviceLedger:
    """cuda:0 with NVML used 2 GiB: reserve 615 MiB, context 518 MiB, the rest PyTorch's."""
    lines = (
        ledger_line("driver_reserve", "driver reserve", 615 * MiB, "device", frees="the driver"),
        ledger_line("context", "CUDA context", 518 * MiB, "this process (pid 42)", frees="exit"),
        ledger_line(
            "cache_releasable",
            "cache empty_cache() returns",
            20 * MiB,
            "this process (pid 42)",
            source="allocator",
            frees="cudamem.release()",
        ),
        ledger_line(
            "allocated_live",
            "live tensors",
            None,
            "this process (pid 42)",
            source="census",
            frees="del",
            note="the census could not run",
        ),
        ledger_line("other_process", "pid 7 python", 866 * MiB, "other processes", frees="pid 7"),
        ledger_line(
            "unattributed",
            "driver memory outside every process",
            5 * MiB,
            "device",
            basis="inferred",
            frees="-",
            note="NVML used minus every other line",
        ),
    )
    values: dict[str, Any] = dict(
        device=0,
        name="NVIDIA H200",
        uuid="GPU-0000",
        pid=42,
        nvml_total=140 * GiB,
        nvml_used=2 * GiB,
        smi_used=2 * GiB - 615 * MiB,
        allocator=stats(0, 0, 20 * MiB),
        lines=lines,
        cache=None,
        notes=("one note",),
    )
    values.update(kw)
    return DeviceLedger(**values)


def nvml_ok() -> NvmlStatus:
    return NvmlStatus(True, None, driver_version="580.65")


def nvml_missing() -> NvmlStatus:
    return NvmlStatus(False, "nvidia-ml-py is not installed")


def explanation(*devices: DeviceLedger, **kw: Any) -> Explanation:
    values: dict[str, Any] = dict(devices=devices, nvml=nvml_ok(), notes=())
    values.update(kw)
    return Explanation(**values)


def cache_split(**kw: Any) -> CacheSplit:
    values: dict[str, Any] = dict(
        reserved=100 * MiB,
        live=60 * MiB,
        stranded=0,
        stranded_in_live_segments=0,
        releasable=0,
        non_releasable=0,
        streams=(),
    )
    values.update(kw)
    return CacheSplit(**values)


def private_pool(**kw: Any) -> PrivatePool:
    values: dict[str, Any] = dict(
        pool_id=(1, 0),
        kind="cuda_graph",
        graphs=2,
        held=True,
        segments=1,
        reserved=40 * MiB,
        allocated=8 * MiB,
    )
    values.update(kw)
    return PrivatePool(**values)


def device_release(**kw: Any) -> DeviceRelease:
    values: dict[str, Any] = dict(
        device=0,
        before=stats(0, 36 * MiB, 60 * MiB),
        after=stats(0, 4 * MiB, 20 * MiB),
        nvml_used_before=2 * GiB,
        nvml_used_after=2 * GiB - 40 * MiB,
        remaining=(
            live_storage(holders=holders(holder(path="__main__.kept"), holder(path="__main__.x"))),
        ),
        cublas_freed=32 * MiB,
        kept=None,
    )
    values.update(kw)
    return DeviceRelease(**values)


def release_result(*devices: DeviceRelease, **kw: Any) -> ReleaseResult:
    values: dict[str, Any] = dict(devices=devices, gc_collected=12, cublas_cleared=True, notes=())
    values.update(kw)
    return ReleaseResult(**values)


def nvml_device(**kw: Any) -> NvmlDevice:
    values: dict[str, Any] = dict(
        index=0,
        uuid="GPU-0000",
        name="NVIDIA H200",
        memory=DeviceMemory(
            total=140 * GiB, free=140 * GiB - 2 * GiB, used=2 * GiB, reserved=615 * MiB, api="v2"
        ),
        memory_reason=None,
        processes=(
            GpuProcess(7, "python", 866 * MiB, "compute"),
            GpuProcess(42, "python", 560 * MiB, "compute"),
        ),
        processes_reason=None,
        process_api="v3",
    )
    values.update(kw)
    return NvmlDevice(**values)


def machine_status(*devices: NvmlDevice, nvml: NvmlStatus | None = None) -> MachineStatus:
    return MachineStatus(nvml or nvml_ok(), devices, pid=42)


def run_report(**kw: Any) -> RunReport:
    values: dict[str, Any] = dict(
        script="train.py",
        argv=("--lr", "3"),
        exit_code=0,
        duration=2.5,
        exception=None,
        traceback=None,
        steps=10,
        peaks=((0, 512 * MiB),),
        leak_warnings=(),
        leak_names=(),
        live=None,
        ledger=None,
        oom=None,
        history=None,
        notes=(),
    )
    values.update(kw)
    return RunReport(**values)


def summary(name: str = "loss", **kw: Any) -> SeriesSummary:
    values: dict[str, Any] = dict(
        name=name,
        count=100,
        dropped=0,
        last=0.125,
        mean=0.5,
        min=0.1,
        max=2.0,
        nan=0,
        last_step=99,
    )
    values.update(kw)
    return SeriesSummary(**values)


def logger_stats(**kw: Any) -> LoggerStats:
    values: dict[str, Any] = dict(
        logged=130,
        transfers=2,
        pending=2,
        buffer_bytes={"cuda:0": 1024, "cpu": 512},
        kept=128,
        host_bytes=2048,
    )
    values.update(kw)
    return LoggerStats(**values)


def graph_holder(container: str = "__main__.loss_history", **kw: Any) -> GraphHolder:
    values: dict[str, Any] = dict(
        container=container,
        root_kind="global",
        tensors=10,
        graph_bytes=40 * MiB,
        tensor_bytes=40,
        devices=("cuda:0",),
        example="__main__.loss_history[3]",
    )
    values.update(kw)
    return GraphHolder(**values)


def graph_holders(*items: GraphHolder, notes: tuple[str, ...] = ()) -> GraphHolders:
    return GraphHolders(holders=items, tensors=sum(h.tensors for h in items), notes=notes)
