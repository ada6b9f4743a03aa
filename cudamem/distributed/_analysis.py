"""Analysis: the report from every rank's row (pure: no torch, no NVML)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..allocator.stats import device_name
from ..base.format import format_bytes, plural
from ..growth.detector import leak_settings
from .results import (
    DistributedReport,
    GpuHolding,
    HostGpu,
    Outlier,
    RankDevice,
    RankReport,
    StrayMemory,
)

__all__ = ["build_report"]


def _stray(
    row: RankReport,
    device: RankDevice | None,
    gpu: int | None,
    used: int | None,
    levels: tuple[int | None, int | None],
) -> StrayMemory:
    """A rank's memory on a GPU not its own: a device it holds a context on, or (``device``
    ``None``) a process NVML lists there; ``levels`` is the allocator's (allocated,
    reserved) when known."""
    return StrayMemory(
        row.rank,
        row.pid,
        row.host,
        None if device is None else device.device,
        gpu,
        row.own_device,
        used,
        levels[0],
        levels[1],
        _stray_cause(row, device, gpu),
    )


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


def _gpu_map(answered: Sequence[RankReport]) -> tuple[tuple[GpuHolding, ...], list[str]]:
    """NVML's processes per GPU, each matched to a rank by (host, pid); a note when none
    matched (a container's PIDs)."""
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
    notes = []
    if holdings and not matched and any(r.devices for r in answered):
        notes.append(
            "NVML lists none of the ranks' PIDs: inside containers NVML reports host PIDs, so "
            "the rank ↔ GPU map below comes from each rank's own CUDA contexts"
        )
    return tuple(holdings), notes


def _strays(
    answered: Sequence[RankReport], holdings: Sequence[GpuHolding]
) -> tuple[tuple[StrayMemory, ...], list[str]]:
    """Stray memory: a rank on a GPU other than its own; a note per GPU holding some."""
    strays: list[StrayMemory] = []
    for row in answered:
        seen_uuids = set()
        for d in row.devices:
            if d.uuid is not None:
                seen_uuids.add(d.uuid)
            if row.own_device is None or d.device == row.own_device:
                continue
            strays.append(_stray(row, d, d.gpu, d.process_used, (d.allocated, d.reserved)))
        for h in holdings:
            if h.rank != row.rank or h.own is not False or h.uuid in seen_uuids:
                continue
            strays.append(_stray(row, None, h.gpu, h.used, (None, None)))
    notes = []
    for gpu in sorted({s.gpu for s in strays if s.gpu is not None}):
        ranks = sorted({s.rank for s in strays if s.gpu == gpu})
        notes.append(
            f"GPU {gpu} holds memory of {plural(len(ranks), 'rank')} not its own "
            f"({', '.join(map(str, ranks))}): see the causes below"
        )
    return tuple(strays), notes


def _peak_outlier(answered: Sequence[RankReport]) -> Outlier | None:
    """The rank whose peak stands out, with the runner-up's peak in its detail."""
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
    return peak_outlier


def _growth_outlier(
    answered: Sequence[RankReport], min_growth: int
) -> tuple[Outlier | None, list[str]]:
    """The rank whose growth per call stands out (at least ``min_growth``), with what holds
    it; else a note why none does."""
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
    if growth_outlier is None:
        if not answered:
            return None, []
        if all(r.fastest_growth is None for r in answered):
            return None, [
                "growth not measured: no rank's spans measured a CUDA device (n/a, not 0)"
            ]
        return None, [
            f"no rank grows by {format_bytes(min_growth)} or more per call"
            if not growths
            else "the fastest-growing ranks grow alike: no outlier"
        ]
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
    return Outlier("growth", row.rank, growth_outlier.value, runner_up, detail), []


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
        min_growth = leak_settings().min_bytes_per_call
    ordered = tuple(rows)
    answered = [r for r in ordered if r.answered]
    holdings, map_notes = _gpu_map(answered)
    strays, stray_notes = _strays(answered, holdings)
    peak_outlier = _peak_outlier(answered)
    growth_outlier, growth_notes = _growth_outlier(answered, min_growth)
    missing = [r.rank for r in ordered if not r.answered]
    missing_notes = (
        [f"no row from {'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))}"]
        if missing
        else []
    )
    return DistributedReport(
        ranks=ordered,
        world_size=world_size if world_size is not None else len(ordered),
        collector=collector,
        seconds=seconds,
        gpus=holdings,
        strays=strays,
        peak_outlier=peak_outlier,
        growth_outlier=growth_outlier,
        notes=(*notes, *map_notes, *stray_notes, *growth_notes, *missing_notes),
    )
