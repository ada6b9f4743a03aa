"""The values of a distributed report: one frozen row per rank, and the report itself.

Rows travel between ranks as JSON (``render.json.to_data`` / ``from_dict``), never as
pickled objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base.present import Presented
from ..ledger import nvml as _nvml
from ..ledger.device import LedgerLine

__all__ = [
    "CONTEXT_ESTIMATE",
    "CONTEXT_ESTIMATE_EAGER",
    "DistributedReport",
    "GpuHolding",
    "HostGpu",
    "Outlier",
    "RankDevice",
    "RankGrowth",
    "RankReport",
    "RankSpan",
    "StrayMemory",
]

MiB = 1024**2

#: A bare CUDA context with lazy module loading (PyTorch's default): 518 MiB on an H200 with
#: CUDA 13 after the first tensor. Kernels loaded later (cuBLAS, cuDNN, NCCL's own) grow it:
#: 744 MiB after a training step with cuBLAS. NCCL's share is inferred against this figure.
CONTEXT_ESTIMATE = 518 * MiB
#: The same with ``CUDA_MODULE_LOADING=EAGER`` (every kernel loaded up front).
CONTEXT_ESTIMATE_EAGER = 1250 * MiB


@dataclass(frozen=True, slots=True)
class RankSpan:
    """One span name of one rank: its aggregates and how fast its level grows."""

    name: str
    calls: int
    #: Mean allocated delta of the calls that measured a CUDA device; ``None`` when none
    #: did (CPU spans: nothing measured, shown ``n/a``).
    mean_allocated_delta: float | None
    max_peak: int | None
    #: Allocated bytes (summed over devices) at the exit of the last kept call.
    level: int | None
    #: Robust slope (Theil–Sen) of the exit levels of the last kept calls, bytes per call;
    #: ``None`` with fewer than three kept calls.
    growth_per_call: float | None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankSpan:
        """Rebuild from its JSON data (``to_data``; rows travel between ranks as JSON)."""
        return cls(
            str(d["name"]),
            int(d["calls"]),
            _opt_float(d.get("mean_allocated_delta")),
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankGrowth:
        """Rebuild from its JSON data (``to_data``)."""
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
    libraries). ``nccl`` is that minus ``CONTEXT_ESTIMATE``, when the rank's process group
    uses NCCL. Every figure NVML cannot give is ``None``, never 0.
    """

    device: int
    #: NVML's index of the GPU (what nvidia-smi shows), ``None`` when not matched.
    gpu: int | None
    uuid: str | None
    allocated: int
    reserved: int
    #: The true process-wide peak of allocated bytes (``cudamem.max_allocated``).
    peak: int
    #: NVML's figure for this process on this GPU.
    process_used: int | None
    outside_allocator: int | None
    nccl: int | None
    context_estimate: int
    #: The device's ledger lines (``cudamem.explain``), empty when not collected.
    ledger: tuple[LedgerLine, ...] = ()
    notes: tuple[str, ...] = ()

    def line(self, key: str) -> LedgerLine | None:
        """The ledger line with ``key``, if collected."""
        for line in self.ledger:
            if line.key == key:
                return line
        return None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankDevice:
        """Rebuild from its JSON data (``to_data``)."""
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostGpu:
        """Rebuild from its JSON data (``to_data``)."""
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
    #: The CUDA device current in the thread that called ``gather_report``.
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankReport:
        """Rebuild from its JSON data; raises ``KeyError``/``TypeError``/``ValueError`` on a
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


@dataclass(frozen=True, slots=True)
class StrayMemory(Presented):
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


@dataclass(frozen=True, slots=True)
class Outlier(Presented):
    """The rank that stands out on one measure, and by how much."""

    measure: str
    rank: int
    value: float
    #: The highest value among the other ranks (``None`` with one rank).
    runner_up: float | None
    detail: str


@dataclass(frozen=True, slots=True)
class DistributedReport(Presented):
    """Every rank's memory, side by side, with the outliers and stray memory named.

    ``ranks`` has one row per rank of the group, in group order; a rank that did not answer
    within the timeout has a row whose ``errors`` say so. ``print(report)`` renders a table per
    rank; ``render.json.to_json()`` gives JSON.
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
        nbytes=_opt_int(d.get("nbytes")),
        basis=str(d.get("basis", "")),
        source=str(d.get("source", "")),
        frees=str(d.get("frees", "")),
        group=str(d.get("group", "")),
        note=str(d.get("note", "")),
    )


def describe(exc: BaseException) -> str:
    """``'TypeName: message'`` (bounded), even when ``str(exc)`` itself raises."""
    try:
        text = str(exc)
    except Exception:
        text = "<message unavailable>"
    return f"{type(exc).__name__}: {text[:300]}"


def failure(what: str, exc: BaseException) -> str:
    """One ``errors`` line: what could not be collected, and why."""
    return f"{what}: {describe(exc)}"


def absent_row(rank: int, world_size: int, why: str) -> RankReport:
    """The row of a rank that sent nothing usable: its rank and why."""
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
