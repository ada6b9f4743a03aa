"""Finished top-level spans: a bounded ring plus running aggregates by name.

A decorated function called a million times must not grow memory: the ring keeps the last
``maxlen`` spans and the aggregates are a fixed handful of numbers per distinct name (at
most ``MAX_NAMES`` names; the rest are pooled under ``'<other>'``).

The history takes the top-level spans from ``state.finished``, the queue a span's exit
appends to (a ``deque``: atomic, no lock, no call). Every ``DRAIN_AT`` spans, and whenever
the history is read, that queue is drained under the lock into the ring and the aggregates
(O(1) per span, from the span's raw integers). ``SpanRecord`` objects are built only when
``history`` is read.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ..base.present import Presented
from . import span as _span
from .state import FINISHED_AT, finished, set_finished_sink

if TYPE_CHECKING:
    from .raw import RawSpan
    from .record import SpanRecord

__all__ = ["History", "SpanStats", "clear_history", "history", "set_history_size"]

DEFAULT_SIZE = 1000
MAX_NAMES = 1000
OTHER = "<other>"
#: Spans waiting in the inbox before the exiting thread drains it.
DRAIN_AT = FINISHED_AT

#: Spans of one name from which a drain folds them column by column (``_Aggregate.add``).
_BATCH_FROM = 12


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
    #: Calls that measured a CUDA device (the byte figures aggregate over all calls; with
    #: none measured they are 0 and say nothing: renderers show ``n/a``).
    measured: int = 0


class _Aggregate:
    __slots__ = (
        "alloc_max",
        "alloc_sum",
        "calls",
        "dur_max",
        "dur_sum",
        "errors",
        "measured",
        "peak_calls",
        "peak_max",
        "peak_sum",
        "peakd_max",
        "peakd_sum",
        "res_max",
        "res_sum",
    )

    def __init__(self) -> None:
        self.calls = self.errors = self.peak_calls = self.measured = 0
        self.alloc_sum = self.res_sum = self.peak_sum = self.peakd_sum = 0
        self.alloc_max = self.res_max = self.peak_max = self.peakd_max = -(2**63)
        self.dur_sum = self.dur_max = 0.0

    def add_one(self, r: RawSpan) -> None:
        """Fold one span in."""
        self.calls += 1
        if r.exception is not None:
            self.errors += 1
        if r.after:
            self.measured += 1
        a, res, dur = r.alloc_delta, r.res_delta, (r.end_ns - r.start_ns) / 1e9
        self.alloc_sum += a
        self.res_sum += res
        self.dur_sum += dur
        self._maxima(a, res, dur)
        peak, peakd = r.peak_total, r.peak_delta
        if peak is not None and peakd is not None:
            self._peaks(1, peak, peakd, peak, peakd)

    def _maxima(self, alloc: int, res: int, dur: float) -> None:
        if alloc > self.alloc_max:
            self.alloc_max = alloc
        if res > self.res_max:
            self.res_max = res
        if dur > self.dur_max:
            self.dur_max = dur

    def _peaks(self, calls: int, peak_sum: int, peakd_sum: int, peak: int, peakd: int) -> None:
        self.peak_calls += calls
        self.peak_sum += peak_sum
        self.peakd_sum += peakd_sum
        if peak > self.peak_max:
            self.peak_max = peak
        if peakd > self.peakd_max:
            self.peakd_max = peakd

    def add(self, spans: list[RawSpan]) -> None:
        """Fold a batch of spans of one name in: one list comprehension per column (the
        cheapest read of a slot per span), then C-level ``sum``/``max``/``count`` over
        columns; cheaper per span than ``add_one`` from a dozen spans up."""
        n = len(spans)
        if n < _BATCH_FROM:
            for r in spans:
                self.add_one(r)
            return
        columns = _span._columns
        folded = None if columns is None else columns(spans)
        if folded is not None:  # the compiled span core's one pass over the batch
            errors, measured, a_sum, r_sum, d_sum, a_max, r_max, d_max, *peak = folded
            self.calls += n
            self.errors += errors
            self.measured += measured
            self.alloc_sum += a_sum
            self.res_sum += r_sum
            self.dur_sum += d_sum / 1e9
            self._maxima(a_max, r_max, d_max / 1e9)
            if peak[0]:
                self._peaks(*peak)
            return
        allocs = [r.alloc_delta for r in spans]
        ress = [r.res_delta for r in spans]
        durs = [r.end_ns - r.start_ns for r in spans]
        peaks = [r.peak_total for r in spans]
        self.calls += n
        self.errors += n - [r.exception for r in spans].count(None)
        self.measured += n - [r.after for r in spans].count(())
        self.alloc_sum += sum(allocs)
        self.res_sum += sum(ress)
        self.dur_sum += sum(durs) / 1e9
        self._maxima(max(allocs), max(ress), max(durs) / 1e9)
        missing = peaks.count(None)
        if missing < n:
            kept = spans
            if missing:
                kept = [r for r in spans if r.peak_total is not None and r.peak_delta is not None]
                peaks = [r.peak_total for r in kept]
            tops = cast("list[int]", peaks)
            tops_d = cast("list[int]", [r.peak_delta for r in kept])
            self._peaks(len(tops), sum(tops), sum(tops_d), max(tops), max(tops_d))

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
            measured=self.measured,
        )


@dataclass(frozen=True, slots=True)
class History(Presented):
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


class _Ring:
    def __init__(self, maxlen: int) -> None:
        self.lock = threading.Lock()
        #: The spans' queue of finished top-level spans (``state.finished``).
        self.inbox: deque[RawSpan] = finished
        self.records: deque[RawSpan] = deque(maxlen=maxlen)
        self.aggregates: dict[str, _Aggregate] = {}
        self.total = 0

    def drain(self) -> None:
        """Move the inbox into the ring and the aggregates; caller holds ``lock``."""
        inbox, aggregates = self.inbox, self.aggregates
        # Only what is there now: other threads keep appending while this runs.
        pop = inbox.popleft
        batch = [pop() for _ in range(len(inbox))]
        if not batch:
            return
        self.records.extend(batch)
        self.total += len(batch)
        names = [r.name for r in batch]
        first = names[0]
        if names.count(first) == len(names):  # a training loop: one name per batch
            groups = {first: batch}
        else:
            groups = {}
            for r in batch:
                group = groups.get(r.name)
                if group is None:
                    groups[r.name] = [r]
                else:
                    group.append(r)
        for name, group in groups.items():
            agg = aggregates.get(name)
            if agg is None:
                if len(aggregates) >= MAX_NAMES:
                    name = OTHER
                    agg = aggregates.get(name)
                if agg is None:
                    agg = aggregates[name] = _Aggregate()
            agg.add(group)

    def snapshot(self) -> History:
        with self.lock:
            self.drain()
            spans = tuple(r.record() for r in self.records)
            stats = tuple(a.freeze(n) for n, a in self.aggregates.items())
            maxlen = self.records.maxlen or 0
            return History(spans, stats, self.total - len(spans), maxlen)


_ring = _Ring(DEFAULT_SIZE)


def _drain_soon() -> None:
    """The spans' queue is full: drain it unless another thread is doing it."""
    if _ring.lock.acquire(blocking=False):
        try:
            _ring.drain()
        finally:
            _ring.lock.release()


def history() -> History:
    """The finished top-level spans (the last ``maxlen``) and aggregates by name."""
    return _ring.snapshot()


def clear_history() -> None:
    """Forget every recorded span and aggregate."""
    with _ring.lock:
        _ring.inbox.clear()
        _ring.records.clear()
        _ring.aggregates.clear()
        _ring.total = 0


def set_history_size(maxlen: int) -> None:
    """Keep the last ``maxlen`` top-level spans (default 1000). Aggregates are unaffected."""
    if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1:
        raise ValueError(f"history size must be a positive int, got {maxlen!r}")
    with _ring.lock:
        _ring.drain()
        _ring.records = deque(_ring.records, maxlen=maxlen)


set_finished_sink(_drain_soon)
