"""Text rendering of scalar logging results: a logger's series."""

from __future__ import annotations

from collections.abc import Sequence

from .._present import renders
from ..scalars import ScalarLogger, SeriesSummary
from .text import render_table

__all__ = ["render_logger", "render_scalar_logger"]


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


@renders(ScalarLogger)
def render_scalar_logger(logger: ScalarLogger) -> str:
    """A live logger's series as they stand now (``str(logger)``)."""
    return render_logger(logger.summary())
