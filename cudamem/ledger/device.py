"""The device ledger: why nvidia-smi shows more than your tensors.

``explain`` reconciles NVML's ``used`` figure for a device with what PyTorch knows, as
ledger lines that add up to it::

    NVML used (total − free) = driver reserve
                             + this process: CUDA context and loaded kernels   (inferred)
                                           + other non-PyTorch memory           (measured probes)
                                           + CUDA graph private pools           (snapshot)
                                           + PyTorch cache: awaiting stream events,
                                             stranded on idle streams,
                                             releasable, non-releasable        (allocator, snapshot)
                                           + allocated: live tensors, autograd saved tensors,
                                             cuBLAS workspaces, unaccounted    (allocator, census)
                             + other processes                                  (NVML)
                             + driver memory outside every process (the difference)

Measured lines come straight from NVML or the allocator; the context line is *inferred*: this
process's NVML figure minus the allocator's reserved bytes minus other measured non-PyTorch
memory. When NVML cannot give a figure (no driver, containers, MIG, WDDM, permissions) the line
is ``None`` with a reason, never 0.

The cache lines follow the allocator's own rules for ``empty_cache()`` (see
``cudamem.allocator.snapshot``), expandable segments included: "releasable" is what
``empty_cache()`` would return now, to the byte.

Each ledger carries the cache's fragmentation beside its lines (``cudamem.fragmentation``:
where the free bytes sit per pool, the peaks, the last OOM judged), read from the same
snapshot; ``fragmentation()`` gives it alone.

``build_ledger`` is the pure arithmetic, fed by recorded figures in tests;
``machine_status`` is the whole machine as NVML sees it (``cudamem status``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ..allocator import backend as _backend
from ..allocator.cache_split import CacheSplit, PrivatePool, split_cache, workspace_streams
from ..allocator.device_arg import DeviceLike, resolve_device
from ..allocator.snapshot import has_private_pools, segment_pool_id
from ..allocator.stats import AllocatorStats, device_name
from ..base.args import check_bool
from ..base.format import format_bytes, plural
from ..base.present import Presented, PresentedHtml
from ..holders import census
from ..host import ledger as host_ledger
from ..host.ledger import HostLedger, ProcessTree
from . import nvml as _nvml
from .free_space import Fragmentation, OomFacts, analyze
from .oom import last_event, own_ooms, parse_oom_message

__all__ = [
    "AllocatedSplit",
    "DeviceLedger",
    "Explanation",
    "LedgerLine",
    "MachineStatus",
    "StatusLine",
    "build_ledger",
    "expandable_segments_configured",
    "explain",
    "fragmentation",
    "machine_status",
]

MiB = 1024**2

#: A CUDA context with lazy module loading is ~0.5–0.6 GiB (H200, CUDA 13); above this the
#: inferred line almost surely holds other libraries' memory too.
CONTEXT_SUSPICIOUS = 1536 * MiB

# What frees each line: the sentence users need most.
FREES = {
    "driver_reserve": "nothing: the driver keeps it while the GPU is up (nvidia-smi hides it)",
    "context": "only the process exiting (one context per device this process touched)",
    "context_unused": (
        "only the process exiting; to avoid it, set the device in every thread "
        "(torch.cuda.set_device(dev) before any CUDA call) so no work lands on this device"
    ),
    "other_nonpytorch": "the library that allocated it (e.g. its memory pool's free call)",
    "graph_pools:cuda_graph": (
        "only deleting the graph and its outputs (del g, outputs), then empty_cache()"
    ),
    "graph_pools:shared_graph": (
        "only deleting every graph sharing the pool and their outputs (torch.compile's: "
        "torch._dynamo.reset()), then empty_cache()"
    ),
    "graph_pools:cudagraph_tree": (
        "deleting the compiled function and its outputs, or torch._dynamo.reset(), then "
        "empty_cache()"
    ),
    "graph_pools:mempool": "deleting the torch.cuda.MemPool and the tensors allocated in it",
    "cache_pending_free": (
        "the streams passed to record_stream() finishing their work; empty_cache() waits "
        "for them, then returns what is free"
    ),
    "cache_stranded": (
        "cudamem.release() / torch.cuda.empty_cache(); reuse one stream instead of a new "
        "torch.cuda.Stream per run"
    ),
    "cache_releasable": "cudamem.release() / torch.cuda.empty_cache()",
    "cache_non_releasable": (
        "freeing the live blocks that share their segments, then empty_cache()"
    ),
    "cache": "cudamem.release() / torch.cuda.empty_cache() (the part not next to live blocks)",
    "allocated": "dropping every reference to the tensors (cudamem.release() names holders)",
    "allocated_live": "dropping every reference (cudamem.who_holds(t) names them)",
    "allocated_autograd": "backward(), or dropping the loss/outputs that hold the graph",
    "allocated_cublas": "cudamem.release(clear_cublas=True); empty_cache() never frees them",
    "allocated_unaccounted": (
        "unknown: tensors held outside Python (C++ extensions, saved tensors without a "
        "Python object), allocator rounding"
    ),
    "other_process": "that process exiting or freeing its memory",
    "processes_unattributed": "the processes NVML lists; which one is this is unknown",
    "unattributed": (
        "nothing: driver memory NVML counts in used but lists under no process: a few MiB; "
        "more means processes NVML cannot list"
    ),
}

_POOL_LABELS = {
    "cuda_graph": "CUDA graph private pools",
    "shared_graph": "CUDA graph pools from graph_pool_handle()",
    "cudagraph_tree": "torch.compile cudagraph pools",
    "mempool": "torch.cuda.MemPool pools",
}


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class LedgerLine(Presented):
    """One line of a device ledger. ``nbytes`` is ``None`` when it cannot be known, and
    ``note`` says why; ``basis`` is ``'measured'`` or ``'inferred'``."""

    key: str
    label: str
    nbytes: int | None
    basis: str
    source: str
    frees: str
    group: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class AllocatedSplit:
    """The allocator's ``allocated`` bytes of one device (outside the private pools the ledger
    reports apart), split by the census."""

    live_tensors: int
    autograd_saved: int
    cublas_workspaces: int
    unaccounted: int
    #: cuBLAS/cuBLASLt workspaces found (one per handle and stream).
    workspace_count: int = 0
    #: Distinct streams those workspaces belong to (``0`` when unknown).
    workspace_streams: int = 0

    @property
    def total(self) -> int:
        """Sum of the parts (equals the allocated bytes it was split from)."""
        return self.live_tensors + self.autograd_saved + self.cublas_workspaces + self.unaccounted


@dataclass(frozen=True, slots=True)
class DeviceLedger(PresentedHtml):
    """Where one device's memory went, as lines that add up to NVML's ``used``.

    ``nvml_used`` is ``total - free`` (driver reserve included); ``smi_used`` is what
    nvidia-smi shows on recent drivers (reserve excluded), ``None`` when unknown.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("accounted",)

    device: int
    name: str | None
    uuid: str | None
    pid: int
    nvml_total: int | None
    nvml_used: int | None
    smi_used: int | None
    allocator: AllocatorStats
    lines: tuple[LedgerLine, ...]
    cache: CacheSplit | None
    notes: tuple[str, ...] = ()
    #: Where the cache's free bytes sit, the peaks, the last OOM judged (no line of the sum).
    fragmentation: Fragmentation | None = None

    @property
    def accounted(self) -> int:
        """Sum of every line with a known size (the ``unattributed`` line included)."""
        return sum(line.nbytes for line in self.lines if line.nbytes is not None)

    @property
    def unattributed(self) -> int | None:
        """NVML's used minus the other lines; ``None`` when some line is unknown."""
        for line in self.lines:
            if line.key == "unattributed":
                return line.nbytes
        return None

    def line(self, key: str) -> LedgerLine | None:
        """The line with ``key`` (``'context'``, ``'cache_releasable'``, …), if present."""
        for line in self.lines:
            if line.key == key:
                return line
        return None

    def lines_of(self, prefix: str) -> tuple[LedgerLine, ...]:
        """Every line whose key starts with ``prefix`` (``'graph_pools'``, ``'cache'``)."""
        return tuple(line for line in self.lines if line.key.startswith(prefix))


@dataclass(frozen=True, slots=True)
class Explanation(PresentedHtml):
    """The result of ``explain``: one ledger per device, and NVML's status."""

    devices: tuple[DeviceLedger, ...]
    nvml: _nvml.NvmlStatus
    notes: tuple[str, ...] = ()
    #: The host half: RSS/PSS/USS, the pinned pool, CPU tensors, DataLoader workers
    #: (``explain(host=False)``: ``None``).
    host: HostLedger | None = None

    def __getitem__(self, device: int) -> DeviceLedger:
        for ledger in self.devices:
            if ledger.device == device:
                return ledger
        raise KeyError(f"no ledger for {device_name(device)}")


# --------------------------------------------------------------------------- the arithmetic


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


# --------------------------------------------------------------------------- collection


def expandable_segments_configured() -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` turn expandable segments on
    (read at CUDA initialisation; the snapshot's ``is_expandable`` is the truth per segment)."""
    conf = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@dataclass(frozen=True, slots=True)
class _Inputs:
    cache: CacheSplit | None
    allocated: AllocatedSplit | None
    fragmentation: Fragmentation | None = None


def _own(stats: AllocatorStats) -> AllocatorStats:
    """``stats`` with the OOMs cudamem caught itself (a plan's steps) left out."""
    return stats._replace(ooms=own_ooms(stats.device, stats.ooms))


def _ledger_inputs(device: int, stats: AllocatorStats) -> _Inputs:
    """The cache split and the census split, from one snapshot read and one heap scan.

    Held private pools (CUDA graphs) get their own lines, so the census splits only the
    allocated bytes outside them. Anything that fails leaves that part ``None``.
    """
    be = _backend.get()
    try:
        segments = be.memory_segments(device)
    except Exception:
        segments = None
    owners = None
    if segments is not None and has_private_pools(segments):
        try:
            owners = be.private_pool_owners()
        except Exception:
            owners = None
    current = be.current_stream_handle(device)
    streams = (0,) if current is None else (0, current)
    cache: CacheSplit | None = None
    frag: Fragmentation | None = None
    if segments is not None:
        # First without addresses: which segments the census must leave out.
        cache = split_cache(segments, current_streams=streams, pool_owners=owners)
        frag = analyze(
            device,
            segments,
            stats=stats,
            owners=owners,
            current_streams=streams,
            oom=_last_oom(device, None, []),
            expandable_configured=expandable_segments_configured(),
        )
    held = {p.pool_id for p in cache.held_pools} if cache is not None else set()
    outside = None if segments is None else [s for s in segments if segment_pool_id(s) not in held]
    total = stats.allocated - (cache.pools_allocated if cache is not None else 0)
    try:
        u, addresses = census.ledger_view(device, segments=outside, allocated=total)
    except Exception:
        return _Inputs(cache, None, frag)
    if segments is not None:
        cache = split_cache(
            segments, current_streams=streams, tensor_addresses=addresses, pool_owners=owners
        )
    if int(u.allocated) != total:
        return _Inputs(cache, None, frag)
    ws_streams = 0
    if u.cublas_workspaces and outside is not None:
        sizes = be.cublas_workspace_sizes(device)
        ws_streams = len(workspace_streams(outside, sizes, addresses))
    split = AllocatedSplit(
        live_tensors=int(u.python),
        autograd_saved=int(u.autograd),
        cublas_workspaces=int(u.cublas_workspaces),
        unaccounted=int(u.unknown),
        workspace_count=int(u.workspace_count),
        workspace_streams=ws_streams,
    )
    return _Inputs(cache, split, frag)


def _other_in_process(device: int) -> list[tuple[str, int]]:
    """Non-PyTorch GPU memory of this process that can be measured without side effects."""
    out: list[tuple[str, int]] = []
    cupy = sys.modules.get("cupy")  # only if the user imported it; never import it here
    if cupy is not None:
        try:
            if int(cupy.cuda.runtime.getDevice()) == device:
                out.append(("CuPy memory pool", int(cupy.get_default_memory_pool().total_bytes())))
        except Exception:
            pass
    return out


def _process_notes() -> list[str]:
    notes = []
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        notes.append(
            "CUDA_MODULE_LOADING=EAGER: every kernel is loaded up front, so the context line "
            "is larger than with lazy loading"
        )
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            notes.append(
                f"torch.distributed is initialised (backend {dist.get_backend()}): NCCL "
                "buffers (each communicator's) are outside the allocator and show in "
                "the context line"
            )
    except Exception:
        pass
    return notes


def _ledger_for(device: int, status: _nvml.NvmlStatus) -> DeviceLedger:
    be = _backend.get()
    has_context = be.has_context(device)
    stats = _own(be.read(device))
    inputs = _ledger_inputs(device, stats) if has_context else _Inputs(None, None)
    reading: _nvml.NvmlDevice | None = None
    reason = status.reason
    if status.available:
        got = _nvml.query_device(device, be.device_uuid(device))
        if isinstance(got, _nvml.NvmlDevice):
            reading = got
        else:
            reason = got.reason
    ledger = build_ledger(
        device,
        stats=stats,
        nvml=reading,
        pid=os.getpid(),
        has_context=has_context,
        cache=inputs.cache,
        allocated=inputs.allocated,
        other_in_process=_other_in_process(device) if has_context else (),
        nvml_reason=reason,
        expandable_segments=expandable_segments_configured(),
        fragmentation=inputs.fragmentation,
    )
    if not has_context:
        extra = (
            f"this process has no CUDA context on {device_name(device)}: it uses nothing "
            "there (cudamem did not create one)",
        )
        ledger = dataclasses.replace(ledger, notes=ledger.notes + extra)
    return ledger


def explain(device: DeviceLike | None = None, *, host: bool = True) -> Explanation:
    """Reconcile nvidia-smi with PyTorch for each device this process uses (or ``device``).

    Args:
        device: one CUDA device to explain; by default every device this process has a
            CUDA context on.
        host: add the host section (``Explanation.host``: this process's RSS/PSS/USS, the
            pinned pool, CPU tensors with their largest holders, DataLoader workers).

    Returns:
        An ``Explanation``; ``print()`` it for a table, ``render.json.to_json()`` it for
        JSON. Each ledger's lines add up to NVML's ``used`` and say what frees them.

    Creates no CUDA context, synchronizes nothing and never turns allocator history
    recording on; with no driver or no GPU it explains that in one line instead of raising.
    """
    check_bool("host", host)
    be = _backend.get()
    notes: list[str] = []
    status = _nvml.status()
    if device is not None and be.device_count() == 0:
        # No GPU, no driver or a CPU build of torch: one clear line, not an exception.
        import torch

        if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
            resolve_device(device)  # the argument's TypeError, not a device-count message
        reason = "a CPU build of torch" if torch.version.cuda is None else "no GPU or no driver"
        notes.append(f"{device} cannot be explained: torch sees no CUDA device ({reason})")
        return Explanation(devices=(), nvml=status, notes=tuple(notes), host=_host(host))
    devices = be.initialized_devices() if device is None else (resolve_device(device),)
    if not devices:
        notes.append(_no_context_note(be.device_count(), status))
    if status.warning:
        notes.append(status.warning)
    ledgers = []
    for d in devices:
        try:
            ledgers.append(_ledger_for(d, status))
        except Exception as exc:  # bookkeeping never raises into the caller
            notes.append(
                f"{device_name(d)}: could not build the ledger: {type(exc).__name__}: {exc}"
            )
    notes.extend(_process_notes())
    return Explanation(devices=tuple(ledgers), nvml=status, notes=tuple(notes), host=_host(host))


def _no_context_note(count: int, status: _nvml.NvmlStatus) -> str:
    """Why ``explain()`` lists no device, and what would show one (only what is true here)."""
    if count == 0:
        import torch

        reason = "a CPU build of torch" if torch.version.cuda is None else "no GPU or no driver"
        return f"torch sees no CUDA device ({reason}): nothing of this process is on a GPU"
    head = "this process has no CUDA context on any device yet: nothing of it is on a GPU"
    if status.available:
        return f"{head} (explain(device=0) shows what NVML sees on cuda:0)"
    return f"{head} (explain(device=0) shows cuda:0 as torch sees it; NVML is unavailable)"


def _host(wanted: bool) -> HostLedger | None:
    return host_ledger.measure_host() if wanted else None


# --------------------------------------------------------------------------- fragmentation


def _last_oom(device: int, exc: BaseException | None, notes: list[str]) -> OomFacts | None:
    """The OOM to judge: ``exc``'s message (the observer's exact figures where they match
    it), else the last one the observer recorded on ``device``."""
    event = last_event(device)
    ago = None if event is None else max(time.time() - event.time, 0.0)
    observed = (
        None
        if event is None
        else OomFacts(
            device,
            event.requested,
            event.total,
            event.free,
            "the allocator's OOM observer",
            ago,
        )
    )
    if exc is None:
        return observed
    parsed = parse_oom_message(str(exc))
    if parsed.device is not None and parsed.device != device:
        notes.append(f"the OOM happened on {device_name(parsed.device)}, not on this device")
        return None
    if parsed.requested is None:
        if observed is None:
            notes.append("the OOM's message states no request size and the observer saw none")
        return observed
    # The message rounds to two decimals of its unit: within 0.5 % it is the same request.
    if observed is not None and abs(observed.requested - parsed.requested) <= max(
        parsed.requested // 200, 1024
    ):
        return observed
    return OomFacts(
        device,
        parsed.requested,
        parsed.allowed or parsed.total,
        parsed.free,
        "the exception's message",
    )


def fragmentation(
    device: DeviceLike | None = None, *, oom: BaseException | None = None
) -> Fragmentation:
    """How fragmented the allocator's cache is on ``device`` (the current device by default).

    Per pool (the default pool; CUDA graphs' private pools): reserved, allocated, the free
    bytes beside live blocks that ``empty_cache()`` cannot return (stranded), the free bytes
    of wholly free segments, the largest free block; peak reserved minus peak allocated;
    and the last out-of-memory error judged: would ``expandable_segments:True`` have
    avoided it?

    Args:
        device: a CUDA device (``0``, ``'cuda:1'``, ``torch.device``).
        oom: an out-of-memory error to judge (``except torch.OutOfMemoryError as e``);
            without it, the last one the allocator's observer recorded (``on_oom()``).

    Reads one allocator snapshot; creates no CUDA context, never turns history on.

    Raises:
        ValueError: ``oom`` is not an out-of-memory error.
    """
    be = _backend.get()
    if oom is not None and not be.is_oom(oom):
        raise ValueError(
            f"oom must be an out-of-memory error, not {type(oom).__module__}."
            f"{type(oom).__qualname__}"
        )
    index = be.current_device() if device is None else resolve_device(device)
    notes: list[str] = []
    if not be.has_context(index):
        notes.append(
            f"this process has no CUDA context on {device_name(index)}: nothing is reserved there"
        )
        return Fragmentation(index, (), False, notes=tuple(notes))
    stats = _own(be.read(index))
    segments = be.memory_segments(index)
    if segments is None:
        notes.append("no allocator snapshot: the pools cannot be split")
        segments = []
    owners = None
    if has_private_pools(segments):
        try:
            owners = be.private_pool_owners()
        except Exception:
            owners = None
    current = be.current_stream_handle(index)
    facts = _last_oom(index, oom, notes)
    if facts is None and stats.ooms and oom is None:
        notes.append(
            f"the allocator counted {plural(stats.ooms, 'out-of-memory error')} on "
            f"{device_name(index)} but none was recorded: cudamem.on_oom() records them, or "
            "pass oom= the exception"
        )
    return analyze(
        index,
        segments,
        stats=stats,
        owners=owners,
        current_streams=(0,) if current is None else (0, current),
        oom=facts,
        notes=notes,
        expandable_configured=expandable_segments_configured(),
    )


# --------------------------------------------------------------------------- status


class StatusLine(NamedTuple):
    """One line of a device in ``MachineStatus``: what holds ``nbytes`` (``None``:
    NVML cannot tell) and what frees it."""

    label: str
    nbytes: int | None
    frees: str


@dataclass(frozen=True, slots=True)
class MachineStatus(Presented):
    """Every GPU of the machine as NVML sees it, all processes included (``cudamem status``).

    Per device: ``used`` = driver reserve + each process's memory + driver memory NVML
    lists under no process: other containers' processes, or rounding). Read from NVML only,
    so asking creates no CUDA context.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("device_lines",)

    nvml: _nvml.NvmlStatus
    devices: tuple[_nvml.NvmlDevice, ...]
    pid: int
    #: Host memory of the GPU processes NVML lists that run on this machine (and of
    #: ``machine_status(pids=)``), each with its children: DataLoader workers.
    host: tuple[ProcessTree, ...] = ()

    @property
    def device_lines(self) -> tuple[tuple[StatusLine, ...], ...]:
        """``lines`` of every device, in the order of ``devices``."""
        return tuple(tuple(self.lines(d)) for d in self.devices)

    def lines(self, device: _nvml.NvmlDevice) -> list[StatusLine]:
        """``(label, nbytes, frees)`` rows of one device, adding up to NVML used."""
        mem = device.memory
        if mem is None:
            return []
        rows = [StatusLine("driver reserve", mem.reserved, FREES["driver_reserve"])]
        known = mem.reserved or 0
        # This process first, then the others by size (unknown sizes last).
        procs = sorted(
            device.processes or (),
            key=lambda p: (p.pid != self.pid, -(p.used if p.used is not None else -1)),
        )
        for proc in procs:
            who = f"pid {proc.pid}" + (f" {proc.name}" if proc.name else "")
            if proc.pid == self.pid:
                who += " (this process)"
            rows.append(StatusLine(who, proc.used, FREES["other_process"]))
            known += proc.used or 0
        rows.append(
            StatusLine(
                "driver memory outside every process", mem.used - known, FREES["unattributed"]
            )
        )
        return rows


def machine_status(pids: Sequence[int] = ()) -> MachineStatus:
    """The whole machine's GPUs, every process included, from NVML, and the host memory of
    the GPU processes on this machine and of ``pids`` (RSS/PSS/USS, their children's USS and
    PSS). Never raises but for a bad ``pids``."""
    if isinstance(pids, (str, bytes)) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pids
    ):
        raise TypeError(f"pids must be a sequence of positive int process ids, not {pids!r}")
    status = _nvml.status()
    found = _nvml.query_all() if status.available else status
    devices = found if isinstance(found, tuple) else ()
    if isinstance(found, _nvml.NvmlStatus) and status.available:
        status = found
    wanted = list(dict.fromkeys([*pids, *(p.pid for d in devices for p in d.processes or ())]))
    trees = tuple(host_ledger.process_tree(p) for p in wanted)
    local = tuple(t for t in trees if t.process.rss is not None or t.process.pid in pids)
    return MachineStatus(status, devices, os.getpid(), local)
