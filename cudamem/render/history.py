"""Text rendering of the span history."""

from __future__ import annotations

from ..base.format import format_bytes, format_duration, plural
from ..base.present import renders
from ..spans.history import History
from .text import render_table

__all__ = ["render_history"]


def _mib(value: float | None, *, signed: bool = False) -> str:
    return "n/a" if value is None else format_bytes(round(value), signed=signed)


@renders(History)
def render_history(history: History) -> str:
    """One row per span name: calls, mean/max allocated delta, reserved delta, peak, time."""
    if not history.stats:
        return "no finished spans"
    rows = []
    for s in history.stats:
        # Calls that measured no CUDA device (CPU only) have no byte figures: n/a, not +0 B.
        measured = s.measured > 0
        rows.append(
            [
                s.name,
                str(s.calls),
                _mib(s.mean_allocated_delta if measured else None, signed=True),
                _mib(s.max_allocated_delta if measured else None, signed=True),
                _mib(s.mean_reserved_delta if measured else None, signed=True),
                _mib(s.max_peak),
                _mib(s.max_peak_delta, signed=True),
                format_duration(s.mean_duration),
                str(s.errors),
            ]
        )
    headers = [
        "span",
        "calls",
        "alloc Δ mean",
        "alloc Δ max",
        "reserved Δ mean",
        "peak max",
        "peak Δ max",
        "time mean",
        "errors",
    ]
    table = render_table(headers, rows)
    if history.dropped:
        table += f"\n({plural(history.dropped, 'older span')} left the ring; aggregates count them)"
    return table
