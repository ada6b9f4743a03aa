"""What a logged series holds and says: its storage (``_SeriesData``, ``_Record``) and its
frozen summaries (``SeriesSummary``, ``LoggerStats``).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..base.present import Presented

__all__ = ["LoggerStats", "SeriesSummary"]


@dataclass(frozen=True, slots=True)
class SeriesSummary(Presented):
    """Count and simple statistics of one series at one instant (NaN-aware: ``mean``,
    ``min`` and ``max`` skip NaN; ``nan`` counts them)."""

    name: str
    count: int
    #: Values that left the series because of ``maxlen`` (still counted in ``count``).
    dropped: int
    last: float | None
    mean: float | None
    min: float | None
    max: float | None
    nan: int
    last_step: int | None


@dataclass(frozen=True, slots=True)
class LoggerStats(Presented):
    """What a ``ScalarLogger`` has done: how often it moved values to the host."""

    #: Values logged (all series), including those still on a device.
    logged: int
    #: Batches moved from a device buffer to the host (one per device per flush).
    transfers: int
    #: Values logged but not yet on the host.
    pending: int
    #: Device memory of the logger's buffers, by device (``'cuda:0'``, ``'cpu'``).
    buffer_bytes: Mapping[str, int]
    #: Values kept on the host (all series; at most ``maxlen`` per series).
    kept: int = 0
    #: Host memory those values take: 8 bytes for the value and 8 for its step.
    host_bytes: int = 0


class _SeriesData:
    """Host-side values of one series: floats and their steps in two flat arrays (8 bytes
    each per value, no Python object per value), nothing else.

    Without ``maxlen`` every value is kept (16 bytes a value: 10 M values take 160 MB, half
    a list of Python floats). With ``maxlen`` the arrays are a ring of the newest ``maxlen``
    values: memory stays at ``16 * maxlen`` bytes however many values arrive, and ``count``
    still counts them all.
    """

    __slots__ = ("count", "maxlen", "name", "next_step", "start", "steps", "values")

    def __init__(self, name: str, maxlen: int | None) -> None:
        self.name = name
        self.maxlen = maxlen
        self.values = array("d")
        self.steps = array("q")
        self.start = 0  # index of the oldest value once the ring is full
        self.count = 0  # values ever delivered (dropped ones included)
        self.next_step = 0

    def add(self, step: int, value: float) -> None:
        if self.maxlen is None or len(self.values) < self.maxlen:
            self.values.append(value)
            self.steps.append(step)
        else:
            i = self.start
            self.values[i] = value
            self.steps[i] = step
            i += 1
            self.start = 0 if i == self.maxlen else i
        self.count += 1

    def __len__(self) -> int:
        return len(self.values)

    def ordered_values(self) -> array[float]:
        """The values, oldest first (a copy when the ring has wrapped)."""
        s = self.start
        return self.values[s:] + self.values[:s] if s else self.values

    def ordered_steps(self) -> array[int]:
        s = self.start
        return self.steps[s:] + self.steps[:s] if s else self.steps

    def at(self, index: int) -> float:
        """The value at ``index`` in log order (negative counts from the newest)."""
        n = len(self.values)
        if not -n <= index < n:
            raise IndexError(index)
        return self.values[(self.start + index) % n]

    def last(self) -> tuple[int, float]:
        i = self.start - 1  # -1 (the end) until the ring wraps
        return self.steps[i], self.values[i]

    @property
    def nbytes(self) -> int:
        return len(self.values) * (self.values.itemsize + self.steps.itemsize)

    def clear(self) -> None:
        self.values = array("d")
        self.steps = array("q")
        self.start = 0


class _Record:
    """A value in log order that may still be on a device (``ready`` once it is not)."""

    __slots__ = ("ready", "series", "step", "value")

    def __init__(self, series: _SeriesData, step: int, value: float, ready: bool) -> None:
        self.series = series
        self.step = step
        self.value = value
        self.ready = ready


def _mean(values: Sequence[float]) -> float:
    """Exact mean (``fsum``); NaN when empty; ``inf - inf`` gives NaN instead of raising."""
    if not values:
        return math.nan
    try:
        return math.fsum(values) / len(values)
    except (ValueError, OverflowError):
        return sum(values) / len(values)


def _summarize(data: _SeriesData) -> SeriesSummary:
    n = len(data)
    if not n:
        return SeriesSummary(data.name, data.count, 0, None, None, None, None, 0, None)
    values = np.array(data.values, dtype=np.float64)
    finite = values[~np.isnan(values)]  # inf stays
    last_step, last = data.last()
    return SeriesSummary(
        name=data.name,
        count=data.count,
        dropped=data.count - n,
        last=last,
        mean=_mean(finite.tolist()) if finite.size else None,
        min=float(finite.min()) if finite.size else None,
        max=float(finite.max()) if finite.size else None,
        nan=n - int(finite.size),
        last_step=last_step,
    )
