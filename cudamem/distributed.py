"""One memory report for a whole ``torch.distributed`` job, gathered on rank 0.

Every rank calls :func:`gather_report` at the same point (after a training phase, before
``destroy_process_group``). Each collects its own row — pid, host, the CUDA devices it holds a
context on, allocated/reserved/peak per device, its spans (:func:`cudamem.history`
aggregates) and how fast their level grows, the growth the leak detector found, its device
ledgers (:func:`cudamem.explain`) and NVML's list of which process holds memory on which GPU —
and rank 0 receives every row and builds a :class:`DistributedReport`:

* a table per rank, and the outlier ranks named (highest peak, highest growth per call);
* memory outside PyTorch's allocator per rank and device (NVML's figure for the process minus
  the allocator's reserved bytes, as the ledger computes it), and of it what NCCL's buffers
  probably take: that figure minus a bare CUDA context (inferred, never measured);
* the GPU map (rank ↔ PID ↔ GPU, from NVML's per-GPU process lists and each rank's own
  contexts), and for every rank that holds memory on a GPU other than its own, the usual cause
  (``torch.cuda.set_device`` missing, a tensor created on ``cuda:0``, ``barrier()`` without
  ``device_ids``): the answer to "why is there memory on GPU 0 from every rank".

The rows travel as JSON text over a gloo group of cudamem's own, created once with the
``timeout`` given (NCCL's object collectives would put the rows on a GPU, and a timed-out NCCL
collective aborts the process). Nothing here can hang a job: a rank whose collection fails
sends a row with its errors instead, and a rank that never answers shows as a row saying so
once the timeout passes. Collection (:func:`collect_rank`), analysis (:func:`build_report`,
pure) and rendering (:mod:`cudamem.render.distributed`) stay apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from . import _backend, _history, _nvml
from .device import LedgerLine
from .render.text import format_bytes
from .stats import device_name

__all__ = [
    "CONTEXT_ESTIMATE",
    "DistributedReport",
    "GpuHolding",
    "HostGpu",
    "Outlier",
    "RankDevice",
    "RankGrowth",
    "RankReport",
    "RankSpan",
    "StrayMemory",
    "build_report",
    "collect_rank",
    "gather_report",
]

MiB = 1024**2

#: A bare CUDA context with lazy module loading (PyTorch's default): 518 MiB on an H200 with
#: CUDA 13 after the first tensor. Kernels loaded later (cuBLAS, cuDNN, NCCL's own) grow it:
#: 744 MiB after a training step with cuBLAS. NCCL's share is inferred against this figure.
CONTEXT_ESTIMATE = 518 * MiB
#: The same with ``CUDA_MODULE_LOADING=EAGER`` (every kernel loaded up front).
CONTEXT_ESTIMATE_EAGER = 1250 * MiB

#: Spans sent per rank (those that grow fastest, then the most called); bounds the row.
MAX_SPANS = 50
#: Exit levels of a span name the growth rate is computed from (the most recent).
GROWTH_WINDOW = 16
#: Leak findings sent per rank (the most recent).
MAX_GROWTH = 10
#: Ledger lines sent per device.
MAX_LINES = 40


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class RankSpan:
    """One span name of one rank: its aggregates and how fast its level grows."""

    name: str
    calls: int
    mean_allocated_delta: float
    max_peak: int | None
    #: Allocated bytes (summed over devices) at the exit of the last kept call.
    level: int | None
    #: Robust slope (Theil–Sen) of the exit levels of the last kept calls, bytes per call;
    #: ``None`` with fewer than three kept calls.
    growth_per_call: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "name": self.name,
            "calls": self.calls,
            "mean_allocated_delta": self.mean_allocated_delta,
            "max_peak": self.max_peak,
            "level": self.level,
            "growth_per_call": self.growth_per_call,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankSpan:
        """Rebuild from :meth:`to_dict` (rows travel between ranks as JSON)."""
        return cls(
            str(d["name"]),
            int(d["calls"]),
            float(d["mean_allocated_delta"]),
            _opt_int(d.get("max_peak")),
            _opt_int(d.get("level")),
            _opt_float(d.get("growth_per_call")),
        )


@dataclass(frozen=True, slots=True)
class RankGrowth:
    """A sustained growth the leak detector reported on one rank (a ``LeakWarning``)."""

    name: str
    per_call: int
    calls: int
    #: The culprit holders it named (``__main__.loss_history``), largest first.
    holders: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "name": self.name,
            "per_call": self.per_call,
            "calls": self.calls,
            "holders": list(self.holders),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankGrowth:
        """Rebuild from :meth:`to_dict`."""
        return cls(
            str(d["name"]),
            int(d["per_call"]),
            int(d["calls"]),
            tuple(str(h) for h in d.get("holders", ())),
            tuple(str(n) for n in d.get("notes", ())),
        )


@dataclass(frozen=True, slots=True)
class RankDevice:
    """One CUDA device a rank holds a context on.

    ``outside_allocator`` is the ledger's inferred line: NVML's figure for this process on the
    device minus the allocator's reserved bytes (context, loaded kernels, NCCL buffers, other
    libraries). ``nccl`` is that minus :data:`CONTEXT_ESTIMATE`, when the rank's process group
    uses NCCL. Every figure NVML cannot give is ``None``, never 0.
    """

    device: int
    #: NVML's index of the GPU (what nvidia-smi shows), ``None`` when not matched.
    gpu: int | None
    uuid: str | None
    allocated: int
    reserved: int
    #: The true process-wide peak of allocated bytes (:func:`cudamem.max_allocated`).
    peak: int
    #: NVML's figure for this process on this GPU.
    process_used: int | None
    outside_allocator: int | None
    nccl: int | None
    context_estimate: int
    #: The device's ledger lines (:func:`cudamem.explain`), empty when not collected.
    ledger: tuple[LedgerLine, ...] = ()
    notes: tuple[str, ...] = ()

    def line(self, key: str) -> LedgerLine | None:
        """The ledger line with ``key``, if collected."""
        for line in self.ledger:
            if line.key == key:
                return line
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "device": self.device,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
            "process_used": self.process_used,
            "outside_allocator": self.outside_allocator,
            "nccl": self.nccl,
            "context_estimate": self.context_estimate,
            "ledger": [line.to_dict() for line in self.ledger],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankDevice:
        """Rebuild from :meth:`to_dict`."""
        return cls(
            device=int(d["device"]),
            gpu=_opt_int(d.get("gpu")),
            uuid=_opt_str(d.get("uuid")),
            allocated=int(d["allocated"]),
            reserved=int(d["reserved"]),
            peak=int(d["peak"]),
            process_used=_opt_int(d.get("process_used")),
            outside_allocator=_opt_int(d.get("outside_allocator")),
            nccl=_opt_int(d.get("nccl")),
            context_estimate=int(d.get("context_estimate", CONTEXT_ESTIMATE)),
            ledger=tuple(_line_from_dict(x) for x in d.get("ledger", ())),
            notes=tuple(str(n) for n in d.get("notes", ())),
        )


@dataclass(frozen=True, slots=True)
class HostGpu:
    """One GPU of a host as NVML lists it: its processes and their memory."""

    gpu: int | None
    uuid: str | None
    name: str | None
    processes: tuple[_nvml.GpuProcess, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "gpu": self.gpu,
            "uuid": self.uuid,
            "name": self.name,
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostGpu:
        """Rebuild from :meth:`to_dict`."""
        procs = tuple(
            _nvml.GpuProcess(
                int(p["pid"]), _opt_str(p.get("name")), _opt_int(p.get("used")), str(p["kind"])
            )
            for p in d.get("processes", ())
        )
        return cls(_opt_int(d.get("gpu")), _opt_str(d.get("uuid")), _opt_str(d.get("name")), procs)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank says about its memory (one row of the report).

    ``errors`` lists what this rank could not collect (each part is collected on its own, so
    one failure leaves the rest); a rank that never answered has only ``rank`` and an error.
    """

    rank: int
    world_size: int
    pid: int | None
    host: str | None
    local_rank: int | None
    backend: str | None
    #: The CUDA device current in the thread that called :func:`gather_report`.
    current_device: int | None
    #: The device this rank is meant to use (``LOCAL_RANK``, else where it allocated most).
    own_device: int | None
    own_basis: str
    own_uuid: str | None
    devices: tuple[RankDevice, ...]
    spans: tuple[RankSpan, ...]
    growth: tuple[RankGrowth, ...]
    #: NVML's view of this host's GPUs (every process, not only this one).
    gpus: tuple[HostGpu, ...]
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every part of the row was collected."""
        return not self.errors

    @property
    def answered(self) -> bool:
        """Whether the rank sent a row at all."""
        return self.pid is not None

    @property
    def peak(self) -> int | None:
        """The highest peak over this rank's devices, ``None`` without a device."""
        return max((d.peak for d in self.devices), default=None)

    @property
    def fastest_growth(self) -> tuple[float, str] | None:
        """``(bytes per call, span name)`` of the fastest-growing span or leak finding."""
        best: tuple[float, str] | None = None
        for s in self.spans:
            if s.growth_per_call is not None and (best is None or s.growth_per_call > best[0]):
                best = (s.growth_per_call, s.name)
        for g in self.growth:
            if best is None or g.per_call > best[0]:
                best = (float(g.per_call), g.name)
        return best

    def device(self, index: int) -> RankDevice | None:
        """The row of ``cuda:index`` in this rank, if it holds a context there."""
        for d in self.devices:
            if d.device == index:
                return d
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (also the form a row travels in)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "host": self.host,
            "local_rank": self.local_rank,
            "backend": self.backend,
            "current_device": self.current_device,
            "own_device": self.own_device,
            "own_basis": self.own_basis,
            "own_uuid": self.own_uuid,
            "devices": [d.to_dict() for d in self.devices],
            "spans": [s.to_dict() for s in self.spans],
            "growth": [g.to_dict() for g in self.growth],
            "gpus": [g.to_dict() for g in self.gpus],
            "notes": list(self.notes),
            "errors": list(self.errors),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankReport:
        """Rebuild from :meth:`to_dict`; raises ``KeyError``/``TypeError``/``ValueError`` on a
        malformed row (the collector turns that into an error row)."""
        return cls(
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            pid=_opt_int(d.get("pid")),
            host=_opt_str(d.get("host")),
            local_rank=_opt_int(d.get("local_rank")),
            backend=_opt_str(d.get("backend")),
            current_device=_opt_int(d.get("current_device")),
            own_device=_opt_int(d.get("own_device")),
            own_basis=str(d.get("own_basis", "")),
            own_uuid=_opt_str(d.get("own_uuid")),
            devices=tuple(RankDevice.from_dict(x) for x in d.get("devices", ())),
            spans=tuple(RankSpan.from_dict(x) for x in d.get("spans", ())),
            growth=tuple(RankGrowth.from_dict(x) for x in d.get("growth", ())),
            gpus=tuple(HostGpu.from_dict(x) for x in d.get("gpus", ())),
            notes=tuple(str(n) for n in d.get("notes", ())),
            errors=tuple(str(e) for e in d.get("errors", ())),
        )


@dataclass(frozen=True, slots=True)
class GpuHolding:
    """One process holding memory on one GPU (NVML's list), and which rank it is."""

    host: str
    gpu: int | None
    uuid: str | None
    pid: int
    #: The rank whose pid this is; ``None`` for processes outside the job (or PIDs NVML
    #: reports from another PID namespace).
    rank: int | None
    used: int | None
    #: Whether this GPU is that rank's own device; ``None`` when unknown.
    own: bool | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "host": self.host,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "pid": self.pid,
            "rank": self.rank,
            "used": self.used,
            "own": self.own,
        }


@dataclass(frozen=True, slots=True)
class StrayMemory:
    """Memory a rank holds on a GPU other than its own, and the usual cause."""

    rank: int
    pid: int | None
    host: str | None
    #: The device index in that rank's numbering, ``None`` when only NVML saw it.
    device: int | None
    gpu: int | None
    own_device: int | None
    #: NVML's figure for the process on that GPU.
    nbytes: int | None
    allocated: int | None
    reserved: int | None
    cause: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "device": self.device,
            "gpu": self.gpu,
            "own_device": self.own_device,
            "bytes": self.nbytes,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "cause": self.cause,
        }

    def __str__(self) -> str:
        where = device_name(self.device) if self.device is not None else f"GPU {self.gpu}"
        return (
            f"rank {self.rank} (pid {self.pid}) holds {format_bytes(self.nbytes)} on {where}: "
            f"{self.cause}"
        )


@dataclass(frozen=True, slots=True)
class Outlier:
    """The rank that stands out on one measure, and by how much."""

    measure: str
    rank: int
    value: float
    #: The highest value among the other ranks (``None`` with one rank).
    runner_up: float | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "measure": self.measure,
            "rank": self.rank,
            "value": self.value,
            "runner_up": self.runner_up,
            "detail": self.detail,
        }

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.detail}"


@dataclass(frozen=True, slots=True)
class DistributedReport:
    """Every rank's memory, side by side, with the outliers and stray memory named.

    ``ranks`` has one row per rank of the group, in group order; a rank that did not answer
    within the timeout has a row whose ``errors`` say so. ``print(report)`` renders a table per
    rank; ``to_dict()`` gives JSON.
    """

    ranks: tuple[RankReport, ...]
    world_size: int
    #: The rank that gathered the rows.
    collector: int
    #: Seconds the exchange took on the collector (collection of its own row excluded).
    seconds: float
    gpus: tuple[GpuHolding, ...]
    strays: tuple[StrayMemory, ...]
    peak_outlier: Outlier | None
    growth_outlier: Outlier | None
    notes: tuple[str, ...] = ()

    def __getitem__(self, rank: int) -> RankReport:
        for row in self.ranks:
            if row.rank == rank:
                return row
        raise KeyError(f"no row for rank {rank}")

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def pids(self) -> dict[int, int | None]:
        """``rank → pid`` (``None`` for ranks that did not answer)."""
        return {r.rank: r.pid for r in self.ranks}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "world_size": self.world_size,
            "collector": self.collector,
            "seconds": self.seconds,
            "ranks": [r.to_dict() for r in self.ranks],
            "gpus": [g.to_dict() for g in self.gpus],
            "strays": [s.to_dict() for s in self.strays],
            "peak_outlier": None if self.peak_outlier is None else self.peak_outlier.to_dict(),
            "growth_outlier": (
                None if self.growth_outlier is None else self.growth_outlier.to_dict()
            ),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.distributed import render_distributed

        return render_distributed(self)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _line_from_dict(d: Mapping[str, Any]) -> LedgerLine:
    return LedgerLine(
        key=str(d["key"]),
        label=str(d["label"]),
        nbytes=_opt_int(d.get("bytes")),
        basis=str(d.get("basis", "")),
        source=str(d.get("source", "")),
        frees=str(d.get("frees", "")),
        group=str(d.get("group", "")),
        note=str(d.get("note", "")),
    )


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = "<message unavailable>"
    return f"{type(exc).__name__}: {text[:300]}"


def _failure(what: str, exc: BaseException) -> str:
    return f"{what}: {_describe(exc)}"


# --------------------------------------------------------------------------- collection


def _growth_rate(levels: Sequence[int]) -> float | None:
    from .leaks import theil_sen

    if len(levels) < 3:
        return None
    return theil_sen(list(levels[-GROWTH_WINDOW:]))


def _collect_spans() -> tuple[RankSpan, ...]:
    hist = _history.history()
    levels: dict[str, list[int]] = {}
    for record in hist.spans:
        levels.setdefault(record.name, []).append(sum(d.after.allocated for d in record.devices))
    out = []
    for s in hist.stats:
        kept = levels.get(s.name, [])
        out.append(
            RankSpan(
                name=s.name,
                calls=s.calls,
                mean_allocated_delta=s.mean_allocated_delta,
                max_peak=s.max_peak,
                level=kept[-1] if kept else None,
                growth_per_call=_growth_rate(kept),
            )
        )
    out.sort(key=lambda r: (-(r.growth_per_call or 0.0), -r.calls, r.name))
    return tuple(out[:MAX_SPANS])


def _collect_growth() -> tuple[RankGrowth, ...]:
    from .leaks import _detector as detector

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
    be: _backend.Backend, local_rank: int | None, used: Mapping[int, int], current: int | None
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
    be: _backend.Backend,
    device: int,
    *,
    ledgers: Mapping[int, Any],
    gpus: Sequence[HostGpu],
    pid: int,
    nccl_in_use: bool,
    estimate: int,
) -> RankDevice:
    from .span import max_allocated

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
    """This process's row of a :class:`DistributedReport` (no collective; never raises).

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
        errors.append(_failure("NVML process lists", exc))

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
                from .device import explain

                explanation = explain()
                ledgers = {lg.device: lg for lg in explanation.devices}
            except Exception as exc:
                errors.append(_failure("ledger (cudamem.explain)", exc))
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
                errors.append(_failure(device_name(d), exc))
        own, own_basis = _own_device(
            be, local_rank, {x.device: x.allocated for x in devices}, current
        )
        if own is not None:
            raw = be.device_uuid(own)
            own_uuid = None if raw is None else _nvml.normalize_uuid(raw)
        if used and not nccl_in_use and backend is not None:
            notes.append(f"backend {backend}: no NCCL communicator, so no NCCL buffers")
    except Exception as exc:
        errors.append(_failure("devices", exc))

    spans: tuple[RankSpan, ...] = ()
    try:
        spans = _collect_spans()
    except Exception as exc:
        errors.append(_failure("spans (cudamem.history)", exc))
    growth: tuple[RankGrowth, ...] = ()
    try:
        growth = _collect_growth()
    except Exception as exc:
        errors.append(_failure("leak findings", exc))

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


def _absent(rank: int, world_size: int, why: str) -> RankReport:
    return RankReport(
        rank=rank,
        world_size=world_size,
        pid=None,
        host=None,
        local_rank=None,
        backend=None,
        current_device=None,
        own_device=None,
        own_basis="unknown",
        own_uuid=None,
        devices=(),
        spans=(),
        growth=(),
        gpus=(),
        errors=(why,),
    )


# --------------------------------------------------------------------------- analysis


def _stray_cause(row: RankReport, device: RankDevice | None, gpu: int | None) -> str:
    own = row.own_device
    own_text = device_name(own) if own is not None else "unknown"
    where = device_name(device.device) if device is not None else f"GPU {gpu}"
    reasons: list[str] = []
    if row.current_device is not None and own is not None and row.current_device != own:
        reasons.append(
            f"its current device is {device_name(row.current_device)}, not its own "
            f"{own_text}: torch.cuda.set_device({own}) was not called, so every CUDA call that "
            f"names no device (tensors on 'cuda', barrier() without device_ids, "
            f"torch.cuda.synchronize()) goes to {device_name(row.current_device)}"
        )
    if device is None:
        reasons.append(
            "NVML lists the process there, but this rank's torch holds no context on it "
            "(another library, or a device hidden by CUDA_VISIBLE_DEVICES)"
        )
    elif device.allocated or device.reserved:
        reasons.append(
            f"it has tensors there ({format_bytes(device.allocated)} allocated, "
            f"{format_bytes(device.reserved)} reserved): a tensor created on {where} "
            "(device='cuda' or .cuda() while that device is current, torch.load without "
            "map_location, a checkpoint saved from that GPU)"
        )
    else:
        reasons.append(
            f"a CUDA context only, no tensors: a CUDA call made while {where} was current "
            "(dist.barrier() without device_ids, torch.cuda.synchronize() or mem_get_info() "
            f"with no device, a torch.cuda.stream() block for {own_text} entered on another "
            "device), or a thread that worked without set_device (threads start on cuda:0)"
        )
    return "; ".join(reasons)


def _host_gpus(rows: Sequence[RankReport]) -> dict[str, list[HostGpu]]:
    """NVML's GPUs per host: the lowest rank's view, with any pid other ranks saw added."""
    by_host: dict[str, dict[str, HostGpu]] = {}
    for row in rows:
        if row.host is None:
            continue
        table = by_host.setdefault(row.host, {})
        for g in row.gpus:
            key = g.uuid or f"index {g.gpu}"
            known = table.get(key)
            if known is None:
                table[key] = g
                continue
            pids = {p.pid for p in known.processes}
            extra = tuple(p for p in g.processes if p.pid not in pids)
            if extra:
                merged = tuple(sorted(known.processes + extra, key=lambda p: p.pid))
                table[key] = HostGpu(known.gpu, known.uuid, known.name, merged)
    return {
        host: sorted(t.values(), key=lambda g: (g.gpu is None, g.gpu or 0))
        for host, t in by_host.items()
    }


def _outlier(
    measure: str, values: Mapping[int, float], describe: Mapping[int, str]
) -> Outlier | None:
    if not values:
        return None
    ordered = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    rank, value = ordered[0]
    runner_up = ordered[1][1] if len(ordered) > 1 else None
    if runner_up is not None and runner_up >= value:
        return None  # a tie: nobody stands out
    return Outlier(measure, rank, value, runner_up, describe[rank])


def build_report(
    rows: Sequence[RankReport],
    *,
    world_size: int | None = None,
    collector: int = 0,
    seconds: float = 0.0,
    notes: Iterable[str] = (),
    min_growth: int | None = None,
) -> DistributedReport:
    """Assemble the report from every rank's row (pure: no torch, no NVML).

    ``min_growth`` is the smallest growth per call that names a growth outlier (default: the
    leak detector's ``min_bytes_per_call``, 64 KiB).
    """
    if min_growth is None:
        from .leaks import leak_settings

        min_growth = leak_settings().min_bytes_per_call
    ordered = tuple(rows)
    size = world_size if world_size is not None else len(ordered)
    out_notes = list(notes)
    answered = [r for r in ordered if r.answered]

    # -- the GPU map: NVML's processes, each matched to a rank by (host, pid)
    by_pid = {(r.host, r.pid): r for r in answered}
    holdings: list[GpuHolding] = []
    matched = False
    for host, gpus in _host_gpus(answered).items():
        for g in gpus:
            for p in g.processes:
                owner = by_pid.get((host, p.pid))
                own: bool | None = None
                if owner is not None:
                    matched = True
                    if owner.own_uuid is not None and g.uuid is not None:
                        own = owner.own_uuid == g.uuid
                holdings.append(
                    GpuHolding(
                        host,
                        g.gpu,
                        g.uuid,
                        p.pid,
                        None if owner is None else owner.rank,
                        p.used,
                        own,
                    )
                )
    if holdings and not matched and any(r.devices for r in answered):
        out_notes.append(
            "NVML lists none of the ranks' PIDs: inside containers NVML reports host PIDs, so "
            "the rank ↔ GPU map below comes from each rank's own CUDA contexts"
        )

    # -- stray memory: a rank on a GPU other than its own
    strays: list[StrayMemory] = []
    for row in answered:
        seen_uuids = set()
        for d in row.devices:
            if d.uuid is not None:
                seen_uuids.add(d.uuid)
            if row.own_device is None or d.device == row.own_device:
                continue
            strays.append(
                StrayMemory(
                    row.rank,
                    row.pid,
                    row.host,
                    d.device,
                    d.gpu,
                    row.own_device,
                    d.process_used,
                    d.allocated,
                    d.reserved,
                    _stray_cause(row, d, d.gpu),
                )
            )
        for h in holdings:
            if h.rank != row.rank or h.own is not False or h.uuid in seen_uuids:
                continue
            strays.append(
                StrayMemory(
                    row.rank,
                    row.pid,
                    row.host,
                    None,
                    h.gpu,
                    row.own_device,
                    h.used,
                    None,
                    None,
                    _stray_cause(row, None, h.gpu),
                )
            )
    stray_gpus = {s.gpu for s in strays if s.gpu is not None}
    for gpu in sorted(stray_gpus):
        ranks = sorted({s.rank for s in strays if s.gpu == gpu})
        out_notes.append(
            f"GPU {gpu} holds memory of {_plural(len(ranks), 'rank')} not its own "
            f"({', '.join(map(str, ranks))}): see the causes below"
        )

    # -- outliers
    peaks = {r.rank: float(r.peak) for r in answered if r.peak is not None}
    peak_text = {}
    for r in answered:
        if r.peak is None:
            continue
        top = max(r.devices, key=lambda d: d.peak)
        peak_text[r.rank] = f"highest peak, {format_bytes(top.peak)} on {device_name(top.device)}"
    peak_outlier = _outlier("peak", peaks, peak_text) if len(peaks) > 1 else None
    if peak_outlier is not None and peak_outlier.runner_up is not None:
        peak_outlier = Outlier(
            peak_outlier.measure,
            peak_outlier.rank,
            peak_outlier.value,
            peak_outlier.runner_up,
            f"{peak_outlier.detail} (next: {format_bytes(round(peak_outlier.runner_up))})",
        )
    growths: dict[int, float] = {}
    growth_text: dict[int, str] = {}
    for r in answered:
        fastest = r.fastest_growth
        if fastest is not None and fastest[0] >= min_growth:
            growths[r.rank] = fastest[0]
            growth_text[r.rank] = (
                f"highest growth, {format_bytes(round(fastest[0]), signed=True)} per call "
                f"of {fastest[1]!r}"
            )
    growth_outlier = _outlier("growth", growths, growth_text)
    if growth_outlier is not None:
        row = next(r for r in answered if r.rank == growth_outlier.rank)
        detail = growth_outlier.detail
        named = [h for g in row.growth for h in g.holders]
        if named:
            detail += f"; held by {named[0]}"
        runner_up = growth_outlier.runner_up
        detail += (
            f" (next: {format_bytes(round(runner_up), signed=True)} per call)"
            if runner_up is not None
            else " (no other rank grows)"
        )
        growth_outlier = Outlier("growth", row.rank, growth_outlier.value, runner_up, detail)
    elif answered:
        out_notes.append(
            f"no rank grows by {format_bytes(min_growth)} or more per call"
            if not growths
            else "the fastest-growing ranks grow alike: no outlier"
        )
    missing = [r.rank for r in ordered if not r.answered]
    if missing:
        out_notes.append(f"no row from rank(s) {', '.join(map(str, missing))}")
    return DistributedReport(
        ranks=ordered,
        world_size=size,
        collector=collector,
        seconds=seconds,
        gpus=tuple(holdings),
        strays=tuple(strays),
        peak_outlier=peak_outlier,
        growth_outlier=growth_outlier,
        notes=tuple(out_notes),
    )


# --------------------------------------------------------------------------- transport


class _SideGroups:
    """cudamem's own gloo groups, one per parent group and timeout (creating one is itself
    a collective, so it is done once and reused)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[tuple[int, float], tuple[Any, Any]] = {}

    def get(self, dist: Any, group: Any, timeout: float) -> Any:
        world = dist.group.WORLD
        parent = world if group is None else group
        key = (id(parent), timeout)
        with self.lock:
            known = self.groups.get(key)
            if known is not None and known[0] is parent:
                return known[1]
        if parent is world:
            side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        else:
            # Only the group's members call this: they alone create the side group.
            side = dist.new_group(
                ranks=dist.get_process_group_ranks(parent),
                backend="gloo",
                timeout=timedelta(seconds=timeout),
                use_local_synchronization=True,
            )
        with self.lock:
            self.groups[key] = (parent, side)
        return side

    def forget(self, dist: Any, group: Any, timeout: float) -> None:
        parent = dist.group.WORLD if group is None else group
        with self.lock:
            self.groups.pop((id(parent), timeout), None)


_side_groups = _SideGroups()


def _exchange(
    dist: Any, payload: str, group: Any, *, timeout: float, all_ranks: bool
) -> list[Any] | None:
    """Send ``payload``; return every rank's payload in group order on the collector (and
    everywhere with ``all_ranks``), ``None`` on the other ranks. Raises when the exchange
    fails (a timeout, a lost peer)."""
    side = group
    if dist.is_gloo_available():
        side = _side_groups.get(dist, group, timeout)
    size = dist.get_world_size(side)
    try:
        if all_ranks:
            out: list[Any] = [None] * size
            dist.all_gather_object(out, payload, group=side)
            return out
        dst = dist.get_global_rank(side, 0) if side is not None else 0
        gathered: list[Any] | None = [None] * size if dist.get_rank() == dst else None
        dist.gather_object(payload, gathered, dst=dst, group=side)
        return gathered
    except Exception:
        # The group is unusable after a timeout or a lost peer: make a new one next time.
        _side_groups.forget(dist, group, timeout)
        raise


def _decode(raw: Any, rank: int, size: int) -> RankReport:
    if not isinstance(raw, str):
        return _absent(rank, size, f"rank {rank} sent no row ({type(raw).__name__})")
    try:
        row = RankReport.from_dict(json.loads(raw))
    except Exception as exc:
        return _absent(rank, size, _failure(f"rank {rank} sent a row that cannot be read", exc))
    return row


def _encode(row: RankReport) -> str:
    try:
        return json.dumps(row.to_dict())
    except Exception as exc:  # a row must always travel, if only with its error
        fallback = _absent(row.rank, row.world_size, _failure("encoding the row", exc))
        return json.dumps({**fallback.to_dict(), "pid": row.pid, "host": row.host})


def gather_report(
    group: Any = None,
    *,
    timeout: float = 60.0,
    all_ranks: bool = False,
    ledger: bool = True,
    context_estimate: int | None = None,
) -> DistributedReport | None:
    """Every rank's memory, gathered on the group's first rank: a collective, call it on all.

    Each rank collects its row (:func:`collect_rank`), the rows travel as JSON over a gloo
    group cudamem creates once for ``group`` (default: the whole job) with ``timeout``
    seconds, and the first rank of the group gets the :class:`DistributedReport`; the other
    ranks get ``None`` — or, with ``all_ranks=True`` (an all-gather), every rank gets the
    report. Without ``torch.distributed`` initialised, the report has this process only.

    Never hangs and never raises from its own bookkeeping: a rank whose collection fails sends
    a row with its errors, and when a rank does not answer within ``timeout`` the collector
    returns the rows it has with that rank marked (the others return ``None``).

    Args:
        group: a ``torch.distributed`` process group (``None``: the default group).
        timeout: seconds to wait for the slowest rank (collection included).
        all_ranks: return the report on every rank, not only the collector.
        ledger: run :func:`cudamem.explain` per device (a census: slower on big heaps).
        context_estimate: bytes of a bare CUDA context, against which NCCL's share of the
            memory outside the allocator is inferred (default :data:`CONTEXT_ESTIMATE`).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(all_ranks, bool):
        raise TypeError(f"all_ranks must be a bool, not {type(all_ranks).__name__}")
    if not isinstance(ledger, bool):
        raise TypeError(f"ledger must be a bool, not {type(ledger).__name__}")
    if context_estimate is not None and (
        isinstance(context_estimate, bool)
        or not isinstance(context_estimate, int)
        or context_estimate < 0
    ):
        raise ValueError(
            f"context_estimate must be a number of bytes >= 0, got {context_estimate!r}"
        )
    dist = _dist_module()
    if dist is None or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        why = (
            "torch.distributed is not available in this build"
            if dist is None
            else "torch.distributed is not initialised"
        )
        row = collect_rank(0, 1, ledger=ledger, context_estimate=context_estimate)
        return build_report([row], world_size=1, notes=(f"{why}: this process only",))
    try:
        size = int(dist.get_world_size(group))
        rank = int(dist.get_rank())
        members = [
            int(r)
            for r in dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        ]
        backend = str(dist.get_backend(group))
    except Exception as exc:
        raise ValueError(f"group is not a usable process group: {exc}") from None
    if rank not in members:
        raise ValueError(f"this process (rank {rank}) is not a member of group")
    try:
        row = collect_rank(
            rank, size, backend=backend, ledger=ledger, context_estimate=context_estimate
        )
    except Exception as exc:  # still send a row: the others are waiting for it
        row = _absent(rank, size, _failure("collecting this rank's row", exc))
        row = dataclasses.replace(row, pid=os.getpid())
    started = time.perf_counter()
    error: str | None = None
    try:
        answers = _exchange(dist, _encode(row), group, timeout=timeout, all_ranks=all_ranks)
    except Exception as exc:
        answers, error = None, _describe(exc)
    seconds = time.perf_counter() - started
    collector = members[0]
    if answers is None and error is None:
        return None  # not the collector
    if answers is None:
        if rank != collector and not all_ranks:
            return None
        rows = [
            row if r == rank else _absent(r, size, f"no answer within {timeout:g} s ({error})")
            for r in members
        ]
        return build_report(
            rows,
            world_size=size,
            collector=rank,
            seconds=seconds,
            notes=(f"the exchange failed after {seconds:.1f} s: {error}",),
        )
    decoded = [_decode(raw, r, size) for raw, r in zip(answers, members, strict=True)]
    return build_report(decoded, world_size=size, collector=rank, seconds=seconds)


def _dist_module() -> Any:
    try:
        import torch.distributed as dist
    except Exception:
        return None
    try:
        return dist if dist.is_available() else None
    except Exception:
        return None
