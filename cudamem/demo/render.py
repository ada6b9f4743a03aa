"""Text rendering of the demo's experiments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._format import plural
from ..render.text import render_table

if TYPE_CHECKING:
    from .seeds import Experiment

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
        text += f"; {plural(len(skipped), 'experiment')} skipped ({skipped[0].skipped})"
    return text
