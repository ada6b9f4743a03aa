"""``RawSpan``: one span's raw counters and bookkeeping while it runs and after it closes,
what the hooks receive; its frozen ``SpanRecord`` is built from it the first time someone
asks. The clock the spans read (``now_ns``) is defined here."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..allocator.stats import DeviceCounters
from .record import DeviceSpan, SpanRecord

if TYPE_CHECKING:
    from ..allocator.backend_base import Counters
    from .record import ExceptionInfo

__all__ = ["RawSpan", "now_ns"]

#: The spans' clock (what ``time.perf_counter_ns`` reads; the compiled core reads the same
#: clock itself while this is that function).
now_ns = time.perf_counter_ns
_NOTHING: tuple[int, int, int] = (0, 0, 0)


class RawSpan:
    """One span's raw counters and bookkeeping: what hooks receive.

    Mutable while open, not changed after close. Hooks read ``name``, ``leaks``,
    ``top_level``, ``exception``, ``measured`` and the totals (plain ints, summed over the
    devices read: ``level``, ``alloc_delta``, ``res_delta``, ``peak_total``,
    ``peak_delta``), attach their own per-span data to ``extras``, and call ``record``
    only when they need the frozen result (built once, on first use).
    """

    __slots__ = (
        "_record",
        "after",
        "alloc_delta",
        "armed",
        "before",
        "children",
        "closed",
        "device",
        "devs",
        "dropped",
        "end_ns",
        "exception",
        "exit_devs",
        "extras",
        "fold",
        "leaks",
        "level",
        "name",
        "notes",
        "owner",
        "parent",
        "peak",
        "peak_delta",
        "peak_total",
        "peaks",
        "res_delta",
        "solo",
        "start_ns",
        "sync",
        "thread",
        "top_level",
        "unmeasured",
        "xfold",
    )

    # The hot path stores each field once, where it is known: ``_open`` the span's options,
    # its links and the entry counters; ``_close`` everything a hook reads (below). Fields
    # that stay at their default in almost every span (``dropped``, ``notes``,
    # ``unmeasured``) are not stored at all until they change: cudamem reads them with
    # ``getattr(span, field, default)``.
    name: str
    device: int | None
    sync: bool
    peak: bool
    #: The span was asked to record which storages it leaves behind (``leaks=True``).
    leaks: bool
    parent: RawSpan | None
    children: list[RawSpan] | None
    closed: bool
    #: Per-span data of the features' hooks (``leaks`` keeps its capture under ``'leaks'``).
    extras: dict[str, Any] | None
    #: Peaks folded in by later spans of the opening thread (written without a lock)
    #: and by spans of other threads (under the fold lock): two slots, so that no
    #: write can lose another. Created by the first fold.
    fold: dict[int, int] | None
    xfold: dict[int, int] | None
    #: Only for spans with ``peak=True`` (set before the span is announced to other threads).
    owner: int
    armed: bool
    solo: bool
    #: Devices read at entry and ``(allocated, reserved, peak counter)`` of each.
    devs: tuple[int, ...]
    before: tuple[Counters, ...]
    start_ns: int
    # Set by the span's exit, before any hook runs: the devices read and their counters.
    end_ns: int
    exit_devs: tuple[int, ...]
    after: tuple[Counters, ...]
    thread: str
    level: int
    alloc_delta: int
    res_delta: int
    peak_total: int | None
    peak_delta: int | None
    top_level: bool
    exception: ExceptionInfo | None
    #: The frozen result, once built.
    _record: SpanRecord | None
    # Stored only where they carry more than the fields above.
    #: The span's own peak per exit device (``None`` with ``peak=False``; over one device
    #: it is ``(peak_total,)`` and the exit does not store it).
    peaks: tuple[int, ...] | None
    dropped: int
    notes: list[str] | None
    unmeasured: str | None

    # No ``__init__``: ``_open`` is the one maker of spans and stores the fields itself (a
    # call of ``__init__`` would cost as much as the stores do).

    @property
    def measured(self) -> bool:
        """Whether any device's counters were read at exit."""
        return bool(self.after)

    @property
    def duration(self) -> float:
        """Seconds between entry and exit."""
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def started_at(self) -> float:
        """``time.time()`` at entry: the wall clock now, less the monotonic time since entry
        (anchoring once at import would drift with the wall clock in a long process)."""
        return time.time() - (now_ns() - self.start_ns) / 1e9

    def note(self, text: str) -> None:
        """Record a bookkeeping problem in the span's result."""
        notes = getattr(self, "notes", None)
        if notes is None:
            notes = self.notes = []
        notes.append(text)

    def record(self) -> SpanRecord:
        """The frozen result, built on first call (only valid once the span has closed)."""
        rec = self._record
        if rec is None:
            rec = self._record = self._build()
        return rec

    def _build(self) -> SpanRecord:
        before = dict(zip(self.devs, self.before, strict=True))
        peaks = getattr(self, "peaks", None)
        if peaks is None and self.peak_total is not None and len(self.after) == 1:
            peaks = (self.peak_total,)  # one device: the exit did not store it
        devices = []
        for i, (d, (a, r, p)) in enumerate(zip(self.exit_devs, self.after, strict=True)):
            b = before.get(d, _NOTHING)
            devices.append(
                DeviceSpan(
                    d,
                    DeviceCounters(d, b[0], b[1], b[2]),
                    DeviceCounters(d, a, r, p),
                    None if peaks is None else peaks[i],
                )
            )
        children = self.children
        notes = getattr(self, "notes", None)
        return SpanRecord(
            self.name,
            tuple(devices),
            self.duration,
            self.started_at,
            self.exception,
            tuple(c.record() for c in children) if children else (),
            self.thread,
            self.sync,
            self.peak,
            self.alloc_delta,
            self.res_delta,
            self.peak_total,
            self.peak_delta,
            getattr(self, "dropped", 0),
            tuple(notes) if notes else (),
            getattr(self, "unmeasured", None),
        )
