"""Text rendering of the demo's experiments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base.format import plural
from ..render.text import render_table

if TYPE_CHECKING:
    from .registry import Experiment

__all__ = ["render_experiment", "render_summary"]


def render_experiment(exp: Experiment) -> str:
    """The experiment's title, explanation, table and PASS/FAIL lines."""
    lines = [f"== {exp.title}", exp.explanation]
    if exp.skipped is not None:
        lines.append(f"SKIP: {exp.skipped}")
        return "\n".join(lines)
    if exp.headers:
        lines.append(render_table(exp.headers, exp.rows))
    lines.extend(exp.notes)
    for check in exp.checks:
        status = "PASS" if check.passed else "FAIL"
        lines.append(f"{status}: {check.name}" + (f" — {check.detail}" if check.detail else ""))
    return "\n".join(lines)


def render_summary(results: Sequence[Experiment]) -> str:
    """One closing line: checks passed, failed and experiments skipped."""
    checks = [c for e in results for c in e.checks]
    failed = sum(not c.passed for c in checks)
    skipped = [e for e in results if e.skipped is not None]
    text = f"{len(checks) - failed}/{len(checks)} checks passed"
    if skipped:
        text += f"; {plural(len(skipped), 'experiment')} skipped: {_reasons(skipped)}"
    return text


def _reasons(skipped: Sequence[Experiment]) -> str:
    """``4 need a CUDA GPU, 6 need two CUDA GPUs (this machine has 0)``: each reason once,
    with how many experiments it skipped, in the order they ran."""
    counts: dict[str, int] = {}
    for e in skipped:
        reason = (e.skipped or "").split(";")[0].strip()
        counts[reason] = counts.get(reason, 0) + 1
    parts = []
    for reason, n in counts.items():
        if reason.startswith("needs "):
            parts.append(f"{n} {'needs' if n == 1 else 'need'} {reason[len('needs ') :]}")
        else:
            parts.append(f"{n}: {reason}")
    return ", ".join(parts)
