"""Text rendering of a ``cudamem run`` report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..base.format import escape_invisible, format_bytes, format_duration, plural
from ..base.present import renders
from ..run.runner import STEP_SPAN, RunReport
from .modules import render_top_table
from .text import render_table

__all__ = [
    "command_line",
    "leak_line",
    "render_report",
    "render_storage_groups",
    "steps_line",
    "unmeasured",
]


def command_line(report: RunReport) -> str:
    """``train.py --lr 3`` or ``-m pkg --lr 3``, with invisible characters escaped."""
    target = ["-m", report.module] if report.module is not None else [report.script]
    return escape_invisible(" ".join([*target, *report.argv]))


def unmeasured(report: RunReport) -> str | None:
    """Why spans and growth detection measured nothing, or None when a CUDA device was used.

    Spans and growth detection watch the CUDA allocator; a run that touched no CUDA device
    gives them nothing to measure, which must not read as "no leak".
    """
    if report.cuda_used:
        return None
    if report.cuda_devices == 0:
        return "growth detection needs a CUDA device (this machine has none)"
    return "growth detection needs a CUDA device (the script used none)"


def steps_line(report: RunReport) -> str:
    """How many ``optimizer.step()`` calls the run saw, and why the ``training step`` span
    has one call fewer: it runs from one ``optimizer.step()`` to the next."""
    text = f"training steps seen (optimizer.step() calls): {report.steps}"
    if report.steps and report.history is not None:
        spans = sum(s.calls for s in report.history.stats if s.name == STEP_SPAN)
        text += f"; the {STEP_SPAN!r} span runs from one call to the next: {plural(spans, 'span')}"
    return text


def leak_line(report: RunReport) -> str:
    """The leak-warnings heading: how many, or why there cannot be any."""
    if report.leak_warnings:
        return f"leak warnings ({len(report.leak_warnings)}):"
    why = unmeasured(report)
    if why is not None:
        return f"leak warnings: not measured: {why}"
    return "leak warnings: none"


def _group_rows(groups: Sequence[Any]) -> list[list[str]]:
    rows = []
    for g in groups:
        example = g.example if g.example != g.holder else ""
        rows.append(
            [
                escape_invisible(g.holder),
                str(g.storages),
                format_bytes(g.nbytes),
                format_bytes(g.autograd_bytes) if g.autograd_bytes else "",
                escape_invisible(example),
            ]
        )
    return rows


def render_storage_groups(report: RunReport) -> str:
    """What is alive at exit, one row per holding container, largest first.

    A list of ten loss tensors is one row (``__main__.loss_history``, 10 storages) with one
    example path; the storages too small to be listed are summed in one line.
    """
    live = report.live
    lines = []
    if report.groups:
        headers = ["held by", "storages", "bytes", "via autograd", "e.g."]
        lines.append(render_table(headers, _group_rows(report.groups), align="lrrrl"))
    listed = len(live) if live is not None else 0
    count, nbytes = report.unlisted
    if live is not None and listed:
        totals = ", ".join(f"{d} {format_bytes(n)}" for d, n in live.by_device().items())
        summary = f"{plural(listed, 'storage')} listed ({totals})"
    else:
        summary = "no storage listed"
    if count:
        summary += f"; {plural(count, 'smaller storage')} ({format_bytes(nbytes)}) not listed"
    lines.append(summary)
    if live is not None:
        lines.extend(f"note: {n}" for n in live.notes)
    return "\n".join(lines)


@renders(RunReport)
def render_report(report: RunReport) -> str:
    """The end-of-run summary: outcome, peaks, leak warnings, live storages, the ledger."""
    lines = [f"== cudamem run: {command_line(report)}"]
    outcome = f"exit code {report.exit_code} after {format_duration(report.duration)}"
    if report.exception is not None:
        outcome += f", raised {report.exception}"
    lines.append(outcome)
    lines.append(steps_line(report))
    if report.peaks:
        peaks = ", ".join(f"cuda:{d} {format_bytes(b)}" for d, b in report.peaks)
        lines.append(f"peak allocated: {peaks}")
    else:
        lines.append("peak allocated: no CUDA device was used")
    if report.modules is not None:
        lines.append("")
        lines.append(render_top_table(report.modules))
    lines.append("")
    lines.append(leak_line(report))
    lines.extend(f"  {w}" for w in report.leak_warnings)
    if report.oom is not None:
        lines.append("")
        lines.append(str(report.oom))
    if report.live is not None:
        lines.append("")
        lines.append("storages still alive at exit, by holder (largest first):")
        lines.append(render_storage_groups(report))
    if report.ledger is not None:
        lines.append("")
        lines.append(str(report.ledger))
    if report.host is not None:
        lines.append("")
        lines.append(str(report.host))
    if report.history is not None and len(report.history):
        lines.append("")
        lines.append("spans:")
        lines.append(escape_invisible(str(report.history), keep="\n"))
        if not report.cuda_used:
            lines.append("(spans measure CUDA memory: without a CUDA device their bytes are empty)")
    if report.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)
