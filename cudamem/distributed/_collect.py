"""Collection: this process's row of the report, each part on its own (no collective)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from ..allocator import backend as _backend
from ..allocator import backend_base as _backend_base
from ..allocator.stats import device_name
from ..growth._trend import theil_sen
from ..growth.detector import _detector as detector
from ..ledger import nvml as _nvml
from ..ledger.device import LedgerLine
from ..ledger.reading import explain
from ..spans import history as _history
from ..spans.span import max_allocated
from .results import (
    CONTEXT_ESTIMATE,
    CONTEXT_ESTIMATE_EAGER,
    HostGpu,
    RankDevice,
    RankGrowth,
    RankReport,
    RankSpan,
    failure,
)

__all__ = ["collect_rank"]

#: Spans sent per rank (those that grow fastest, then the most called); bounds the row.
MAX_SPANS = 50
#: Exit levels of a span name the growth rate is computed from (the most recent).
GROWTH_WINDOW = 16
#: Leak findings sent per rank (the most recent).
MAX_GROWTH = 10
#: Ledger lines sent per device.
MAX_LINES = 40


def _growth_rate(levels: Sequence[int]) -> float | None:

    if len(levels) < 3:
        return None
    return theil_sen(list(levels[-GROWTH_WINDOW:]))


def _collect_spans() -> tuple[RankSpan, ...]:
    hist = _history.history()
    levels: dict[str, list[int]] = {}
    for record in hist.spans:
        if record.devices:  # a call that measured no device has no level (not 0 B)
            levels.setdefault(record.name, []).append(
                sum(d.after.allocated for d in record.devices)
            )
    out = []
    for s in hist.stats:
        kept = levels.get(s.name, [])
        out.append(
            RankSpan(
                name=s.name,
                calls=s.calls,
                mean_allocated_delta=s.mean_allocated_delta if s.measured else None,
                max_peak=s.max_peak,
                level=kept[-1] if kept else None,
                growth_per_call=_growth_rate(kept),
            )
        )
    out.sort(key=lambda r: (-(r.growth_per_call or 0.0), -r.calls, r.name))
    return tuple(out[:MAX_SPANS])


def _collect_growth() -> tuple[RankGrowth, ...]:

    # The detector's findings: the growth each LeakWarning reported (a bounded deque).
    with detector.lock:
        found = list(detector.findings)[-MAX_GROWTH:]
    return tuple(
        RankGrowth(
            g.name,
            g.per_call,
            g.calls,
            tuple(c.holder for c in g.culprits),
            tuple(g.notes),
        )
        for g in found
    )


def _collect_gpus() -> tuple[tuple[HostGpu, ...], list[str]]:
    notes: list[str] = []
    status = _nvml.status()
    if not status.available:
        notes.append(f"NVML: {status.reason}")
        return (), notes
    found = _nvml.query_all()
    if isinstance(found, _nvml.NvmlStatus):
        notes.append(f"NVML: {found.reason}")
        return (), notes
    gpus = []
    for dev in found:
        if dev.processes is None:
            notes.append(f"GPU {dev.index}: {dev.processes_reason}")
        uuid = None if dev.uuid is None else _nvml.normalize_uuid(dev.uuid)
        gpus.append(HostGpu(dev.index, uuid, dev.name, dev.processes or ()))
    return tuple(gpus), notes


def _own_device(
    be: _backend_base.Backend, local_rank: int | None, used: Mapping[int, int], current: int | None
) -> tuple[int | None, str]:
    count = be.device_count()
    if count == 0:
        return None, "no CUDA device"
    if local_rank is not None and local_rank >= 0:
        return local_rank % count, f"LOCAL_RANK={local_rank}"
    if used:
        device = max(used, key=lambda d: (used[d], -d))
        if used[device] > 0:
            return device, "where it allocated most"
    if current is not None:
        return current, "the current device"
    return None, "unknown (no LOCAL_RANK, no CUDA context)"


def _context_estimate(given: int | None) -> int:
    if given is not None:
        return given
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        return CONTEXT_ESTIMATE_EAGER
    return CONTEXT_ESTIMATE


def _device_row(
    be: _backend_base.Backend,
    device: int,
    *,
    ledgers: Mapping[int, Any],
    gpus: Sequence[HostGpu],
    pid: int,
    nccl_in_use: bool,
    estimate: int,
) -> RankDevice:

    notes: list[str] = []
    stats = be.read(device)
    try:
        peak = max_allocated(device)
    except Exception:
        peak = stats.peak_allocated
    raw_uuid = be.device_uuid(device)
    uuid = None if raw_uuid is None else _nvml.normalize_uuid(raw_uuid)
    ledger = ledgers.get(device)
    if uuid is None and ledger is not None and ledger.uuid:
        uuid = _nvml.normalize_uuid(ledger.uuid)
    gpu: int | None = None
    process_used: int | None = None
    for g in gpus:
        if uuid is not None and g.uuid == uuid:
            gpu = g.gpu
            for p in g.processes:
                if p.pid == pid:
                    process_used = p.used
    lines: tuple[LedgerLine, ...] = ()
    outside: int | None = None
    if ledger is not None:
        lines = tuple(ledger.lines[:MAX_LINES])
        context = ledger.line("context")
        outside = None if context is None else context.nbytes
        if context is not None and context.nbytes is None and context.note:
            notes.append(f"outside the allocator: unknown ({context.note})")
    nccl: int | None = None
    if nccl_in_use and outside is not None:
        nccl = max(0, outside - estimate)
    return RankDevice(
        device=device,
        gpu=gpu,
        uuid=uuid,
        allocated=stats.allocated,
        reserved=stats.reserved,
        peak=peak,
        process_used=process_used,
        outside_allocator=outside,
        nccl=nccl,
        context_estimate=estimate,
        ledger=lines,
        notes=tuple(notes),
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        return None


def collect_rank(
    rank: int = 0,
    world_size: int = 1,
    *,
    backend: str | None = None,
    ledger: bool = True,
    context_estimate: int | None = None,
) -> RankReport:
    """This process's row of a ``DistributedReport`` (no collective; never raises).

    Each part (devices and ledgers, spans, leak findings, NVML's process lists) is collected
    on its own: a failure becomes a line of ``errors`` and the other parts stay. Creates no
    CUDA context: only devices that already have one are read.
    """
    errors: list[str] = []
    notes: list[str] = []
    pid = os.getpid()
    try:
        host: str | None = socket.gethostname()
    except Exception:
        host = None
    local_rank = _env_int("LOCAL_RANK")
    be = _backend.get()
    nccl_in_use = backend is not None and "nccl" in backend.lower()
    estimate = _context_estimate(context_estimate)

    gpus: tuple[HostGpu, ...] = ()
    try:
        gpus, gpu_notes = _collect_gpus()
        notes.extend(gpu_notes)
    except Exception as exc:
        errors.append(failure("NVML process lists", exc))

    devices: list[RankDevice] = []
    current: int | None = None
    own: int | None = None
    own_basis = "unknown"
    own_uuid: str | None = None
    try:
        used = be.initialized_devices()
        current = be.current_device() if used else None
        ledgers: dict[int, Any] = {}
        if ledger and used:
            try:
                explanation = explain(host=False)  # the rows carry the device lines only
                ledgers = {lg.device: lg for lg in explanation.devices}
            except Exception as exc:
                errors.append(failure("ledger (cudamem.explain)", exc))
        for d in used:
            try:
                devices.append(
                    _device_row(
                        be,
                        d,
                        ledgers=ledgers,
                        gpus=gpus,
                        pid=pid,
                        nccl_in_use=nccl_in_use,
                        estimate=estimate,
                    )
                )
            except Exception as exc:
                errors.append(failure(device_name(d), exc))
        own, own_basis = _own_device(
            be, local_rank, {x.device: x.allocated for x in devices}, current
        )
        if own is not None:
            raw = be.device_uuid(own)
            own_uuid = None if raw is None else _nvml.normalize_uuid(raw)
        if used and not nccl_in_use and backend is not None:
            notes.append(f"backend {backend}: no NCCL communicator, so no NCCL buffers")
    except Exception as exc:
        errors.append(failure("devices", exc))

    spans: tuple[RankSpan, ...] = ()
    try:
        spans = _collect_spans()
    except Exception as exc:
        errors.append(failure("spans (cudamem.history)", exc))
    growth: tuple[RankGrowth, ...] = ()
    try:
        growth = _collect_growth()
    except Exception as exc:
        errors.append(failure("leak findings", exc))

    return RankReport(
        rank=rank,
        world_size=world_size,
        pid=pid,
        host=host,
        local_rank=local_rank,
        backend=backend,
        current_device=current,
        own_device=own,
        own_basis=own_basis,
        own_uuid=own_uuid,
        devices=tuple(devices),
        spans=spans,
        growth=growth,
        gpus=gpus,
        notes=tuple(notes),
        errors=tuple(errors),
    )
