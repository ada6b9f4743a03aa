"""Plain-text rendering: aligned tables."""

from __future__ import annotations

from collections.abc import Sequence

from ..base.format import plural

__all__ = ["render_table"]


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str | None = None,
    title: str | None = None,
) -> str:
    """An aligned text table. ``align`` is one ``l``/``r`` per column (default: first left,
    the rest right)."""
    ncols = len(headers)
    if align is None:
        align = "l" + "r" * (ncols - 1)
    if len(align) != ncols:
        raise ValueError(f"align has {plural(len(align), 'column')}, headers have {ncols}")
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != ncols:
            raise ValueError(f"row has {plural(len(row), 'cell')}, expected {ncols}: {row!r}")
    widths = [max(len(row[i]) for row in cells) for i in range(ncols)]

    def fmt(row: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if align[i] == "l" else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(parts).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(fmt(cells[0]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(row) for row in cells[1:])
    return "\n".join(lines)
