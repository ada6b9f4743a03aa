"""An inline SVG line chart of allocated / reserved / peak per span (no dependencies)."""

from __future__ import annotations

from collections.abc import Sequence

from ..base.format import escape_html, format_bytes
from .series import Point

__all__ = ["memory_chart"]

_COLORS = {"allocated": "#1f77b4", "reserved": "#ff7f0e", "peak": "#2ca02c"}


def memory_chart(
    pts: Sequence[Point], *, empty: str | None = None, width: int = 800, height: int = 300
) -> str:
    """An ``<svg>`` element: one polyline per series, leak points in red, axes in MiB.

    Without points, no chart: a paragraph saying there is nothing to plot and ``empty``'s
    reason (``series.nothing_to_plot``), never axes labelled ``0 B``.
    """
    if not pts:
        reason = empty or "no span measured CUDA memory"
        return f'<p class="empty">Nothing to plot: {escape_html(reason)}.</p>'
    left, right, top, bottom = 70, 20, 20, 40
    w, h = width - left - right, height - top - bottom
    t_max = max(p.t for p in pts) or 1.0
    y_max = max(max(p.reserved, p.allocated, p.peak or 0) for p in pts) or 1

    def x(t: float) -> float:
        return left + w * (t / t_max if len(pts) > 1 else 0.5)

    def y(v: int) -> float:
        return top + h * (1 - v / y_max)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="memory per span">',
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    labelled: set[str] = set()
    for frac in (0.0, 0.5, 1.0):
        v = int(y_max * frac)
        label = format_bytes(v)
        if label in labelled:  # a tiny range would print the same label twice
            continue
        labelled.add(label)
        parts.append(
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">'
            f"{escape_html(label)}</text>"
        )
    parts.append(
        f'<text x="{left + w / 2}" y="{height - 8}" font-size="11" text-anchor="middle">'
        f"seconds since the first span ({t_max:.2f} s)</text>"
    )
    series = {
        "allocated": [p.allocated for p in pts],
        "reserved": [p.reserved for p in pts],
        "peak": [p.peak if p.peak is not None else p.allocated for p in pts],
    }
    for i, (label, values) in enumerate(series.items()):
        coords = " ".join(f"{x(p.t):.1f},{y(v):.1f}" for p, v in zip(pts, values, strict=True))
        color = _COLORS[label]
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>'
        )
        parts.append(
            f'<text x="{left + 10 + i * 90}" y="{top + 14}" font-size="12" fill="{color}">'
            f"{label}</text>"
        )
    for p in pts:
        if p.leak:
            parts.append(
                f'<circle cx="{x(p.t):.1f}" cy="{y(p.allocated):.1f}" r="3" fill="#d62728">'
                f"<title>{escape_html(p.name)}: leak warning</title></circle>"
            )
    parts.append("</svg>")
    return "\n".join(parts)
