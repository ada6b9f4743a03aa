"""The lines of one device's ledger: nvidia-smi's used memory split into what holds it (the CUDA
context, other processes, the allocator's cache by pool and by what ``empty_cache()`` would
return, allocated memory by what it is), each line with what frees it. ``build_ledger``
assembles them from plain inputs (no device needed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..allocator.cache_split import CacheSplit, PrivatePool
from ..allocator.stats import AllocatorStats, device_name
from ..base.format import format_bytes, plural
from . import nvml as _nvml
from .device import (
    _POOL_LABELS,
    CONTEXT_SUSPICIOUS,
    FREES,
    AllocatedSplit,
    DeviceLedger,
    LedgerLine,
)
from .free_space import Fragmentation

__all__ = ["build_ledger", "expandable_segments_configured"]


def _line(
    key: str,
    label: str,
    nbytes: int | None,
    basis: str,
    source: str,
    group: str,
    note: str = "",
    frees_key: str | None = None,
) -> LedgerLine:
    return LedgerLine(key, label, nbytes, basis, source, FREES[frees_key or key], group, note)


@dataclass(frozen=True, slots=True)
class _Presence:
    """Who is on the device according to NVML, and whether our own figure is known."""

    used: int | None
    reserve: int | None
    reserve_basis: str
    reserve_note: str
    own: int | None
    others: tuple[_nvml.GpuProcess, ...]
    procs: tuple[_nvml.GpuProcess, ...] | None
    separable: bool
    own_reason: str


def _presence(
    nvml: _nvml.NvmlDevice | None, pid: int, has_context: bool, notes: list[str]
) -> _Presence:
    memory = None if nvml is None else nvml.memory
    procs = None if nvml is None else nvml.processes
    own: int | None = None
    own_reason = ""
    others: tuple[_nvml.GpuProcess, ...] = ()
    separable = False  # whether this process's NVML figure is told apart from the others'
    if nvml is not None and procs is None:
        own_reason = f"process list unavailable: {nvml.processes_reason}"
    elif procs is not None:
        mine = [p for p in procs if p.pid == pid]
        others = tuple(p for p in procs if p.pid != pid)
        if mine:
            separable = True
            own = mine[0].used
            if own is None:
                own_reason = "NVML reports no per-process memory here (WDDM, MIG or privileges)"
        elif not has_context:
            separable = True
            own = 0  # no context here and absent from NVML's list: nothing of ours
        else:
            own_reason = (
                f"pid {pid} is not among the {plural(len(procs), 'process', 'processes')} "
                "NVML lists for this "
                "device: inside a container NVML reports host PIDs (another PID namespace), "
                "so per-process figures cannot be matched; device-level figures shown"
            )
    if own_reason:
        notes.append(own_reason)
    # Without our own figure, listing the others beside an inferred remainder would count
    # them twice: everything NVML counts then goes into one device-level line.
    separable = separable and own is not None
    reserve = None if memory is None else memory.reserved
    reserve_basis, reserve_note = "measured", ""
    if memory is not None and reserve is None:
        known = [p.used for p in (procs or ())]
        if separable and all(u is not None for u in known):
            reserve = memory.used - sum(u for u in known if u is not None)
            reserve_basis = "inferred"
            reserve_note = "NVML v1 only: used minus every process's memory"
        else:
            reserve_note = "needs nvmlDeviceGetMemoryInfo_v2 (driver too old)"
    elif memory is None:
        reserve_note = "NVML unavailable"
    return _Presence(
        used=None if memory is None else memory.used,
        reserve=reserve,
        reserve_basis=reserve_basis,
        reserve_note=reserve_note,
        own=own,
        others=others,
        procs=procs,
        separable=separable,
        own_reason=own_reason,
    )


def _never_allocated(stats: AllocatorStats) -> bool:
    """The allocator has made no allocation on this device (since its counters were reset)."""
    return stats.alloc_count == 0 and stats.peak_reserved == 0 and stats.reserved == 0


def _context_lines(
    device: int,
    stats: AllocatorStats,
    seen: _Presence,
    other_in_process: Sequence[tuple[str, int]],
    nvml_reason: str | None,
    this: str,
    notes: list[str],
) -> list[LedgerLine]:
    other_total = sum(n for _, n in other_in_process)
    key, label, frees_key = "context", "CUDA context and loaded kernels", "context"
    context: int | None
    if seen.separable and seen.own is not None:
        context = seen.own - stats.reserved - other_total
        note = (
            f"NVML's {format_bytes(seen.own)} for this process − allocator reserved "
            f"{format_bytes(stats.reserved)}"
            + (f" − other measured {format_bytes(other_total)}" if other_total else "")
        )
        if context > CONTEXT_SUSPICIOUS:
            notes.append(
                f"the inferred context ({format_bytes(context)}) is above "
                f"{format_bytes(CONTEXT_SUSPICIOUS)}, more than a CUDA context and its kernels "
                "usually take: other libraries (NCCL communicators, cuDNN/TensorRT, CUDA "
                "graphs, another allocator) likely hold memory outside PyTorch's cache"
            )
        if context > 0 and _never_allocated(stats):
            label = "CUDA context on a device this process never allocated on"
            frees_key = "context_unused"
            notes.append(
                f"this process never allocated memory on {device_name(device)}, yet holds a "
                f"{format_bytes(context)} CUDA context there: CUDA work ran while "
                f"{device_name(device)} was the current device (every new thread starts on "
                "device 0: a thread that never called torch.cuda.set_device, a "
                "torch.cuda.synchronize() / Stream() / mem_get_info() without a device, or a "
                "library initialising every GPU). Fix: torch.cuda.set_device(dev) at the start "
                "of each thread (or `with torch.cuda.device(dev):`), or hide the device with "
                "CUDA_VISIBLE_DEVICES"
            )
    elif (
        seen.used is not None
        and seen.reserve is not None
        and (seen.procs is not None or seen.own_reason)
    ):
        # Not separable: everything NVML counts minus what we know is ours and the reserve.
        context = seen.used - seen.reserve - stats.reserved - other_total
        key = "context_and_processes"
        label = "CUDA context, kernels and processes NVML cannot attribute"
        note = "device used − driver reserve − this process's allocator reserved"
        frees_key = "processes_unattributed"
    else:
        context = None
        note = seen.own_reason or (nvml_reason or "NVML unavailable")
    lines = [
        _line(key, label, context, "inferred", "NVML − allocator", this, note, frees_key=frees_key)
    ]
    for name, nbytes in other_in_process:
        lines.append(
            _line(
                f"other_nonpytorch:{name}",
                f"other non-PyTorch: {name}",
                nbytes,
                "measured",
                name,
                this,
                frees_key="other_nonpytorch",
            )
        )
    return lines


def _pool_lines(pools: Sequence[PrivatePool], this: str) -> list[LedgerLine]:
    """One line per kind of held private pool, with every byte of those pools."""
    lines = []
    for kind in ("cuda_graph", "shared_graph", "cudagraph_tree", "mempool"):
        group = [p for p in pools if p.held and p.kind == kind]
        if not group:
            continue
        reserved = sum(p.reserved for p in group)
        allocated = sum(p.allocated for p in group)
        graphs = [p.graphs for p in group]
        counts = plural(len(group), "pool")
        if kind != "mempool":
            counted = sum(g for g in graphs if g is not None)
            counts += (
                f", {plural(counted, 'graph')}"
                if all(g is not None for g in graphs)
                else ", graphs not searched"
            )
        in_tensors = [p.in_tensors for p in group]
        held_by = (
            f" ({format_bytes(sum(t for t in in_tensors if t is not None))} of it in tensors "
            "Python holds: the graphs' outputs and static inputs)"
            if all(t is not None for t in in_tensors)
            else ""
        )
        note = (
            f"{format_bytes(allocated)} allocated{held_by}, {format_bytes(reserved - allocated)}"
            " free that replays reuse; empty_cache() returns none of it while a graph uses "
            f"the pool; {'pool id' if len(group) == 1 else 'pool ids'} "
            + ", ".join(str(p.pool_id) for p in group)
        )
        if kind == "shared_graph":
            note += (
                "; the allocator does not say whether your graphs or torch.compile's "
                "cudagraph trees made this pool (none of torch.compile's tree managers "
                "claims it)"
            )
        if kind == "cudagraph_tree":
            note += "; one graph per pool is torch.compile's empty keep-alive graph"
        lines.append(
            _line(
                f"graph_pools:{kind}",
                f"{_POOL_LABELS[kind]} ({counts})",
                reserved,
                "measured",
                "memory_snapshot segment_pool_id",
                this,
                note,
            )
        )
    return lines


def _cache_lines(
    stats: AllocatorStats,
    cache: CacheSplit | None,
    this: str,
    expandable: bool,
    notes: list[str],
) -> tuple[list[LedgerLine], int]:
    """The cache lines and the allocated bytes they leave to the allocated lines."""
    lines: list[LedgerLine] = []
    exact = cache is not None and (cache.reserved, cache.live) == (stats.reserved, stats.allocated)
    if cache is not None and exact:
        lines.extend(_pool_lines(cache.pools, this))
        if cache.pending_free:
            lines.append(
                _line(
                    "cache_pending_free",
                    "PyTorch cache awaiting stream events (record_stream)",
                    cache.pending_free,
                    "measured",
                    "memory_snapshot active_pending_free",
                    this,
                    f"freed by the program but used on another stream (record_stream): "
                    f"counted as free, not reusable until that stream's work is done; "
                    f"empty_cache() then returns {format_bytes(cache.pending_releasable)} "
                    "of it",
                )
            )
        idle = [s for s in cache.streams if s.stranded]
        stranded_note = ""
        if idle:
            stranded_note = f"{plural(len(idle), 'stream')} with cached blocks and no live tensor"
            if cache.stranded_in_live_segments:
                stranded_note += (
                    f"; {format_bytes(cache.stranded_in_live_segments)} of it shares segments "
                    "with live blocks (cuBLAS workspaces?): release(clear_cublas=True) frees "
                    "those"
                )
            if cache.stranded_releasable != cache.stranded:
                stranded_note += (
                    f"; empty_cache() returns {format_bytes(cache.stranded_releasable)} now"
                )
        lines.append(
            _line(
                "cache_stranded",
                "PyTorch cache stranded on idle streams",
                cache.stranded,
                "measured",
                "memory_snapshot",
                this,
                stranded_note,
            )
        )
        if cache.expandable:
            rel_note = "whole free pages of expandable segments and whole free segments"
            parts = []
            if cache.partial_pages:
                parts.append(
                    f"{format_bytes(cache.partial_pages)} in pages that also hold part of a "
                    "live block (pages are unmapped whole)"
                )
            if cache.in_live_segments:
                parts.append(
                    f"{format_bytes(cache.in_live_segments)} inside ordinary segments that "
                    "still hold live blocks"
                )
            non_note = "; ".join(parts) or "nothing stays mapped"
        else:
            rel_note = "whole free segments"
            non_note = "free blocks inside segments that still hold live blocks"
        lines.append(
            _line(
                "cache_releasable",
                "PyTorch cache, releasable",
                cache.releasable,
                "measured",
                "memory_snapshot",
                this,
                rel_note,
            )
        )
        lines.append(
            _line(
                "cache_non_releasable",
                "PyTorch cache, not releasable",
                cache.non_releasable,
                "measured",
                "memory_snapshot",
                this,
                non_note,
            )
        )
        if cache.expandable:
            notes.append(
                "expandable segments are on: empty_cache() unmaps every page (20 MiB in the "
                "large pool, 2 MiB in the small) that lies wholly in free memory; the "
                "releasable line is exactly that"
            )
        return lines, stats.allocated - cache.pools_allocated

    # No snapshot, or one that disagrees with the counters: the counters alone.
    cached = stats.reserved - stats.allocated
    pending = max(0, stats.active - stats.allocated)  # freed, awaiting stream events
    reason = (
        "memory_snapshot unavailable"
        if cache is None
        else "snapshot and counters disagree (memory changed while reading)"
    )
    if pending:
        lines.append(
            _line(
                "cache_pending_free",
                "PyTorch cache awaiting stream events (record_stream)",
                pending,
                "measured",
                "allocator counters: active − allocated",
                this,
                "freed by the program but used on another stream (record_stream)",
            )
        )
    if expandable:
        # inactive_split excludes expandable segments: the counters cannot tell releasable
        # pages from partial ones.
        lines.append(
            _line(
                "cache",
                "PyTorch cache (expandable segments; not split)",
                cached - pending,
                "measured",
                "allocator counters",
                this,
                f"{reason}: without it, the counters cannot tell which pages are wholly free",
            )
        )
        return lines, stats.allocated
    non_rel = stats.inactive_split
    lines.append(
        _line(
            "cache_stranded",
            "PyTorch cache stranded on idle streams",
            0 if cached == 0 else None,  # no cache at all: nothing can be stranded
            "measured",
            "memory_snapshot",
            this,
            reason,
        )
    )
    lines.append(
        _line(
            "cache_releasable",
            "PyTorch cache, releasable",
            cached - non_rel - pending,
            "measured",
            "allocator counters",
            this,
            "whole free segments",
        )
    )
    lines.append(
        _line(
            "cache_non_releasable",
            "PyTorch cache, not releasable",
            non_rel,
            "measured",
            "allocator counters",
            this,
            "free blocks inside segments that still hold live blocks",
        )
    )
    return lines, stats.allocated


def _allocated_lines(
    total: int, allocated: AllocatedSplit | None, this: str, graph_bytes: int
) -> list[LedgerLine]:
    if allocated is not None and allocated.total == total:
        cublas_note = ""
        if allocated.workspace_count:
            cublas_note = (
                plural(allocated.workspace_count, "workspace")
                + ", one per cuBLAS handle and stream"
                + (
                    f", on {plural(allocated.workspace_streams, 'stream')}"
                    if allocated.workspace_streams
                    else ""
                )
                + ": a new torch.cuda.Stream (or thread) per run adds one each run"
            )
        parts = (
            ("allocated_live", "allocated: live tensors", allocated.live_tensors, ""),
            (
                "allocated_autograd",
                "allocated: autograd saved tensors",
                allocated.autograd_saved,
                "",
            ),
            (
                "allocated_cublas",
                "allocated: cuBLAS workspaces",
                allocated.cublas_workspaces,
                cublas_note,
            ),
            ("allocated_unaccounted", "allocated: no tensor found", allocated.unaccounted, ""),
        )
        return [
            _line(key, label, nbytes, "measured", "allocator + census", this, note)
            for key, label, nbytes, note in parts
        ]
    note = (
        "census unavailable: not split into tensors, saved tensors and workspaces"
        if allocated is None
        else "census and counters disagree (memory changed while reading): not split"
    )
    if graph_bytes:
        note += f"; the CUDA graph pools' {format_bytes(graph_bytes)} are on their own lines"
    return [
        _line(
            "allocated",
            "PyTorch allocated",
            total,
            "measured",
            "allocator counters",
            this,
            note,
        )
    ]


def build_ledger(
    device: int,
    *,
    stats: AllocatorStats,
    nvml: _nvml.NvmlDevice | None,
    pid: int,
    has_context: bool = True,
    cache: CacheSplit | None = None,
    allocated: AllocatedSplit | None = None,
    other_in_process: Sequence[tuple[str, int]] = (),
    nvml_reason: str | None = None,
    expandable_segments: bool = False,
    fragmentation: Fragmentation | None = None,
) -> DeviceLedger:
    """Assemble one device's ledger from figures already read (pure; no torch, no NVML).

    Args:
        device: the CUDA device index.
        stats: the allocator's counters.
        nvml: the NVML reading (``None`` when NVML is unavailable, with ``nvml_reason``).
        pid: this process's id, to find it among NVML's processes.
        has_context: whether this process has a CUDA context on the device.
        cache: the snapshot's cache split; used only when it agrees with ``stats``.
        allocated: the census split of the allocated bytes outside the held private pools
            (``stats.allocated - cache.pools_allocated``).
        other_in_process: measured non-PyTorch memory of this process as ``(name, bytes)``.
        nvml_reason: why NVML gave no reading.
        expandable_segments: whether ``expandable_segments:True`` is configured (only used
            without a snapshot: the counters cannot split that cache).
        fragmentation: the cache's fragmentation, carried beside the lines.
    """
    notes: list[str] = []
    this = f"this process (pid {pid})"
    memory = None if nvml is None else nvml.memory
    if nvml is None:
        notes.append(f"NVML: {nvml_reason or 'unavailable'}; only PyTorch's own figures shown")
    elif memory is None:
        notes.append(f"device memory: {nvml.memory_reason}")
    if nvml is not None:
        notes.extend(nvml.notes)
    seen = _presence(nvml, pid, has_context, notes)

    lines: list[LedgerLine] = [
        _line(
            "driver_reserve",
            "driver reserve",
            seen.reserve,
            seen.reserve_basis,
            "NVML v2 reserved" if seen.reserve_basis == "measured" else "NVML",
            "device",
            seen.reserve_note,
        )
    ]
    lines.extend(_context_lines(device, stats, seen, other_in_process, nvml_reason, this, notes))
    cache_lines, rest = _cache_lines(stats, cache, this, expandable_segments, notes)
    lines.extend(cache_lines)
    lines.extend(_allocated_lines(rest, allocated, this, stats.allocated - rest))

    # -- other processes
    if seen.separable:
        for p in seen.others:
            lines.append(
                _line(
                    f"process:{p.pid}",
                    f"pid {p.pid} {p.name or '(name not visible)'}",
                    p.used,
                    "measured",
                    "NVML",
                    "other processes",
                    "" if p.used is not None else "NVML reports no per-process memory",
                    frees_key="other_process",
                )
            )
    elif seen.procs:
        listed = ", ".join(
            f"{p.pid} ({format_bytes(p.used) if p.used is not None else 'n/a'})" for p in seen.procs
        )
        notes.append(f"NVML lists host {'pid' if len(seen.procs) == 1 else 'pids'}: {listed}")

    # -- the difference
    known = [line.nbytes for line in lines]
    if (
        seen.separable
        and seen.used is not None
        and seen.reserve_basis == "measured"
        and all(n is not None for n in known)
    ):
        diff = seen.used - sum(n for n in known if n is not None)
        lines.append(
            _line(
                "unattributed",
                "driver memory outside every process",
                diff,
                "inferred",
                "NVML − lines",
                "device",
                "NVML's used minus every line above",
            )
        )

    return DeviceLedger(
        device=device,
        name=None if nvml is None else nvml.name,
        uuid=None if nvml is None else nvml.uuid,
        pid=pid,
        nvml_total=None if memory is None else memory.total,
        nvml_used=seen.used,
        smi_used=None if memory is None else memory.used_excluding_reserve,
        allocator=stats,
        lines=tuple(lines),
        cache=cache,
        notes=tuple(notes),
        fragmentation=fragmentation,
    )


def expandable_segments_configured() -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` turn expandable segments on
    (read at CUDA initialisation; the snapshot's ``is_expandable`` is the truth per segment)."""
    conf = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()
