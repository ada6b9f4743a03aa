"""Plain-text rendering: byte sizes, durations and aligned tables."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_bytes", "format_duration", "render_table"]

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_bytes(n: int | None, *, signed: bool = False) -> str:
    """``268435456`` → ``'256.0 MiB'`` (binary units; ``signed`` adds ``+``/``-``).

    ``None`` (a value that could not be measured) renders as ``'n/a'``, never as 0.
    """
    if n is None:
        return "n/a"
    sign = ""
    if signed:
        sign = "+" if n >= 0 else "-"
    elif n < 0:
        sign = "-"
    magnitude = abs(n)
    for unit, size in _UNITS:
        if magnitude >= size:
            return f"{sign}{magnitude / size:.1f} {unit}"
    return f"{sign}{magnitude} B"


def format_duration(seconds: float) -> str:
    """``0.0032`` → ``'3.2 ms'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


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
        raise ValueError(f"align has {len(align)} columns, headers have {ncols}")
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != ncols:
            raise ValueError(f"row has {len(row)} cells, expected {ncols}: {row!r}")
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
