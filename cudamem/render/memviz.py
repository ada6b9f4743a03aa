"""Text rendering of snapshot dumps."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..ledger.memviz import SnapshotDump

__all__ = ["render_dump"]


@renders(SnapshotDump)
def render_dump(dump: SnapshotDump) -> str:
    """``wrote snap.pickle (oom): 12 live blocks, 40.0 MiB; 10 named by holder (39.0 MiB)``,
    then notes and where to open it."""
    text = (
        f"wrote {dump.path} ({dump.reason}): {dump.blocks} live block"
        f"{'' if dump.blocks == 1 else 's'}, {format_bytes(dump.nbytes)}; "
        f"{dump.named} named by holder ({format_bytes(dump.named_bytes)})"
    )
    if dump.trace_entries:
        text += f", {plural(dump.trace_entries, 'history event')}"
    lines = [text, "  open it at https://pytorch.org/memory_viz"]
    lines.extend(f"  note: {n}" for n in dump.notes)
    return "\n".join(lines)
