"""Text rendering of scalar logging results: a logger's series, and graph holders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .text import format_bytes, render_table

if TYPE_CHECKING:
    from ..scalars import GraphHolders, SeriesSummary

__all__ = ["render_graph_holders", "render_logger"]


def render_logger(summaries: Sequence[SeriesSummary]) -> str:
    """One row per series: count, last, mean, min, max, NaN count."""
    if not summaries:
        return "ScalarLogger: nothing logged"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.6g}"

    rows = [
        [s.name, str(s.count), num(s.last), num(s.mean), num(s.min), num(s.max), str(s.nan)]
        for s in summaries
    ]
    return render_table(["series", "count", "last", "mean", "min", "max", "NaN"], rows)


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
