"""Finished top-level spans: a bounded ring plus running aggregates by name.

A decorated function called a million times must not grow memory: the ring keeps the last
``maxlen`` records and the aggregates are a fixed handful of numbers per distinct name
(at most ``MAX_NAMES`` names; the rest are pooled under ``'<other>'``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .span import SpanRecord

__all__ = ["History", "SpanStats", "clear_history", "history", "record", "set_history_size"]

DEFAULT_SIZE = 1000
MAX_NAMES = 1000
OTHER = "<other>"


@dataclass(frozen=True, slots=True)
class SpanStats:
    """Aggregates of every finished top-level span of one name."""

    name: str
    calls: int
    errors: int
    mean_allocated_delta: float
    max_allocated_delta: int
    mean_reserved_delta: float
    max_reserved_delta: int
    mean_peak: float | None
    max_peak: int | None
    mean_peak_delta: float | None
    max_peak_delta: int | None
    total_allocated_delta: int
    mean_duration: float
    max_duration: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {k: getattr(self, k) for k in self.__slots__}


class _Aggregate:
    __slots__ = (
        "alloc_max",
        "alloc_sum",
        "calls",
        "dur_max",
        "dur_sum",
        "errors",
        "peak_calls",
        "peak_max",
        "peak_sum",
        "peakd_max",
        "peakd_sum",
        "res_max",
        "res_sum",
    )

    def __init__(self) -> None:
        self.calls = self.errors = self.peak_calls = 0
        self.alloc_sum = self.res_sum = self.peak_sum = self.peakd_sum = 0
        self.alloc_max = self.res_max = self.peak_max = self.peakd_max = -(2**63)
        self.dur_sum = self.dur_max = 0.0

    def add(self, r: SpanRecord) -> None:
        # Plain comparisons instead of max(): this runs once per top-level span.
        self.calls += 1
        if r.exception is not None:
            self.errors += 1
        a, res, dur = r.allocated_delta, r.reserved_delta, r.duration
        self.alloc_sum += a
        self.res_sum += res
        self.dur_sum += dur
        if a > self.alloc_max:
            self.alloc_max = a
        if res > self.res_max:
            self.res_max = res
        if dur > self.dur_max:
            self.dur_max = dur
        peak, peakd = r.peak, r.peak_delta
        if peak is not None and peakd is not None:
            self.peak_calls += 1
            self.peak_sum += peak
            self.peakd_sum += peakd
            if peak > self.peak_max:
                self.peak_max = peak
            if peakd > self.peakd_max:
                self.peakd_max = peakd

    def freeze(self, name: str) -> SpanStats:
        n, pn = self.calls, self.peak_calls
        return SpanStats(
            name=name,
            calls=n,
            errors=self.errors,
            mean_allocated_delta=self.alloc_sum / n,
            max_allocated_delta=self.alloc_max,
            mean_reserved_delta=self.res_sum / n,
            max_reserved_delta=self.res_max,
            mean_peak=self.peak_sum / pn if pn else None,
            max_peak=self.peak_max if pn else None,
            mean_peak_delta=self.peakd_sum / pn if pn else None,
            max_peak_delta=self.peakd_max if pn else None,
            total_allocated_delta=self.alloc_sum,
            mean_duration=self.dur_sum / n,
            max_duration=self.dur_max,
        )


@dataclass(frozen=True, slots=True)
class History:
    """A snapshot of the span history: recent records and per-name aggregates."""

    spans: tuple[SpanRecord, ...]
    stats: tuple[SpanStats, ...]
    #: Records that fell out of the ring (they still count in ``stats``).
    dropped: int
    maxlen: int

    def __len__(self) -> int:
        return len(self.spans)

    def by_name(self, name: str) -> SpanStats:
        """The aggregates of one name (``KeyError`` if none ran)."""
        for s in self.stats:
            if s.name == name:
                return s
        raise KeyError(f"no finished span named {name!r}")

    def named(self, name: str) -> tuple[SpanRecord, ...]:
        """The kept records of one name, oldest first."""
        return tuple(r for r in self.spans if r.name == name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "spans": [r.to_dict() for r in self.spans],
            "stats": [s.to_dict() for s in self.stats],
            "dropped": self.dropped,
            "maxlen": self.maxlen,
        }

    def __str__(self) -> str:
        from .render.history import render_history

        return render_history(self)


class _Ring:
    def __init__(self, maxlen: int) -> None:
        self.lock = threading.Lock()
        self.records: deque[SpanRecord] = deque(maxlen=maxlen)
        self.aggregates: dict[str, _Aggregate] = {}
        self.total = 0

    def add(self, r: SpanRecord) -> None:
        with self.lock:
            self.records.append(r)
            self.total += 1
            key = r.name
            agg = self.aggregates.get(key)
            if agg is None:
                if len(self.aggregates) >= MAX_NAMES:
                    key = OTHER
                    agg = self.aggregates.get(key)
                if agg is None:
                    agg = self.aggregates[key] = _Aggregate()
            agg.add(r)

    def snapshot(self) -> History:
        with self.lock:
            spans = tuple(self.records)
            stats = tuple(a.freeze(n) for n, a in self.aggregates.items())
            maxlen = self.records.maxlen or 0
            return History(spans, stats, self.total - len(spans), maxlen)


_ring = _Ring(DEFAULT_SIZE)


def record(r: SpanRecord) -> None:
    """Add a finished top-level span (called by spans; users need not)."""
    _ring.add(r)


def history() -> History:
    """The finished top-level spans (the last ``maxlen``) and aggregates by name."""
    return _ring.snapshot()


def clear_history() -> None:
    """Forget every recorded span and aggregate."""
    with _ring.lock:
        _ring.records.clear()
        _ring.aggregates.clear()
        _ring.total = 0


def set_history_size(maxlen: int) -> None:
    """Keep the last ``maxlen`` top-level spans (default 1000). Aggregates are unaffected."""
    if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1:
        raise ValueError(f"history size must be a positive int, got {maxlen!r}")
    with _ring.lock:
        _ring.records = deque(_ring.records, maxlen=maxlen)
