"""``cudamem.plot()``: allocated / reserved / peak per span over time (matplotlib, optional)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..base.format import plural
from ..spans.history import History, history
from .series import nothing_to_plot, points

__all__ = ["plot"]

MiB = 1024**2


def plot(
    hist: History | None = None,
    *,
    leaks: Iterable[Any] = (),
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Draw the span history: one point per finished top-level span, in time order.

    Spans that measured no CUDA device are left out. When nothing is left (no span has
    finished, or none measured CUDA memory: a CPU-only run), no empty chart is drawn: the
    axes say there is nothing to plot and why.

    Args:
        hist: a [History][cudamem.spans.history.History] (default: ``cudamem.history()``).
        leaks: span names, or ``LeakWarning``/``Growth`` objects, whose points are marked red.
        ax: a matplotlib ``Axes`` to draw into (default: a new figure).
        title: the axes' title.

    Returns:
        The matplotlib ``Axes``. Needs the ``plot`` extra: ``pip install 'cudamem[plot]'``.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("cudamem.plot() needs matplotlib: pip install 'cudamem[plot]'") from exc
    hist = history() if hist is None else hist
    names = []
    for item in leaks:
        growth = getattr(item, "growth", item)
        name = item if isinstance(item, str) else getattr(growth, "name", None)
        if isinstance(name, str):
            names.append(name)
    pts = points(hist.spans, names)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    if not pts:
        reason = nothing_to_plot(hist.spans) or "no span measured CUDA memory"
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"Nothing to plot:\n{reason}", ha="center", va="center", wrap=True)
        ax.set_title(title or "cudamem: nothing to plot")
        return ax
    ts = [p.t for p in pts]
    ax.plot(ts, [p.allocated / MiB for p in pts], label="allocated", color="#1f77b4")
    ax.plot(ts, [p.reserved / MiB for p in pts], label="reserved", color="#ff7f0e")
    ax.plot(
        ts,
        [(p.peak if p.peak is not None else p.allocated) / MiB for p in pts],
        label="peak",
        color="#2ca02c",
        linestyle="--",
    )
    leak_pts = [p for p in pts if p.leak]
    if leak_pts:
        ax.scatter(
            [p.t for p in leak_pts],
            [p.allocated / MiB for p in leak_pts],
            color="#d62728",
            zorder=3,
            label="leak warning",
        )
    ax.set_xlabel("seconds since the first span")
    ax.set_ylabel("MiB (at span exit)")
    ax.set_title(title or f"cudamem: {plural(len(pts), 'span')}")
    ax.legend(loc="upper left")
    return ax
