"""Text rendering of out-of-memory post-mortems."""

from __future__ import annotations

import datetime

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..ledger.oom import OomReport
from .leaks import render_culprit
from .text import render_table

__all__ = ["render_oom"]


def _b(n: int | None) -> str:
    return format_bytes(n)


@renders(OomReport)
def render_oom(r: OomReport) -> str:
    """The post-mortem as a person reads it: facts, the largest holders, then advice."""
    when = datetime.datetime.fromtimestamp(r.created_at).isoformat(timespec="seconds")
    device = "cuda:?" if r.device is None else f"cuda:{r.device}"
    short = r.exception_type.rsplit(".", 1)[-1]
    lines = [
        f"=== cudamem OOM post-mortem ({when}, {r.source}) ===",
        f"{short} on {device}: tried to allocate {_b(r.requested)}",
        f"  device: {_b(r.total)} total, {_b(r.free)} free",
        f"  PyTorch: {_b(r.allocated)} allocated, {_b(r.reserved)} reserved, {_b(r.cache)} cached",
    ]
    if r.inactive_split is not None or r.largest_free_block is not None:
        frag = "n/a" if r.fragmentation is None else f"{r.fragmentation:.0%}"
        lines.append(
            f"  fragmentation: {frag} (largest free block {_b(r.largest_free_block)}, "
            f"{_b(r.inactive_split)} free inside segments still in use)"
        )
    if r.non_pytorch is not None:
        lines.append(f"  this process outside PyTorch's allocator: {_b(r.non_pytorch)}")
    if r.other_processes is not None:
        lines.append(f"  other processes: {_b(r.other_processes)}")
    for st in r.stranded:
        lines.append(
            f"  stranded cache: {_b(st.reserved)} on stream {st.stream:#x} "
            f"({plural(st.segments, 'segment')}, no live tensor)"
        )
    if r.storages:
        lines.append("largest live storages:")
        rows = []
        for s in r.storages:
            shape = "×".join(map(str, s.shape or ())) or "scalar"
            paths = s.paths
            holder = paths[0] if paths else "no holder reachable from Python"
            more = f" (+{len(paths) - 1} more)" if len(paths) > 1 else ""
            where = f"  [allocated at {s.allocated_at}]" if s.allocated_at else ""
            rows.append([_b(s.nbytes), f"{s.dtype or '?'}[{shape}]", holder + more + where])
        table = render_table(["bytes", "tensor", "held by"], rows, align="rll")
        lines.extend("  " + line for line in table.splitlines())
    if r.culprits:
        lines.append("held by:")
        lines.extend(f"  {render_culprit(c)}" for c in r.culprits)
    if r.advice:
        lines.append("what to do:")
        lines.extend(f"  - {a}" for a in r.advice)
    lines.extend(f"note: {n}" for n in r.notes)
    if r.file:
        lines.append(f"(also written to {r.file})")
    return "\n".join(lines)
