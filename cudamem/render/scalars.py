"""Text rendering of scalar logging results: a logger's series."""

from __future__ import annotations

from collections.abc import Sequence

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..scalars.logger import ScalarLogger
from ..scalars.series import LoggerStats, SeriesSummary
from .text import render_table

__all__ = ["render_logger", "render_logger_stats", "render_scalar_logger", "render_series_summary"]


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


@renders(SeriesSummary)
def render_series_summary(s: SeriesSummary) -> str:
    """``loss: 100 values, last 0.25 (step 99), mean 0.5, min 0.25, max 2``, and NaNs."""
    if s.last is None:
        return f"{s.name}: empty"
    text = f"{s.name}: {plural(s.count, 'value')}, last {s.last:.6g} (step {s.last_step})"
    if s.mean is not None:
        text += f", mean {s.mean:.6g}, min {s.min:.6g}, max {s.max:.6g}"
    if s.nan:
        text += f", {s.nan} NaN"
    return text


@renders(LoggerStats)
def render_logger_stats(stats: LoggerStats) -> str:
    """Values logged, transfers, pending values, what is kept on the host, device buffers."""
    buffers = ", ".join(f"{k} {format_bytes(v)}" for k, v in stats.buffer_bytes.items())
    return (
        f"{plural(stats.logged, 'value')} logged, {plural(stats.transfers, 'transfer')}, "
        f"{stats.pending} pending; "
        f"kept {stats.kept} ({format_bytes(stats.host_bytes)})"
        + (f"; buffers: {buffers}" if buffers else "")
    )
