"""Text rendering of ``cudamem.growth.compare.MemoryDiff``."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..growth.compare import MemoryDiff
from .text import render_table

__all__ = ["render_diff"]

_WHAT = {
    "census": "live storages",
    "snapshot": "live allocator blocks",
    "span": "allocated at span exit",
}


@renders(MemoryDiff)
def render_diff(d: MemoryDiff, *, limit: int = 20) -> str:
    """A header with both totals, one row per changed holder group (largest growth first),
    then the example path of each group that grew, and notes."""
    what = _WHAT.get(d.kind, d.kind)
    if d.delta is None:
        sides = [
            name
            for name, total in (("first", d.before_total), ("second", d.after_total))
            if total is None
        ]
        lines = [
            f"{what}: n/a (the {' and '.join(sides)} "
            f"{'span' if len(sides) == 1 else 'spans'} measured no CUDA device)"
        ]
    else:
        lines = [
            f"{what}: {format_bytes(d.before_total)} → {format_bytes(d.after_total)} "
            f"({format_bytes(d.delta, signed=True)})"
        ]
    if d.entries:
        rows = [
            [
                e.holder,
                format_bytes(e.before),
                format_bytes(e.after),
                format_bytes(e.delta, signed=True),
                f"{e.count_before} → {e.count_after}",
            ]
            for e in d.entries[:limit]
        ]
        lines.append(render_table(["held by", "before", "after", "change", "items"], rows))
        if len(d.entries) > limit:
            lines.append(f"... {plural(len(d.entries) - limit, 'more group')} changed")
        examples = [e for e in d.grew[:5] if e.example != e.holder]
        if examples:
            lines.append("grew, for example:")
            lines.extend(f"  {e.example}" for e in examples)
    else:
        lines.append("no holder group changed")
    if d.unchanged:
        lines.append(f"{plural(d.unchanged, 'group')} unchanged")
    lines.extend(f"note: {n}" for n in d.notes)
    return "\n".join(lines)
