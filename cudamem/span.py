"""Allocator spans: ``track()`` and ``MemorySpan``, and the hooks features attach to them.

A span reads three allocator counters (allocated, reserved, peak) of every device involved
when it opens and when it closes. The hot path keeps those raw integers in a private
``RawSpan``; the frozen results (``SpanRecord``, ``DeviceSpan``) are built the
first time someone reads them, so a span nobody looks at costs two counter reads and a few
attribute stores.

Features attach through hooks rather than imports: growth detection and ``leaks=True``
(``cudamem.leaks``) and OOM post-mortems (``cudamem.oom``) register entry/exit hooks here,
and the span history (``cudamem._history``) takes the top-level spans from a queue this
module fills (``finished``, ``set_finished_sink``); this module imports none of them.

Peaks: PyTorch keeps one peak counter per device for the whole process. A span with
``peak=True`` resets it on entry, after folding the value it held into every open span (all
threads) and into cudamem's process-wide maximum, so nested spans never hide each other's
peaks; ``max_allocated`` gives the true process-wide peak. While every open span belongs
to one thread, nothing takes a lock; spans of several threads at once fold under one.

Stacks: each thread and asyncio task has its own chain of open spans (a context variable
holding the innermost one; each span knows its parent). A span closed on another thread, or
out of order, is simply marked closed; later spans skip closed ancestors, so nothing is ever
left stranded on a stack.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast, overload

from typing_extensions import ParamSpec

from . import _spancore
from ._cext import ExtensionStatus
from .allocator import backend as _backend
from .allocator import backend_base as _backend_base
from .allocator.backend_base import Counters
from .allocator.device_arg import DeviceLike, resolve_device
from .allocator.stats import DeviceCounters, device_name
from .base.data import to_data
from .base.present import Presented, PresentedHtml
from .base.warn import warn_once

if TYPE_CHECKING:
    from .leak_report import LeakReport

__all__ = [
    "DeviceSpan",
    "ExceptionInfo",
    "MemorySpan",
    "RawSpan",
    "SpanRecord",
    "StepSpan",
    "add_entry_hook",
    "add_exit_hook",
    "close_quiet",
    "max_allocated",
    "open_quiet",
    "remove_entry_hook",
    "remove_exit_hook",
    "set_finished_sink",
    "track",
]

P = ParamSpec("P")
R = TypeVar("R")

#: Children kept per span; more are counted in ``SpanRecord.dropped_children``.
MAX_CHILDREN = 256
#: Folded peak values kept before they are merged into the process-wide maximum.
_PEAK_INBOX = 256

_NOTHING: tuple[int, int, int] = (0, 0, 0)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class DeviceSpan(Presented):
    """What one span did on one device. Bytes are ints."""

    json_properties: ClassVar[tuple[str, ...]] = ("allocated_delta", "reserved_delta", "peak_delta")

    device: int
    #: The counters at entry (zeros for a device that appeared during the span).
    before: DeviceCounters
    #: The counters at exit.
    after: DeviceCounters
    #: Highest ``allocated`` during the span, or ``None`` when the span ran with ``peak=False``.
    peak: int | None

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry."""
        return self.after.allocated - self.before.allocated

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry."""
        return self.after.reserved - self.before.reserved

    @property
    def peak_delta(self) -> int | None:
        """Peak during the span minus allocated at entry."""
        return None if self.peak is None else self.peak - self.before.allocated


@dataclass(frozen=True, slots=True)
class ExceptionInfo(Presented):
    """An exception that left a span: its type and message, not the object.

    The exception itself is not kept: its traceback references the frames, and through them
    the tensors, that the user is trying to free.
    """

    type_name: str
    message: str
    is_oom: bool

    @classmethod
    def from_exception(cls, exc: BaseException, *, is_oom: bool) -> ExceptionInfo:
        """Describe ``exc`` without keeping it."""
        tp = type(exc)
        try:
            message = str(exc)
        except Exception:
            message = "<message unavailable>"
        return cls(f"{tp.__module__}.{tp.__qualname__}", message[:2000], is_oom)


@dataclass(frozen=True, slots=True)
class SpanRecord(PresentedHtml):
    """The frozen result of one finished span.

    ``allocated_delta``, ``reserved_delta``, ``peak`` and ``peak_delta`` sum over devices
    (``peak`` is then the sum of per-device peaks; see ``devices`` for each one). ``peak``
    and ``peak_delta`` are ``None`` for spans run with ``peak=False`` and for spans that
    measured no device (``unmeasured`` then says why; the byte deltas are then 0).
    """

    name: str
    devices: tuple[DeviceSpan, ...]
    #: Wall-clock seconds between entry and exit (cudamem's own reads excluded; with
    #: ``sync=True`` the wait for the block's GPU work is included).
    duration: float
    #: ``time.time()`` at entry.
    started_at: float
    exception: ExceptionInfo | None
    children: tuple[SpanRecord, ...]
    #: Name of the thread that closed the span.
    thread: str
    synced: bool
    peak_tracked: bool
    allocated_delta: int
    reserved_delta: int
    peak: int | None
    peak_delta: int | None
    dropped_children: int = 0
    #: Problems of cudamem's own bookkeeping (never raised into the user's code).
    notes: tuple[str, ...] = ()
    #: Why nothing was measured (``'no CUDA device'``, ``'no CUDA device in use'``), or
    #: ``None`` when ``devices`` were read.
    unmeasured: str | None = None

    @classmethod
    def build(
        cls,
        name: str,
        devices: tuple[DeviceSpan, ...],
        *,
        duration: float,
        started_at: float = 0.0,
        exception: ExceptionInfo | None = None,
        children: tuple[SpanRecord, ...] = (),
        thread: str = "MainThread",
        synced: bool = False,
        peak_tracked: bool = True,
        dropped_children: int = 0,
        notes: tuple[str, ...] = (),
        unmeasured: str | None = None,
    ) -> SpanRecord:
        """A record whose totals are computed from ``devices``."""
        alloc = res = peak = peakd = 0
        for d in devices:
            before = d.before.allocated
            alloc += d.after.allocated - before
            res += d.after.reserved - d.before.reserved
            if d.peak is not None:
                peak += d.peak
                peakd += d.peak - before
        has_peak = peak_tracked and bool(devices)
        return cls(
            name,
            devices,
            duration,
            started_at,
            exception,
            children,
            thread,
            synced,
            peak_tracked,
            alloc,
            res,
            peak if has_peak else None,
            peakd if has_peak else None,
            dropped_children,
            notes,
            unmeasured,
        )

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device (``KeyError`` if the span did not see it)."""
        index = device if isinstance(device, int) else resolve_device(device)
        for d in self.devices:
            if d.device == index:
                return d
        seen = ", ".join(device_name(d.device) for d in self.devices) or "none"
        raise KeyError(f"span {self.name!r} saw no {device_name(index)} (devices: {seen})")


# --------------------------------------------------------------------------- collection


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
        return time.time() - (_now_ns() - self.start_ns) / 1e9

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


EntryHook = Callable[[RawSpan], None]
ExitHook = Callable[[RawSpan], None]

# Process-wide state. The hot path reads the hook tuples (replaced, never mutated) and the
# registry of open peak spans (atomic dict operations) without a lock; ``_lock`` serialises
# only folds between threads and merges of the peak inbox.
_lock = threading.Lock()
_hooks_lock = threading.Lock()
#: Open spans with ``peak=True`` -> ident of the thread that opened them.
_open_peak: dict[RawSpan, int] = {}
#: Process-wide maximum per device of every peak a reset discarded.
_process_peak: dict[int, int] = {}
#: ``(device, value)`` not yet merged into ``_process_peak`` (appends are atomic).
_peak_inbox: deque[tuple[int, int]] = deque()
_entry_hooks: tuple[EntryHook, ...] = ()
#: What a span opened with ``leaks=True`` calls: ``_entry_hooks`` and the hooks registered
#: with ``leaks_only=True`` (which every other span skips without a call).
_entry_hooks_leaks: tuple[EntryHook, ...] = ()
_entry_registry: tuple[tuple[EntryHook, bool], ...] = ()
_exit_hooks: tuple[tuple[ExitHook, tuple[type[BaseException], ...]], ...] = ()
#: The exit hooks alone, what the close of a span whose block raised iterates, and those
#: a span that did not raise needs (``errors_only`` left out); rebuilt on each registration.
_exit_calls: tuple[ExitHook, ...] = ()
_exit_calls_ok: tuple[ExitHook, ...] = ()
#: Exit hooks registered with ``errors_only=True``.
_errors_only: frozenset[ExitHook] = frozenset()
#: The innermost span opened in this thread or task (its ``parent`` chain is the stack).
_top: ContextVar[RawSpan | None] = ContextVar("cudamem_span", default=None)
#: Per-thread cache of the thread's name (looked up once per thread, not once per span;
#: a thread renamed after its first span keeps its first name in records).
_tls = threading.local()
_get_ident = threading.get_ident
_now_ns = time.perf_counter_ns
_new_raw = object.__new__


#: Top-level spans closed with hooks, waiting for the consumer ``set_finished_sink`` names
#: (the span history). ``_close`` appends to it itself (atomic, no lock): the history is on
#: every span's path, where an exit hook would cost a Python call per span.
finished: deque[RawSpan] = deque()
#: Spans waiting before the closing thread calls the sink.
FINISHED_AT = 256
_finished_sink: Callable[[], None] | None = None


def set_finished_sink(sink: Callable[[], None] | None) -> None:
    """Queue every top-level span closed with hooks on ``finished`` and call ``sink()``
    whenever ``FINISHED_AT`` wait; ``sink`` takes them off (``None``: stop queueing).
    Errors of ``sink`` are swallowed (a warning says so once)."""
    global _finished_sink
    _finished_sink = sink


def _reset_state() -> None:
    """Forget folded peaks and open spans (tests start each case from here)."""
    with _lock:
        _open_peak.clear()
        _process_peak.clear()
        _peak_inbox.clear()


# -- hooks ------------------------------------------------------------------------------


def add_entry_hook(hook: EntryHook, *, leaks_only: bool = False) -> None:
    """Call ``hook(raw_span)`` when every span opens, after its entry counters are read and
    before the block runs. Errors are swallowed (a warning says so once).

    With ``leaks_only``, only spans opened with ``leaks=True`` call it, and the others do not
    pay for the call. Adding a hook that is registered already changes only its mode (it
    keeps its place in the order).
    """
    global _entry_registry
    with _hooks_lock:
        if any(h is hook for h, _ in _entry_registry):
            _entry_registry = tuple(
                (h, leaks_only if h is hook else only) for h, only in _entry_registry
            )
        else:
            _entry_registry = (*_entry_registry, (hook, leaks_only))
        _rebuild_entry_calls()


def remove_entry_hook(hook: EntryHook) -> None:
    """Undo ``add_entry_hook``."""
    global _entry_registry
    with _hooks_lock:
        _entry_registry = tuple((h, o) for h, o in _entry_registry if h is not hook)
        _rebuild_entry_calls()


def _rebuild_entry_calls() -> None:
    """Derive what opens iterate from the registry; caller holds ``_hooks_lock``."""
    global _entry_hooks, _entry_hooks_leaks
    _entry_hooks = tuple(h for h, only in _entry_registry if not only)
    _entry_hooks_leaks = tuple(h for h, _ in _entry_registry)


def add_exit_hook(
    hook: ExitHook,
    *,
    propagate: tuple[type[BaseException], ...] = (),
    errors_only: bool = False,
) -> None:
    """Call ``hook(raw_span)`` after every span closes, in registration order.

    Errors are swallowed (a warning says so once), except instances of ``propagate``: a
    warning class that the user may turn into an error (``-W error``). After every hook has
    run, the first of those is raised from the span's exit, unless the block itself raised.
    With ``errors_only``, the hook runs only for spans whose block raised (``exception`` is
    set), and the spans that did not raise do not pay for calling it.
    """
    global _exit_hooks, _errors_only
    with _hooks_lock:
        if all(h is not hook for h, _ in _exit_hooks):
            _exit_hooks = (*_exit_hooks, (hook, tuple(propagate)))
            if errors_only:
                _errors_only = _errors_only | {hook}
            _rebuild_exit_calls()


def remove_exit_hook(hook: ExitHook) -> None:
    """Undo ``add_exit_hook``."""
    global _exit_hooks, _errors_only
    with _hooks_lock:
        _exit_hooks = tuple((h, p) for h, p in _exit_hooks if h is not hook)
        _errors_only = _errors_only - {hook}
        _rebuild_exit_calls()


def _rebuild_exit_calls() -> None:
    """Derive what closes iterate from the registry; caller holds ``_hooks_lock``."""
    global _exit_calls, _exit_calls_ok
    _exit_calls = tuple(h for h, _ in _exit_hooks)
    _exit_calls_ok = tuple(h for h in _exit_calls if h not in _errors_only)


def _exit_hook_failed(
    hook: ExitHook, err: Exception, exc: BaseException | None, pending: BaseException | None
) -> BaseException | None:
    """An exit hook raised: the error to raise from the span's exit (the first warning a
    hook may propagate, unless the block itself raised), or a once-only warning."""
    for h, propagate in _exit_hooks:
        if h is hook:
            if propagate and isinstance(err, propagate):
                return pending or (err if exc is None else None)
            break
    warn_once(f"span:exit-hook{id(hook)}", f"cudamem: span exit hook failed: {err!r}", stacklevel=3)
    return pending


# -- peaks ------------------------------------------------------------------------------


def _fold_into(
    target: dict[int, int], devs: tuple[int, ...], vals: tuple[tuple[int, int, int], ...]
) -> None:
    for d, v in zip(devs, vals, strict=True):
        if v[2] > target.get(d, -1):
            target[d] = v[2]


def _only(me: int) -> bool:
    """Whether every open peak span belongs to thread ``me``."""
    owners = tuple(_open_peak.values())
    return owners.count(me) == len(owners)


def _enter_peak(span: RawSpan, backend: _backend_base.Backend, devs: tuple[int, ...]) -> None:
    """Read and reset the peak counters, folding the discarded peaks into the open spans
    (the general case; ``_open`` handles a lone span on one device itself).

    Spans of one thread fold into each other without a lock. When another thread has open
    peak spans, the reset happens under ``_lock``, after any lock-free reset already under
    way has finished, so every fold lands in exactly the spans it belongs to. The caller
    has registered ``span`` in ``_open_peak`` already: announce first, then look, and two
    threads cannot both miss each other.
    """
    me = span.owner
    if _only(me):
        vals = tuple([backend.counters_reset_peak(d) for d in devs])
        for other in tuple(_open_peak):
            if other is not span and other.owner == me:
                if other.fold is None:
                    other.fold = {}
                _fold_into(other.fold, devs, vals)
        span.armed = True
    else:
        span.solo = False
        with _lock:
            # A lock-free reset of a thread that had not seen us yet must finish first.
            while any(o.solo and not o.armed for o in tuple(_open_peak) if o is not span):
                time.sleep(0)
            vals = tuple([backend.counters_reset_peak(d) for d in devs])
            for other in tuple(_open_peak):
                if other is not span and other.armed:
                    if other.xfold is None:
                        other.xfold = {}
                    _fold_into(other.xfold, devs, vals)
            span.armed = True
    span.before = vals
    for d, v in zip(devs, vals, strict=True):
        _peak_inbox.append((d, v[2]))
    if len(_peak_inbox) > _PEAK_INBOX:
        _merge_peaks_soon()


def _merge_peaks_soon() -> None:
    """Merge the inbox unless another thread is doing it (it will take ours too)."""
    if _lock.acquire(blocking=False):
        try:
            _merge_peaks()
        finally:
            _lock.release()


def _merge_peaks() -> None:
    """Move the inbox into ``_process_peak``; caller holds ``_lock``."""
    for _ in range(len(_peak_inbox)):
        d, v = _peak_inbox.popleft()
        if v > _process_peak.get(d, -1):
            _process_peak[d] = v


def _tally(span: RawSpan) -> None:
    """The span's own peaks and its totals over devices, as plain ints (general case;
    ``_close`` handles one device seen at both edges itself)."""
    entry = dict(zip(span.devs, span.before, strict=True))
    fold, xfold = span.fold or {}, span.xfold or {}
    track_peak = span.peak
    level = alloc = res = peak_total = peakd = 0
    peaks = []
    for d, (a1, r1, p1) in zip(span.exit_devs, span.after, strict=True):
        a0, r0, _ = entry.get(d, _NOTHING)
        level += a1
        alloc += a1 - a0
        res += r1 - r0
        if track_peak:
            peak = max(p1, a0, fold.get(d, 0), xfold.get(d, 0))
            peaks.append(peak)
            peak_total += peak
            peakd += peak - a0
    span.level, span.alloc_delta, span.res_delta = level, alloc, res
    span.peaks = tuple(peaks) if track_peak else None
    if track_peak and span.after:
        span.peak_total, span.peak_delta = peak_total, peakd
    else:
        span.peak_total = span.peak_delta = None


def max_allocated(device: DeviceLike = 0) -> int:
    """The true process-wide peak of allocated bytes on ``device``.

    Use this instead of ``torch.cuda.max_memory_allocated()`` once spans with ``peak=True``
    have run: they reset PyTorch's peak counter on entry, and this function folds back
    what each reset discarded.

    Raises:
        ValueError: ``device`` is not a CUDA device of this process, or torch sees no CUDA
            device at all (then there is no allocator peak to read).
    """
    try:
        index = resolve_device(device)
    except ValueError as exc:
        raise ValueError(f"max_allocated(device={device!r}): {exc}") from None
    current = _backend.get().counters(index)[2]
    with _lock:
        _merge_peaks()
        return max(current, _process_peak.get(index, 0))


# -- open and close ---------------------------------------------------------------------


def _py_open(
    name: str,
    device: int | None,
    sync: bool,
    peak: bool,
    leaks: bool,
    nest: bool = True,
    push: bool = True,
    *,
    hooks: bool = True,
) -> RawSpan:
    """Open a span: read the counters, join this thread's (or task's) stack, run the entry
    hooks (``hooks=False``: a measurement of cudamem's own, which no feature sees, e.g. the
    pytest plugin's per-test peak). Never raises. (``_open``: this, or the compiled span
    core's ``open`` once it is active, which hands every case but the common one here.)"""
    span = _new_raw(RawSpan)  # no __init__: the stores below are the constructor
    span.name = name
    span.device = device
    span.sync = sync
    span.peak = peak
    span.leaks = leaks
    span.parent = span.children = span.extras = span.fold = span.xfold = span._record = None
    span.closed = False
    try:
        backend = _backend._active
        devs: tuple[int, ...]
        if device is not None:
            devs = span.devs = (device,)
        else:
            devs = span.devs = backend.settled_devices or backend.initialized_devices()
        if sync:
            for d in devs:
                backend.synchronize(d)
        if peak:
            me = span.owner = _get_ident()
            span.solo = True
            span.armed = False
            _open_peak[span] = me  # announce (see _enter_peak)
            if len(devs) == 1:
                alone = len(_open_peak) == 1
                if alone or _only(me):  # one device, one thread
                    d = devs[0]
                    fast = backend.fast_reset  # the C++ reader, called without a frame
                    if fast is None:
                        values = backend.counters_reset_peak(d)
                    else:
                        try:
                            values = fast(d)
                        except Exception:  # the method's own fallback answers (or raises)
                            values = backend.counters_reset_peak(d)
                    span.before = (values,)
                    span.armed = True
                    discarded = values[2]
                    if not alone:  # fold into this thread's open spans
                        for other in tuple(_open_peak):
                            if other is not span and other.owner == me:
                                fold = other.fold
                                if fold is None:
                                    other.fold = {d: discarded}
                                elif discarded > fold.get(d, -1):
                                    fold[d] = discarded
                    if discarded > _process_peak.get(d, -1):  # else it cannot raise the max
                        _peak_inbox.append((d, discarded))
                        if len(_peak_inbox) > _PEAK_INBOX:
                            _merge_peaks_soon()
                else:
                    _enter_peak(span, backend, devs)
            else:
                _enter_peak(span, backend, devs)
        elif len(devs) == 1:
            span.before = (backend.counters(devs[0]),)
        else:
            span.before = tuple([backend.counters(d) for d in devs])
    except Exception as exc:  # cudamem's bookkeeping must never break the user's code
        _entry_failed(span, exc)
    if nest:
        parent = _top.get()
        if parent is not None:
            if parent.closed:
                parent = _live(parent)
            span.parent = parent
        if push:
            _top.set(span)
    if hooks:
        for hook in _entry_hooks_leaks if leaks else _entry_hooks:
            try:
                hook(span)
            except Exception as err:
                _entry_hook_failed(hook, err)
    span.start_ns = _now_ns()
    if _core_pending and span.devs:  # a span with a device to read: the core can serve
        _core_poll()
    return span


# The rare branches of an open and a close, one home for both paths (the compiled span
# core calls them too).


def _entry_failed(span: RawSpan, exc: Exception) -> None:
    """The entry measurement raised: the span is measured by nothing and says why."""
    _open_peak.pop(span, None)
    span.armed, span.before, span.devs = True, (), ()
    span.note(f"entry measurement failed: {type(exc).__name__}: {exc}")
    warn_once("span:enter", f"cudamem: span entry measurement failed: {exc!r}", stacklevel=3)


def _entry_hook_failed(hook: EntryHook, err: Exception) -> None:
    warn_once(
        f"span:entry-hook{id(hook)}", f"cudamem: span entry hook failed: {err!r}", stacklevel=3
    )


def _wait_folds() -> None:
    """Wait until a fold of another thread that may be writing into a span has finished."""
    with _lock:
        pass


def _exception_info(exc: BaseException, backend: _backend_base.Backend) -> ExceptionInfo:
    return ExceptionInfo.from_exception(exc, is_oom=backend.is_oom(exc))


def _thread_name() -> str:
    """This thread's name, looked up once per thread (``_tls`` keeps it)."""
    name: str = threading.current_thread().name
    _tls.name = name
    return name


def _drain_finished() -> None:
    """Hand the queue of finished spans to its consumer (errors: a warning, once)."""
    sink = _finished_sink
    if sink is not None:
        try:
            sink()
        except Exception as err:
            warn_once("span:finished", f"cudamem: span history failed: {err!r}")


def _close_failed(span: RawSpan, err: Exception) -> None:
    """The last line of defence of a close: the span ends closed, with every field set."""
    span.closed = True
    _open_peak.pop(span, None)
    for field, empty in _EXIT_FIELDS:
        if not hasattr(span, field):
            setattr(span, field, empty)
    warn_once("span:exit-outer", f"cudamem: span bookkeeping failed: {err!r}", stacklevel=3)


def _py_close(
    span: RawSpan,
    exc: BaseException | None,
    keeper: MemorySpan | None = None,
    *,
    hooks: bool = True,
) -> None:
    """Close a span: read the counters, leave the stack, hand the span to its parent or
    to the exit hooks. The hooks' per-span data moves to ``keeper`` (or is dropped), so
    the history never keeps it. Raises only a warning an exit hook may propagate
    (``-W error``)."""
    if span.closed:
        return
    pending: BaseException | None = None
    try:
        backend = _backend._active
        span.end_ns = _now_ns()
        after: tuple[tuple[int, int, int], ...]
        try:
            devs = span.devs
            device = span.device
            if device is None:
                if devs is not backend.settled_devices:
                    now = backend.initialized_devices()
                    if now is not devs and now != devs:
                        # A device appeared during the span (or none was in use at entry).
                        devs = tuple(sorted(set(now) | set(devs))) if devs else now
            elif not devs:  # the entry measurement failed
                devs = (device,)
            if span.sync:
                try:
                    for d in devs:
                        if span.device is not None or backend.has_context(d):
                            backend.synchronize(d)
                finally:
                    span.end_ns = _now_ns()
            span.exit_devs = devs
            if len(devs) == 1:
                fast = backend.fast_counters
                if fast is None:
                    after = span.after = (backend.counters(devs[0]),)
                else:
                    try:
                        after = span.after = (fast(devs[0]),)
                    except Exception:
                        after = span.after = (backend.counters(devs[0]),)
            elif devs:
                after = span.after = tuple([backend.counters(d) for d in devs])
            else:
                after = span.after = ()
                span.unmeasured = (
                    "no CUDA device" if backend.device_count() == 0 else "no CUDA device in use"
                )
        except Exception as err:
            span.exit_devs = after = span.after = ()
            span.unmeasured = "measurement failed"
            span.note(f"exit measurement failed: {type(err).__name__}: {err}")
            warn_once("span:exit", f"cudamem: span exit measurement failed: {err!r}", stacklevel=3)
        peak = span.peak
        if peak:
            _open_peak.pop(span, None)
            if _open_peak and not _only(_get_ident()):
                _wait_folds()  # a fold of another thread may still be writing into this span
        if len(after) == 1 and devs is span.devs:  # one device at both edges
            a0, r0, _ = span.before[0]
            a1, r1, p1 = after[0]
            span.level = a1
            span.alloc_delta = a1 - a0
            span.res_delta = r1 - r0
            if peak:
                top = p1 if p1 > a0 else a0
                if span.fold is not None or span.xfold is not None:
                    d = span.devs[0]
                    top = max(top, (span.fold or {}).get(d, 0), (span.xfold or {}).get(d, 0))
                    span.fold = span.xfold = None
                span.peak_total = top  # ``peaks`` is then ``(peak_total,)``, left unstored
                span.peak_delta = top - a0
            else:
                span.peak_total = span.peak_delta = None
        else:
            _tally(span)
            span.fold = span.xfold = None
        span.exception = None if exc is None else _exception_info(exc, backend)
        try:
            span.thread = _tls.name
        except AttributeError:
            span.thread = _thread_name()
        span.closed = True
        parent = span.parent
        if parent is not None and parent.closed:
            parent = _live(parent)
        if _top.get() is span:
            _top.set(parent)
        if parent is not None:
            span.top_level = False
            children = parent.children
            if children is None:
                parent.children = [span]
            elif len(children) < MAX_CHILDREN:
                children.append(span)
            else:
                parent.dropped = getattr(parent, "dropped", 0) + 1
        else:
            span.top_level = True
            if span.parent is not None or span.children:
                _unlink(span)
            if hooks and _finished_sink is not None:
                finished.append(span)
                if len(finished) >= FINISHED_AT:
                    _drain_finished()
        for hook in () if not hooks else _exit_calls_ok if exc is None else _exit_calls:
            try:
                hook(span)
            except Exception as err:
                pending = _exit_hook_failed(hook, err, exc, pending)
    except Exception as err:  # pragma: no cover - last line of defence
        _close_failed(span, err)
    extras = span.extras
    if extras is not None:
        if keeper is not None:
            keeper._extras = extras
        span.extras = None
    if pending is not None:
        raise pending


#: What a close sets, with the value a close that failed half-way leaves.
_EXIT_FIELDS: tuple[tuple[str, Any], ...] = (
    ("exit_devs", ()),
    ("after", ()),
    ("level", 0),
    ("alloc_delta", 0),
    ("res_delta", 0),
    ("peaks", None),
    ("peak_total", None),
    ("peak_delta", None),
    ("exception", None),
    ("thread", ""),
    ("top_level", False),
)


def _unlink(top: RawSpan) -> None:
    """Drop the parent pointers of a top-level span's subtree: every ancestor is closed for
    good, so no later walk can need them, and child <-> parent would otherwise be a
    reference cycle left for the garbage collector in every nested span."""
    top.parent = None
    pending = [top]
    while pending:
        children = pending.pop().children
        if children:
            for child in children:
                child.parent = None
                pending.append(child)


def _live(span: RawSpan | None) -> RawSpan | None:
    """``span`` or its nearest ancestor still open."""
    while span is not None and span.closed:
        span = span.parent
    return span


# -- the compiled span core ---------------------------------------------------------------


class _OpenFn(Protocol):
    def __call__(
        self,
        name: str,
        device: int | None,
        sync: bool,
        peak: bool,
        leaks: bool,
        nest: bool = ...,
        push: bool = ...,
        *,
        hooks: bool = ...,
    ) -> RawSpan: ...


class _CloseFn(Protocol):
    def __call__(
        self,
        span: RawSpan,
        exc: BaseException | None,
        keeper: MemorySpan | None = ...,
        *,
        hooks: bool = ...,
    ) -> None: ...


#: What every span opens and closes with: the Python functions above, until the compiled
#: span core (``_spancore.c``) is active; then the ``open``/``close`` of its state for this
#: module (``_core_check``), which do the common case (one device, no synchronize) in C and
#: hand every other to ``_py_open``/``_py_close``.
_open: _OpenFn = _py_open
_close: _CloseFn = _py_close
#: Whether the next Python open asks the span core's build again (until it is settled).
_core_pending = True

_MISSING = object()
#: The fields a span's open and close set, compared between the two paths by the check.
_CHECKED = (
    "name",
    "device",
    "sync",
    "peak",
    "leaks",
    "parent",
    "children",
    "closed",
    "devs",
    "exit_devs",
    "top_level",
    "exception",
    "thread",
    "peak_total",
    "peak_delta",
    "extras",
)


def _core_poll() -> None:
    """One step of the span core's life, at a Python open that read a device (without one,
    as on a machine without CUDA, the core would hand every span back: nothing is built):
    start its build (first call), and once it is built, check it and switch to it. Never
    waits for a compiler."""
    global _core_pending
    ext = _spancore.EXTENSION
    module = ext.native()
    if module is None:
        if ext.settled():
            _core_pending = False
        return
    _core_pending = False
    problem = _use_core(module)
    if problem is not None:
        ext.drop(problem)


def _use_core(module: Any) -> str | None:
    """Open and close every span through ``module`` (the compiled core; ``None``: the
    Python functions), or say why it cannot serve (then nothing changes). The core serves
    through a state of this module's own (``_core_check``), which the functions installed
    here hold: another ``cudamem.span`` in the process (a reload) has its own."""
    global _open, _close, _make_span, _columns
    if module is None:
        _open, _close, _make_span, _columns = _py_open, _py_close, _py_make_span, None
        MemorySpan.__enter__ = _py_span_enter  # type: ignore[method-assign]
        MemorySpan.__exit__ = _py_span_exit  # type: ignore[method-assign]
        return None
    core = _core_check(module)
    if isinstance(core, str):
        return core
    _open, _close, _make_span, _columns = core.open, core.close, core.make, core.columns
    MemorySpan.__enter__, MemorySpan.__exit__ = core.enter, core.exit  # type: ignore[method-assign]
    return None


def span_core_status(wait: float = 0.0) -> ExtensionStatus:
    """Which path opens and closes spans, the compiled span core or Python, and why.

    ``wait``: seconds to wait for the core's build first and then switch to it, as the first
    span after a build does (``cudamem status``); by default the state as it is now."""
    if wait > 0:
        _spancore.EXTENSION.wait(wait)
        if _core_pending:
            _core_poll()
    return _spancore.status()


@contextlib.contextmanager
def _serving(module: Any) -> Iterator[None]:
    """Within the block every span opens and closes through ``module`` (the compiled core;
    ``None``: the Python functions), and no poll switches it; afterwards what served
    before serves again (tests and benchmarks compare the two paths with it)."""
    global _open, _close, _make_span, _columns, _core_pending
    saved = (
        _open,
        _close,
        _make_span,
        _columns,
        MemorySpan.__dict__["__enter__"],
        MemorySpan.__dict__["__exit__"],
        _core_pending,
    )
    problem = _use_core(module)
    if problem is not None:
        raise RuntimeError(problem)
    _core_pending = False
    try:
        yield
    finally:
        _open, _close, _make_span, _columns, enter, exit_, _core_pending = saved
        MemorySpan.__enter__, MemorySpan.__exit__ = enter, exit_  # type: ignore[method-assign]


class _Core(Protocol):
    """The compiled core's state for one span module (``init``'s answer): its functions
    read that module's globals and make its types' spans."""

    open: _OpenFn
    close: _CloseFn
    make: Callable[[str | None, bool, bool, bool], MemorySpan]
    columns: Callable[[list[RawSpan]], tuple[int, ...] | None]
    #: ``MemorySpan.__enter__``/``__exit__`` through the core (method descriptors).
    enter: Any
    exit: Any


def _core_check(module: Any) -> _Core | str:
    """The compiled core's state for this module, or why it cannot serve: ``module.init``
    takes this module's globals and types, and a quiet span (no peak, no stack, no hooks)
    through the state has the fields and arithmetic a span through the Python path has."""
    try:
        core: _Core = module.init(globals(), vars(_backend), RawSpan, MemorySpan)
        backend = _backend._active
        device = 0 if backend.device_count() > 0 else None
        spans = []
        for opener, closer in ((_py_open, _py_close), (core.open, core.close)):
            raw = opener("cudamem-check", device, False, False, False, False, False, hooks=False)
            closer(raw, None, hooks=False)
            spans.append(raw)
        for field in _CHECKED:
            ours, theirs = (getattr(raw, field, _MISSING) for raw in spans)
            if ours != theirs:
                return f"the compiled span core's {field} differs ({theirs!r}, not {ours!r})"
        for raw in spans:
            if raw.after and raw.alloc_delta != raw.after[0][0] - raw.before[0][0]:
                return "the compiled span core's allocated delta is not after - before"
        return core
    except Exception as exc:
        return f"the compiled span core failed its check: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- public API


class MemorySpan(PresentedHtml):
    """A measured region of code: a context manager, a decorator, and after exit its result.

    ``with cudamem.MemorySpan("step") as span: ...`` then ``span.allocated_delta``,
    ``span.reserved_delta``, ``span.peak``, ``span.peak_delta``, ``span.duration``,
    ``span.devices``, ``span.exception``, ``span.children``. Reading a result before the span
    has closed raises ``RuntimeError``. A span object measures one block: entering it a second
    time raises ``RuntimeError`` (create a new span, or decorate a function, which records one
    span per call). It may be closed on another thread than the one that opened it.
    """

    __slots__ = (
        "__weakref__",
        "_detached",
        "_device",
        "_extras",
        "_leaks",
        "_name",
        "_peak",
        "_raw",
        "_sync",
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        device: DeviceLike | None = None,
        sync: bool = False,
        peak: bool = True,
        leaks: bool = False,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"span name must be a str, not {type(name).__name__}")
        self._name = name
        self._device = None if device is None else resolve_device(device)
        self._sync = bool(sync)
        self._peak = bool(peak)
        self._leaks = bool(leaks)
        #: 0: on the span stack; 1: detached (``StepSpan``); 2: detached, no hooks.
        self._detached = 0
        self._raw: RawSpan | None = None
        #: The hooks' per-span data, kept after exit (``leaks=True`` captures).
        self._extras: dict[str, Any] | None = None

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> MemorySpan:
        if self._raw is not None:
            self._refuse_reentry()
        if self._detached:
            self._raw = _open(
                self._name or "span",
                self._device,
                self._sync,
                self._peak,
                self._leaks,
                False,
                False,
                hooks=self._detached == 1,
            )
        else:
            self._raw = _open(
                self._name or "span", self._device, self._sync, self._peak, self._leaks
            )
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        raw = self._raw
        if raw is not None:
            _close(raw, exc, self)  # a span closed already (elsewhere) is left alone

    def _refuse_reentry(self) -> None:
        raw = self._raw
        if raw is not None and not raw.closed:
            raise RuntimeError(f"span {self.name!r} is already open; spans cannot be re-entered")
        raise RuntimeError(
            f"span {self.name!r} has already measured a block; create a new span "
            "(or decorate a function to record one span per call)"
        )

    # -- decorator ------------------------------------------------------------------

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Decorate ``func``: every call records its own span named like this one.

        Generator and async-generator functions stay what they are, and their span covers
        the whole iteration (from the first ``next()`` to exhaustion or ``close()``); spans
        opened inside the generator nest under it, spans the consumer opens between items do
        not. ``staticmethod`` and ``classmethod`` objects are unwrapped and rewrapped.
        """
        if isinstance(func, (staticmethod, classmethod)):
            return cast(Callable[P, R], self._rewrap(func))
        if isinstance(func, type):
            raise TypeError(
                f"cudamem.track cannot decorate a class ({func.__qualname__}): decorate its "
                "methods, or wrap the code in `with cudamem.track(...)`"
            )
        if not callable(func):
            raise TypeError(
                f"cudamem.track used as a decorator on a non-callable {type(func).__name__}"
            )
        qualname = getattr(func, "__qualname__", None)
        name = self._name or (qualname if isinstance(qualname, str) else type(func).__qualname__)
        opts = (name, self._device, self._sync, self._peak, self._leaks)
        if inspect.isasyncgenfunction(func):
            return cast(Callable[P, R], _wrap_async_generator(func, opts))
        if inspect.isgeneratorfunction(func):
            return cast(Callable[P, R], _wrap_generator(func, opts))
        if inspect.iscoroutinefunction(func):
            return cast(Callable[P, R], _wrap_coroutine(func, opts))

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            span = _open(*opts)
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                _close(span, exc)
                raise
            _close(span, None)
            return result

        return wrapper

    def _rewrap(self, method: staticmethod[Any, Any] | classmethod[Any, Any, Any]) -> Any:
        """``method``'s function decorated, in a new object of ``method``'s own type; a
        ``TypeError`` saying where ``@cudamem.track`` goes when that cannot be done."""
        kind = type(method).__name__
        hint = f"put @cudamem.track under @{kind}, directly on the function"
        inner = method.__func__
        if not callable(inner) or isinstance(inner, (staticmethod, classmethod)):
            raise TypeError(
                f"cudamem.track cannot decorate a {kind} of a {type(inner).__name__}: {hint}"
            )
        try:
            rebuilt = type(method)(self(inner))
        except Exception as exc:
            raise TypeError(f"cudamem.track cannot rebuild this {kind} ({exc}): {hint}") from exc
        if not isinstance(rebuilt, type(method)) or not callable(rebuilt.__func__):
            raise TypeError(f"cudamem.track cannot rebuild this {kind}: {hint}")
        return rebuilt

    # -- results --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The span's name (``'span'`` when none was given)."""
        return self._name or "span"

    @property
    def closed(self) -> bool:
        """Whether the span has measured its block."""
        return self._raw is not None and self._raw.closed

    @property
    def record(self) -> SpanRecord:
        """The frozen result (raises ``RuntimeError`` while the span is open or unused)."""
        raw = self._raw
        if raw is None or not raw.closed:
            state = "not entered yet" if raw is None else "still open"
            raise RuntimeError(f"span {self.name!r} is {state}; its results exist after exit")
        return raw.record()

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry (summed over devices; 0 if none measured)."""
        return self.record.allocated_delta

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry (summed over devices; 0 if none measured)."""
        return self.record.reserved_delta

    @property
    def peak(self) -> int | None:
        """Highest allocated during the span; ``None`` with ``peak=False`` or when no device
        was measured (no CUDA device)."""
        return self.record.peak

    @property
    def peak_delta(self) -> int | None:
        """Peak minus allocated at entry; ``None`` when ``peak`` is."""
        return self.record.peak_delta

    @property
    def duration(self) -> float:
        """Seconds the block ran."""
        return self.record.duration

    @property
    def devices(self) -> tuple[DeviceSpan, ...]:
        """Per-device results: devices with a context at entry or exit (or the named one)."""
        return self.record.devices

    @property
    def exception(self) -> ExceptionInfo | None:
        """The exception that left the block, described (``is_oom`` for out of memory)."""
        return self.record.exception

    @property
    def children(self) -> tuple[SpanRecord, ...]:
        """Spans that opened and closed inside this one, on the same thread or task."""
        return self.record.children

    @property
    def leaks(self) -> LeakReport:
        """Storages created inside the block and still alive at its exit, with holders.

        Needs ``leaks=True``; ``cudamem.leaks(since=span)`` asks again later.
        """
        report: LeakReport | None = self._leak_capture().report
        if report is None:  # pragma: no cover - explicit captures always carry a report
            raise RuntimeError(f"span {self.name!r} has no leak report")
        return report

    def _leak_capture(self) -> Any:
        """What the leaks hook captured for this span (``ValueError`` without ``leaks=True``)."""
        self.record  # noqa: B018 - raises while the span is open or unused
        capture = None if self._extras is None else self._extras.get("leaks")
        if not self._leaks or capture is None:
            raise ValueError(
                f"span {self.name!r} did not record storages: use "
                f"cudamem.track({self.name!r}, leaks=True)"
            )
        return capture

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device."""
        return self.record.device(device)

    def to_dict(self) -> dict[str, Any]:
        """The finished span's ``SpanRecord`` as JSON data (``render.json.to_data``)."""

        data: dict[str, Any] = to_data(self.record)
        return data

    def __str__(self) -> str:
        raw = self._raw
        if raw is None or not raw.closed:
            return f"{self.name}: {'not entered' if raw is None else 'open'}"
        return str(raw.record())

    def __repr__(self) -> str:
        return f"<MemorySpan {self}>"


#: MemorySpan's ``with`` methods in Python: while the compiled core serves, its methods
#: replace them and hand these a span entered twice or a detached one.
_py_span_enter = MemorySpan.__enter__
_py_span_exit = MemorySpan.__exit__

_Opts = tuple[str, "int | None", bool, bool, bool]
_new_span = object.__new__


def _wrap_coroutine(func: Callable[..., Awaitable[Any]], opts: _Opts) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        span = _open(*opts)
        try:
            result = await func(*args, **kwargs)
        except BaseException as exc:
            _close(span, exc)
            raise
        else:
            _close(span, None)
        return result

    return wrapper


class _Within:
    """A generator resumed with a span as this thread's (or task's) innermost span:
    ``yield from`` delegates ``send``, ``throw`` and ``close`` here."""

    __slots__ = ("gen", "span")

    def __init__(self, gen: Any, span: RawSpan) -> None:
        self.gen = gen
        self.span = span

    def __iter__(self) -> _Within:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def _resume(self, step: Callable[..., Any], *args: Any) -> Any:
        token = _top.set(self.span)
        try:
            return step(*args)
        finally:
            _top.reset(token)

    def send(self, value: Any) -> Any:
        return self._resume(self.gen.send, value)

    def throw(self, *exc: Any) -> Any:
        return self._resume(self.gen.throw, *exc)

    def close(self) -> None:
        self._resume(self.gen.close)


def _wrap_generator(func: Callable[..., Iterator[Any]], opts: _Opts) -> Callable[..., Any]:
    """A generator function whose one span covers the whole iteration.

    The span is this thread's innermost only while the generator's own code runs (around
    each ``send``/``throw``/``close``), so the consumer's spans between items do not nest
    under it. A consumer that stops early (``close()``) ends the span without an error.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        within = _Within(func(*args, **kwargs), _open(*opts, True, False))
        failure: BaseException | None = None
        try:
            return (yield from within)
        except GeneratorExit:
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _close(within.span, failure)

    return wrapper


def _wrap_async_generator(
    func: Callable[..., AsyncIterator[Any]], opts: _Opts
) -> Callable[..., Any]:
    """The async-generator form of ``_wrap_generator``."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen: Any = func(*args, **kwargs)
        span = _open(*opts, True, False)
        failure: BaseException | None = None
        try:
            sent: Any = None
            thrown: BaseException | None = None
            while True:
                token = _top.set(span)
                try:
                    if thrown is not None:
                        item = await agen.athrow(thrown)
                    else:
                        item = await agen.asend(sent)
                except StopAsyncIteration:
                    return
                finally:
                    thrown = None
                    _top.reset(token)
                try:
                    sent = yield item
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    thrown = exc
        except GeneratorExit:
            token = _top.set(span)
            try:
                await agen.aclose()
            finally:
                _top.reset(token)
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _close(span, failure)

    return wrapper


class StepSpan:
    """A step measured by calls where no ``with`` block fits: the span between two
    optimizer steps (``cudamem run``), a trainer's step callbacks (Lightning,
    Transformers), a pytest test's peak.

    ``start()`` opens a new ``MemorySpan`` and returns it; ``stop(exc)`` closes it (with the
    exception that ended the step, if any, so that an out-of-memory error gets its
    post-mortem as in any ``track()`` block) and returns it, measured; ``drop()`` forgets it
    unrecorded. The span is detached from the span stack: spans the code opens meanwhile
    stay top-level and keep their own history and growth detection. ``hooks=False``: a
    measurement of cudamem's own that no feature sees (no history, no growth detection).
    """

    __slots__ = ("_device", "_hooks", "_name", "_peak", "_span", "_sync")

    def __init__(
        self,
        name: str,
        *,
        device: DeviceLike | None = None,
        sync: bool = False,
        peak: bool = True,
        hooks: bool = True,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"step span name must be a str, not {type(name).__name__}")
        self._name = name
        self._device = None if device is None else resolve_device(device)
        self._sync = bool(sync)
        self._peak = bool(peak)
        self._hooks = bool(hooks)
        self._span: MemorySpan | None = None

    @property
    def running(self) -> bool:
        """Whether a step is open."""
        return self._span is not None

    def start(self) -> MemorySpan:
        """Open a step (``RuntimeError`` while one is open: ``stop()`` it first)."""
        if self._span is not None:
            raise RuntimeError(f"step span {self._name!r} is running; stop() it first")
        span = MemorySpan(self._name, device=self._device, sync=self._sync, peak=self._peak)
        span._detached = 1 if self._hooks else 2
        span.__enter__()
        self._span = span
        return span

    def stop(self, exc: BaseException | None = None) -> MemorySpan | None:
        """Close the open step (``None`` when none is open) and return it."""
        span, self._span = self._span, None
        if span is not None and span._raw is not None:
            _close(span._raw, exc, span, hooks=self._hooks)
        return span

    def drop(self) -> None:
        """Forget the open step without recording it."""
        self._span = None


def open_quiet(name: str, device: int | None = None) -> RawSpan:
    """Open a detached span with a peak, seen by no feature (no history, no growth
    detection, no OOM post-mortem): a measurement of cudamem's own, the per-module
    profile's (``cudamem.modules``) one per module call, ``cudamem.plan``'s one per probe
    step (on its ``device``; by default every device in use). Its peak folds into every open
    span and theirs into it, as any span's does. Close it with ``close_quiet``; then read
    ``alloc_delta``, ``peak_delta``, ``peak_total``, ``level`` and ``duration`` (plain ints
    summed over devices; the peaks are ``None`` when no device was measured). Never raises."""
    return _open(name, device, False, True, False, False, False, hooks=False)


def close_quiet(span: RawSpan, exc: BaseException | None = None) -> None:
    """Close a span of ``open_quiet`` (a closed one is left alone). Never raises."""
    _close(span, exc, hooks=False)


@overload
def track(name: Callable[P, R]) -> Callable[P, R]: ...


@overload
def track(
    name: str | None = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = False,
    peak: bool = True,
    leaks: bool = False,
) -> MemorySpan: ...


def track(
    name: Any = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = False,
    peak: bool = True,
    leaks: bool = False,
) -> Any:
    """Measure a block or a function: ``with cudamem.track("step") as span:``,
    ``@cudamem.track`` or ``@cudamem.track("fwd")``.

    Args:
        name: the span's name; a function when used as a bare decorator.
        device: measure only this device (``0``, ``'cuda:1'``); by default every device
            that has a CUDA context at entry or exit. Naming a device allows cudamem to
            synchronize it even if that creates its context.
        sync: synchronize the devices at both edges, so that ``span.duration`` includes
            the GPU time of the block's kernels. The byte counts do not need it: the
            allocator's counters change when the CPU queues an allocation or a free, not
            when the GPU runs it, so a read without synchronize equals the read right after
            one. The default ``False`` leaves CPU/GPU overlap alone.
        peak: track the highest allocated during the span. This resets PyTorch's
            per-device peak counter on entry; use ``cudamem.max_allocated`` for the
            process-wide peak. ``False`` leaves the counter alone (``span.peak`` is None).
        leaks: record which storages exist at entry and exit, so that ``span.leaks`` lists
            those created inside the block and still alive after it, with their holders
            (and ``cudamem.leaks(since=span)`` asks again later). This runs the census twice
            per call: for investigating, not for every step of a long run.

    Generator and async-generator functions are measured over their whole iteration;
    ``staticmethod``/``classmethod`` objects may be decorated. Cost: see the guide's
    "Cost" section (``benchmarks/span_overhead.py`` measures it).
    """
    if name is not None and not isinstance(name, str):
        if callable(name) or isinstance(name, (staticmethod, classmethod)):
            return MemorySpan(None, device=device, sync=sync, peak=peak, leaks=leaks)(name)
        raise TypeError(
            f"cudamem.track() takes a span name (str) or a function to decorate, "
            f"not {type(name).__name__}"
        )
    if device is None:  # the hot form, ``with track("step"):``, skips re-validation
        return _make_span(name, sync, peak, leaks)
    return MemorySpan(name, device=device, sync=sync, peak=peak, leaks=leaks)


def _py_make_span(name: str | None, sync: bool, peak: bool, leaks: bool) -> MemorySpan:
    """``track(name)``'s span, its fields stored without ``__init__``'s checks (``track``
    made them); ``_make_span`` is this, or the compiled core's ``make`` while it serves."""
    span = _new_span(MemorySpan)
    span._name = name
    span._device = span._raw = span._extras = None
    span._detached = 0
    span._sync, span._peak, span._leaks = bool(sync), bool(peak), bool(leaks)
    return span


_make_span: Callable[[str | None, bool, bool, bool], MemorySpan] = _py_make_span
#: The compiled core's fold of a batch of closed spans into the history's sums and maxima
#: (``columns(spans)``, ``None`` for a batch it does not read), while the core serves.
_columns: Callable[[list[RawSpan]], tuple[int, ...] | None] | None = None
