"""Text rendering of holders, graph holders, the live-tensor census and unaccounted bytes."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..holders.census import Census, LiveStorage
from ..holders.finder import GraphHolder, GraphHolders, Holder, Holders
from ..holders.unaccounted import Unaccounted
from .text import render_table

__all__ = [
    "render_census",
    "render_graph_holder",
    "render_graph_holders",
    "render_holder",
    "render_holders",
    "render_live_storage",
    "render_unaccounted",
]

_VIA = {
    "view": "view",
    "alias": "alias",
    "saved": "saved by autograd",
    "grad": ".grad",
    "numpy": "numpy array",
}
_STOPPED = {
    "timeout": "its timeout",
    "max_depth": "max_depth",
    "max_nodes": "max_nodes",
}


def holder_text(holder: Holder) -> str:
    """The path, or for a group of references the pattern (``__main__.log[0..2999]``)."""
    return holder.pattern if holder.count > 1 and holder.pattern else holder.path


@renders(Holder)
def render_holder(holder: Holder) -> str:
    """``__main__.saved[0]  (view)``: the path (a group's pattern), how many references it
    stands for, what it holds if not the tensor itself, and whether it is the caller's own
    reference."""
    marks = []
    if holder.count > 1:
        marks.append(f"{holder.count} references")
    if holder.via in _VIA:
        marks.append(_VIA[holder.via])
    if holder.root_kind == "cycle":
        marks.append("unreachable cycle, freed by gc.collect()")
    elif holder.root_kind == "unknown":
        marks.append("held by a reference gc cannot see (C code or an unread frame)")
    elif holder.root_kind == "partial":
        marks.append("the search stopped here, below no root yet")
    if holder.caller:
        marks.append("your own reference")
    return holder_text(holder) + (f"  ({'; '.join(marks)})" if marks else "")


@renders(Holders)
def render_holders(holders: Holders) -> str:
    """A header naming the target and its bytes, one line per holder, then notes."""
    size = "" if holders.nbytes is None else f", {format_bytes(holders.nbytes)}"
    count = len(holders.holders)
    header = f"{holders.target}{size}: {plural(count, 'holder')}"
    if holders.stopped is not None:
        header += (
            f" found before the search stopped ({_STOPPED.get(holders.stopped, holders.stopped)})"
        )
    lines = [header]
    lines.extend(f"  {render_holder(h)}" for h in holders.holders)
    if not holders.holders:
        if holders.stopped is None:
            lines.append("  (nothing found: only the caller's temporaries hold it)")
        else:
            lines.append("  (nothing found yet: raise the limit to search further)")
    lines.extend(f"  note: {n}" for n in holders.notes)
    return "\n".join(lines)


@renders(LiveStorage)
def render_live_storage(s: LiveStorage) -> str:
    """``4.0 MiB float32[1024×1024] on cuda:0``."""
    shape = "×".join(map(str, s.shape)) or "scalar"
    return f"{format_bytes(s.nbytes)} {s.dtype}[{shape}] on {s.device}"


@renders(Census)
def render_census(census: Census, *, limit: int = 30) -> str:
    """One row per storage, largest first: bytes, device, dtype, shape, tensors, holders."""
    if not census.storages:
        return "no live tensors"
    rows = []
    for s in census.storages[:limit]:
        holder = ""
        if s.holders is not None:
            holder = holder_text(s.holders.holders[0]) if s.holders.holders else "?"
            if len(s.holders.holders) > 1:
                holder += f" (+{len(s.holders.holders) - 1})"
        rows.append(
            [
                format_bytes(s.nbytes),
                s.device,
                s.dtype,
                "×".join(map(str, s.shape)) or "()",
                str(s.tensors),
                "yes" if s.saved_by_autograd else "",
                holder,
            ]
        )
    headers = ["bytes", "device", "dtype", "shape", "tensors", "autograd", "held by"]
    table = render_table(headers, rows, align="rllrrll")
    lines = [table]
    if len(census.storages) > limit:
        lines.append(f"... {plural(len(census.storages) - limit, 'smaller storage')} not shown")
    totals = ", ".join(f"{dev} {format_bytes(n)}" for dev, n in census.by_device().items())
    lines.append(f"{plural(len(census.storages), 'storage')}: {totals}")
    lines.extend(f"note: {n}" for n in census.notes)
    return "\n".join(lines)


@renders(Unaccounted)
def render_unaccounted(u: Unaccounted) -> str:
    """The allocated bytes of one device, split by what holds them."""
    rows = [
        ["reachable from Python", format_bytes(u.python)],
        ["saved by autograd graphs", format_bytes(u.autograd)],
        [f"cuBLAS workspaces ({u.workspace_count})", format_bytes(u.cublas_workspaces)],
        ["unknown", format_bytes(u.unknown)],
        ["allocated", format_bytes(u.allocated)],
    ]
    title = f"cuda:{u.device} allocated memory by holder ({u.method})"
    lines = [render_table(["held by", "bytes"], rows, title=title)]
    lines.extend(f"note: {n}" for n in u.notes)
    return "\n".join(lines)


@renders(GraphHolder)
def render_graph_holder(h: GraphHolder) -> str:
    """``__main__.losses: 10 tensors with graphs keep 40.0 MiB of saved tensors alive on
    cuda:0 (e.g. __main__.losses[3])``."""
    tensors = plural(h.tensors, "tensor")
    where = ", ".join(h.devices) or "no device"
    kept = f"keep {format_bytes(h.graph_bytes)} of saved tensors alive on {where}"
    return f"{h.container}: {tensors} with graphs {kept} (e.g. {h.example})"


@renders(GraphHolders)
def render_graph_holders(result: GraphHolders) -> str:
    """One row per container holding tensors with graphs, then the notes."""
    if not result.holders:
        text = "no container holds a tensor with an autograd graph"
    else:
        rows = [
            [
                h.container,
                str(h.tensors),
                format_bytes(h.graph_bytes),
                format_bytes(h.tensor_bytes),
                ", ".join(h.devices),
                h.example,
            ]
            for h in result.holders
        ]
        text = render_table(
            ["container", "tensors", "graph", "tensors' own", "device", "e.g."],
            rows,
            align="lrrrll",
        )
    return "\n".join([text, *result.notes])
