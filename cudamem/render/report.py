"""Text rendering of a ``cudamem run`` report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .text import format_bytes, format_duration

if TYPE_CHECKING:
    from ..runner import RunReport

__all__ = ["render_report"]


def render_report(report: RunReport) -> str:
    """The end-of-run summary: outcome, peaks, leak warnings, live storages, the ledger."""
    argv = " ".join([report.script, *report.argv])
    lines = [f"== cudamem run: {argv}"]
    outcome = f"exit code {report.exit_code} after {format_duration(report.duration)}"
    if report.exception is not None:
        outcome += f", raised {report.exception}"
    lines.append(outcome)
    lines.append(f"training steps seen (optimizer.step() calls): {report.steps}")
    if report.peaks:
        peaks = ", ".join(f"cuda:{d} {format_bytes(b)}" for d, b in report.peaks)
        lines.append(f"peak allocated: {peaks}")
    else:
        lines.append("peak allocated: no CUDA device was used")
    lines.append("")
    if report.leak_warnings:
        lines.append(f"leak warnings ({len(report.leak_warnings)}):")
        lines.extend(f"  {w}" for w in report.leak_warnings)
    else:
        lines.append("leak warnings: none")
    if report.oom is not None:
        lines.append("")
        lines.append(str(report.oom))
    if report.live is not None:
        lines.append("")
        lines.append("storages still alive at exit (largest first):")
        lines.append(str(report.live))
    if report.ledger is not None:
        lines.append("")
        lines.append(str(report.ledger))
    if report.history is not None and len(report.history):
        lines.append("")
        lines.append("spans:")
        lines.append(str(report.history))
    if report.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)
