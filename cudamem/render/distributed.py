"""Text rendering of ``cudamem.distributed.DistributedReport``: one table per rank."""

from __future__ import annotations

from collections.abc import Iterable

from ..allocator.stats import device_name
from ..base.format import format_bytes, plural
from ..base.present import renders
from ..distributed.results import (
    CONTEXT_ESTIMATE,
    CONTEXT_ESTIMATE_EAGER,
    DistributedReport,
    Outlier,
    RankReport,
    StrayMemory,
)
from .text import render_table

__all__ = ["render_distributed", "render_outlier", "render_rank", "render_stray"]


def _sum(values: Iterable[int | None]) -> int | None:
    """The sum, ``None`` when any part (or every part: no device) is unknown."""
    items = list(values)
    if not items or any(v is None for v in items):
        return None
    return sum(v for v in items if v is not None)


def _growth(row: RankReport) -> str:
    fastest = row.fastest_growth
    if fastest is None:
        return "n/a"
    return format_bytes(round(fastest[0]), signed=True)


def _status(row: RankReport) -> str:
    if not row.answered:
        return "no answer"
    if row.errors:
        return f"{plural(len(row.errors), 'error')}"
    return "ok"


def _process(row: RankReport) -> str:
    if row.pid is None:
        return "n/a"
    return f"pid {row.pid} on {row.host or 'n/a'}"


def _own(row: RankReport) -> str:
    return "n/a" if row.own_device is None else f"cuda:{row.own_device}"


def _summary(report: DistributedReport) -> str:
    rows = []
    for r in report.ranks:
        rows.append(
            [
                str(r.rank),
                _process(r),
                _own(r),
                ", ".join(f"cuda:{d.device}" for d in r.devices) or "none",
                format_bytes(_sum(d.allocated for d in r.devices)),
                format_bytes(_sum(d.reserved for d in r.devices)),
                format_bytes(r.peak),
                _growth(r),
                format_bytes(_sum(d.outside_allocator for d in r.devices)),
                format_bytes(_sum(d.nccl for d in r.devices)),
                _status(r),
            ]
        )
    headers = [
        "rank",
        "process",
        "own",
        "devices",
        "allocated",
        "reserved",
        "peak",
        "growth/call",
        "outside allocator",
        "NCCL (inferred)",
        "status",
    ]
    return render_table(headers, rows, align="rlllrrrrrrl")


def _gpu_map(report: DistributedReport) -> str:
    rows = []
    for h in report.gpus:
        if h.rank is None:
            whose, own = "not a rank", ""
        else:
            whose = str(h.rank)
            own = {True: "yes", False: "no: stray", None: "unknown"}[h.own]
        rows.append(
            [
                h.host,
                "n/a" if h.gpu is None else str(h.gpu),
                str(h.pid),
                whose,
                format_bytes(h.used),
                own,
            ]
        )
    return render_table(
        ["host", "GPU", "pid", "rank", "NVML bytes", "rank's own GPU"],
        rows,
        align="lrrrrl",
        title="GPU memory by process (NVML's per-GPU process lists)",
    )


def render_rank(row: RankReport) -> str:
    """One rank's block: its devices, its spans, the growth it reported, notes and errors."""
    where = "n/a" if row.host is None else row.host
    head = f"rank {row.rank}"
    if row.pid is not None:
        head += f" (pid {row.pid} on {where}"
        if row.own_device is not None:
            head += f", own device cuda:{row.own_device} from {row.own_basis}"
        if row.current_device is not None:
            head += f", current device cuda:{row.current_device}"
        if row.backend:
            head += f", backend {row.backend}"
        head += ")"
    lines = [head]
    if row.devices:
        table = render_table(
            [
                "device",
                "GPU",
                "allocated",
                "reserved",
                "peak",
                "NVML (process)",
                "outside allocator",
                "NCCL (inferred)",
            ],
            [
                [
                    f"cuda:{d.device}",
                    "n/a" if d.gpu is None else str(d.gpu),
                    format_bytes(d.allocated),
                    format_bytes(d.reserved),
                    format_bytes(d.peak),
                    format_bytes(d.process_used),
                    format_bytes(d.outside_allocator),
                    format_bytes(d.nccl),
                ]
                for d in row.devices
            ],
        )
        lines.extend("  " + line for line in table.splitlines())
        estimates = {d.context_estimate for d in row.devices if d.nccl is not None}
        for estimate in sorted(estimates):
            # The defaults are one card's measurement, not this one's: say so.
            whose = (
                "cudamem's default, measured on an H200 with CUDA 13, not on this card; "
                "context_estimate= sets yours"
                if estimate in (CONTEXT_ESTIMATE, CONTEXT_ESTIMATE_EAGER)
                else "context_estimate="
            )
            lines.append(
                f"  NCCL (inferred) = outside allocator − a bare CUDA context "
                f"({format_bytes(estimate)}: {whose}); kernels loaded by cuBLAS/cuDNN count "
                "in it too"
            )
    elif row.answered:
        lines.append("  no CUDA context in this process")
    if row.spans:
        table = render_table(
            ["span", "calls", "alloc Δ mean", "peak max", "level", "growth/call"],
            [
                [
                    s.name,
                    str(s.calls),
                    "n/a"
                    if s.mean_allocated_delta is None
                    else format_bytes(round(s.mean_allocated_delta), signed=True),
                    format_bytes(s.max_peak),
                    format_bytes(s.level),
                    "n/a"
                    if s.growth_per_call is None
                    else format_bytes(round(s.growth_per_call), signed=True),
                ]
                for s in row.spans
            ],
        )
        lines.extend("  " + line for line in table.splitlines())
    for g in row.growth:
        held = f", held by {g.holders[0]}" if g.holders else ""
        lines.append(
            f"  LeakWarning: {g.name} {format_bytes(g.per_call, signed=True)} per call "
            f"after {plural(g.calls, 'call')}{held}"
        )
    lines.extend(f"  note: {n}" for n in row.notes)
    lines.extend(f"  error: {e}" for e in row.errors)
    return "\n".join(lines)


@renders(DistributedReport)
def render_distributed(report: DistributedReport) -> str:
    """The whole report: a summary row per rank, the outliers, the GPU map, stray memory with
    its causes, then one block per rank."""
    hosts = {r.host for r in report.ranks if r.host is not None}
    head = (
        f"cudamem distributed report: {plural(report.world_size, 'rank')} on "
        f"{plural(len(hosts), 'host')}, gathered on rank {report.collector} "
        f"(waited {report.seconds * 1e3:.1f} ms for the rows)"
    )
    parts = [head, _summary(report)]
    for outlier in (report.peak_outlier, report.growth_outlier):
        if outlier is not None:
            parts.append(f"outlier: {outlier}")
    if report.gpus:
        parts.append("")
        parts.append(_gpu_map(report))
    if report.strays:
        parts.append("")
        parts.append("memory on a GPU that is not the rank's own:")
        parts.extend(f"  {s}" for s in report.strays)
    for row in report.ranks:
        parts.append("")
        parts.append(render_rank(row))
    if report.notes:
        parts.append("")
        parts.extend(f"note: {n}" for n in report.notes)
    return "\n".join(parts)


@renders(StrayMemory)
def render_stray(stray: StrayMemory) -> str:
    """``rank 1 (pid 4242) holds 500.0 MiB on cuda:0: <the usual cause>``."""
    where = device_name(stray.device) if stray.device is not None else f"GPU {stray.gpu}"
    return (
        f"rank {stray.rank} (pid {stray.pid}) holds {format_bytes(stray.nbytes)} on {where}: "
        f"{stray.cause}"
    )


@renders(Outlier)
def render_outlier(outlier: Outlier) -> str:
    """``rank 3: <what stands out, and by how much>``."""
    return f"rank {outlier.rank}: {outlier.detail}"
