"""The data behind the memory picture: one point per finished span, in time order.

``cudamem.plot()`` (matplotlib) and the HTML report (inline SVG) both draw from these
points, so they show the same picture. A span that measured no CUDA device (the script had
not touched one, or the machine has none) has no level to draw: it is left out rather than
drawn at 0 B, and ``nothing_to_plot`` says why the picture is empty.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.format import plural

if TYPE_CHECKING:
    from ..spans.record import SpanRecord

__all__ = ["Point", "nothing_to_plot", "points"]


@dataclass(frozen=True, slots=True)
class Point:
    """One span's levels at exit (summed over its devices). Bytes are ints."""

    name: str
    #: Seconds since the first span's start.
    t: float
    allocated: int
    reserved: int
    peak: int | None
    #: The span's name had a leak warning.
    leak: bool


def points(spans: Iterable[SpanRecord], leak_names: Iterable[str] = ()) -> list[Point]:
    """Points for ``spans`` (a history's ``spans``), marking names in ``leak_names``."""
    records = sorted((r for r in spans if r.devices), key=lambda r: r.started_at + r.duration)
    if not records:
        return []
    t0 = records[0].started_at
    leaking = set(leak_names)
    out = []
    for r in records:
        alloc = sum(d.after.allocated for d in r.devices)
        reserved = sum(d.after.reserved for d in r.devices)
        out.append(
            Point(
                r.name, r.started_at + r.duration - t0, alloc, reserved, r.peak, r.name in leaking
            )
        )
    return out


def nothing_to_plot(spans: Iterable[SpanRecord]) -> str | None:
    """Why ``spans`` give no point to draw, or None when there is something to draw."""
    records = list(spans)
    if not records:
        return "no span has finished yet (cudamem.track, or optimizer steps under cudamem run)"
    if any(r.devices for r in records):
        return None
    return (
        f"{plural(len(records), 'span')} finished, but none measured "
        "CUDA memory: spans measure the CUDA allocator, and no CUDA device was in use"
    )
