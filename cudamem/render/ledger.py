"""Text rendering of the device ledger (``cudamem.explain``) and of ``cudamem.release``."""

from __future__ import annotations

from ..allocator.cache_split import CacheSplit
from ..base.format import format_bytes, plural
from ..base.present import renders
from ..ledger.device import DeviceLedger, Explanation, LedgerLine
from ..ledger.nvml import NvmlStatus
from ..ledger.reclaim import DeviceRelease, ReleaseResult
from ..ledger.status import MachineStatus
from .fragmentation import fragmentation_lines, verdict_lines
from .host import render_host_ledger, render_host_release, render_process_trees
from .text import render_table

__all__ = [
    "render_explanation",
    "render_kept",
    "render_ledger",
    "render_ledger_line",
    "render_machine_status",
    "render_nvml_status",
    "render_release",
]

# Lines whose note is worth a detail row under the table (besides unknown or inferred ones).
_DETAILED = ("cache", "graph_pools", "allocated_cublas")

_GROUP_ORDER = ("device", "this process", "other processes")


def _title(ledger: DeviceLedger) -> str:
    name = f"cuda:{ledger.device}"
    if ledger.name:
        name += f" {ledger.name}"
    if ledger.nvml_used is None:
        return f"{name}: NVML used n/a"
    head = f"{name}: NVML used {format_bytes(ledger.nvml_used)}"
    if ledger.nvml_total is not None:
        head += f" of {format_bytes(ledger.nvml_total)}"
    if ledger.smi_used is not None:
        head += f" (nvidia-smi shows {format_bytes(ledger.smi_used)}: driver reserve excluded)"
    return head


@renders(LedgerLine)
def render_ledger_line(line: LedgerLine) -> str:
    """``allocated: 1.0 MiB (measured; freed by del)``."""
    return f"{line.label}: {format_bytes(line.nbytes)} ({line.basis}; freed by {line.frees})"


@renders(NvmlStatus)
def render_nvml_status(status: NvmlStatus) -> str:
    """``NVML available (driver 580.65)`` or why not, then the deprecated-package warning."""
    if status.available:
        line = f"NVML available (driver {status.driver_version or 'unknown'})"
    else:
        line = f"NVML unavailable: {status.reason}"
    return line if status.warning is None else f"{line}\n{status.warning}"


@renders(DeviceLedger)
def render_ledger(ledger: DeviceLedger) -> str:
    """One device's ledger: a line per item, grouped, with what frees each, then notes."""
    rows: list[list[str]] = []
    groups: dict[str, list[int]] = {}
    for i, line in enumerate(ledger.lines):
        key = line.group if line.group in ("device", "other processes") else "this process"
        groups.setdefault(key, []).append(i)
    for group in _GROUP_ORDER:
        members = [ledger.lines[i] for i in groups.get(group, [])]
        if not members:
            continue
        if group == "device":
            for line in members:
                rows.append([line.label, format_bytes(line.nbytes), line.basis, line.frees])
            continue
        label = members[0].group if group == "this process" else group
        sizes = [m.nbytes for m in members]
        subtotal = None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)
        rows.append([label, format_bytes(subtotal), "", ""])
        for line in members:
            rows.append(["  " + line.label, format_bytes(line.nbytes), line.basis, line.frees])
    # Keep the difference line last, after the groups, where a reader checks the sum.
    diff = [r for r in rows if r[0] == "driver memory outside every process"]
    rows = [r for r in rows if r[0] != "driver memory outside every process"] + diff
    rows.append(["total of the lines", format_bytes(ledger.accounted), "", ""])
    table = render_table(
        ["line", "bytes", "basis", "freed by"], rows, align="lrll", title=_title(ledger)
    )
    details = [
        f"  {line.label}: {line.note}"
        for line in ledger.lines
        if line.note
        and (line.nbytes is None or line.basis == "inferred" or line.key.startswith(_DETAILED))
    ]
    notes = [f"  note: {n}" for n in ledger.notes]
    f = ledger.fragmentation
    # After an out-of-memory error, its verdict right below the table: where users look.
    verdict = [] if f is None or f.verdict is None else verdict_lines(f.verdict)
    verdict = [f"  {line}" if i == 0 else f"    {line}" for i, line in enumerate(verdict)]
    frag = [] if f is None else fragmentation_lines(f, verdict=False)
    return "\n".join([table, *verdict, *details, *notes, *frag])


@renders(Explanation)
def render_explanation(explanation: Explanation) -> str:
    """Every device's ledger, then the process-wide notes."""
    parts = [render_ledger(d) for d in explanation.devices]
    if not explanation.nvml.available:
        parts.append(f"NVML unavailable: {explanation.nvml.reason}")
    parts.extend(f"note: {n}" for n in explanation.notes)
    if explanation.host is not None:
        parts.append(render_host_ledger(explanation.host))
    return "\n\n".join(parts) if parts else "nothing to explain"


def render_kept(kept: CacheSplit) -> list[str]:
    """Why the cache left after ``empty_cache()`` stayed, one reason a line."""
    out = []
    for pool in kept.held_pools:
        if not pool.free:
            continue
        graphs = "" if pool.graphs is None else f", {plural(pool.graphs, 'graph')}"
        out.append(
            f"{format_bytes(pool.reserved - pool.allocated)} free in private pool "
            f"{pool.pool_id} ({pool.description}{graphs}): only deleting its graphs (and "
            "their outputs) frees it"
        )
    if kept.partial_pages:
        out.append(
            f"{format_bytes(kept.partial_pages)} stays mapped in expandable segments: free "
            "parts of pages that also hold live blocks (whole pages are unmapped: 20 MiB in "
            "the large pool, 2 MiB in the small)"
        )
    if kept.in_live_segments:
        out.append(
            f"{format_bytes(kept.in_live_segments)} free inside segments that still hold live "
            "blocks (a segment goes back to CUDA only when all of it is free)"
        )
    if kept.stranded:
        out.append(
            f"{format_bytes(kept.stranded)} on idle streams beside live blocks (cuBLAS "
            "workspaces or tensors of those streams)"
        )
    if kept.pending_free:
        out.append(
            f"{format_bytes(kept.pending_free)} still awaiting stream events (record_stream)"
        )
    return out


def _device_release(r: DeviceRelease) -> str:
    lines = [
        f"cuda:{r.device}: freed {format_bytes(r.freed_reserved)} of cache "
        f"(allocated {format_bytes(r.freed_allocated, signed=False)} freed by gc/cuBLAS"
        + (f", {format_bytes(r.cublas_freed)} of it cuBLAS workspaces" if r.cublas_freed else "")
        + f"), still allocated {format_bytes(r.still_allocated)}, "
        f"still reserved {format_bytes(r.after.reserved)}"
    ]
    if r.nvml_freed is not None:
        lines.append(
            f"  NVML used {format_bytes(r.nvml_used_before)} → {format_bytes(r.nvml_used_after)}"
            f" ({format_bytes(-r.nvml_freed, signed=True)})"
        )
    if r.still_cached:
        head = f"  {format_bytes(r.still_cached)} stays cached"
        if r.kept is None:
            lines.append(head + " (no allocator snapshot to say why)")
        else:
            lines.append(head + ":")
            lines.extend(f"    {reason}" for reason in render_kept(r.kept))
    if r.remaining:
        rows = [
            [format_bytes(s.nbytes), s.describe(), "; ".join(s.paths[:5]) or "no holder found"]
            for s in r.remaining
        ]
        lines.append(
            render_table(
                ["bytes", "storage", "held by"], rows, align="rll", title="  largest remaining"
            )
        )
    return "\n".join(lines)


@renders(ReleaseResult)
def render_release(result: ReleaseResult) -> str:
    """What ``cudamem.release`` freed per device and who holds what is left."""
    parts = [_device_release(r) for r in result.devices]
    head = f"gc collected {plural(result.gc_collected, 'object')}; cuBLAS workspaces " + (
        "cleared" if result.cublas_cleared else "not cleared"
    )
    host = [] if result.host is None else [render_host_release(result.host)]
    return "\n".join([head, *parts, *host, *(f"note: {n}" for n in result.notes)])


@renders(MachineStatus)
def render_machine_status(status: MachineStatus) -> str:
    """``cudamem status``: one table per GPU whose lines add up to NVML's used, then the
    GPU processes' host memory."""
    gpus = _render_gpus(status)
    if not status.host:
        return gpus
    return f"{gpus}\n\n{render_process_trees(status.host)}"


def _render_gpus(status: MachineStatus) -> str:
    if not status.nvml.available:
        return f"cudamem status: {status.nvml}"
    if not status.devices:
        return "cudamem status: NVML sees no GPU on this machine"
    parts = []
    if status.nvml.warning:
        parts.append(status.nvml.warning)
    for dev in status.devices:
        mem = dev.memory
        head = f"GPU {dev.index} {dev.name or ''}".rstrip()
        if mem is None:
            parts.append(f"{head}: memory n/a ({dev.memory_reason})")
            continue
        head += (
            f": used {format_bytes(mem.used)} of {format_bytes(mem.total)}, "
            f"free {format_bytes(mem.free)}"
        )
        if mem.used_excluding_reserve is not None:
            head += f" (nvidia-smi shows {format_bytes(mem.used_excluding_reserve)})"
        rows = [[label, format_bytes(n), frees] for label, n, frees in status.lines(dev)]
        rows.append(["total (NVML used)", format_bytes(mem.used), ""])
        table = render_table(["line", "bytes", "freed by"], rows, align="lrl", title=head)
        if dev.processes is None:
            table += f"\n  processes n/a: {dev.processes_reason}"
        parts.append(table)
    return "\n\n".join(parts)
