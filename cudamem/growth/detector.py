"""Leaks as they happen: growth across repeated spans, and what a span left behind.

**Growth detection.** Every span name that repeats (a training step, a validation batch) is
a series: cudamem notes the allocated level (summed over the span's devices) at each exit.
The level must *keep* rising before anyone is told:

* the first ``warmup`` calls are not judged: the level at the end of the warm-up is the
  baseline (optimizer state, cuBLAS workspaces and the cache appear on the first step);
* a call *rises* when the level at its exit is at least ``min_bytes_per_call`` above the
  previous call's exit level *and* the call itself ended with at least that much more
  allocated than it started with (smaller moves are allocator noise: a scalar per step, a
  logger's bounded buffer; growth made by other code between two calls is not this span's);
* growth is *sustained* when at least ``min_rises`` of the last ``window`` calls rose and
  the robust slope of the window's levels from its first rise on (Theil–Sen: the median of
  the pairwise slopes, so one outlier call cannot fake or hide a trend) is at least
  ``min_bytes_per_call``. That slope is the reported per-call figure.

Steady state costs a few comparisons per span exit. The census runs only on suspicion: once
``min_rises - 1`` calls of the window rose, the *next* call is captured (which storages exist
at its entry and exit), and one call later the storages it created that are still alive
(they survived a whole further call, so a step's return value kept until the next step does
not count) are its *survivors*. Storages are compared by identity (a weak reference to each
StorageImpl, ``cudamem.holders._storages``), never by address: a gradient freed by
``zero_grad(set_to_none=True)`` and re-created at the same address is a new storage.

A ``LeakWarning`` (also sent to the ``cudamem.leaks`` logger) needs both a sustained
slope and survivors that explain it: their bytes must be at least ``min_explained`` (half)
of the per-call growth. Growth that no surviving storage accounts for (the allocator's
cache, workspaces, memory made outside the span) is not a leak of live tensors: cudamem
looks at up to three consecutive calls (a leak every other call shows in one of them),
then stays silent but for a ``logging.debug`` line, and captures nothing of that span for a
window of calls, then two, four, ... up to 32 windows while such episodes repeat. The
survivors are named through ``who_holds`` and grouped by container (``cudamem.holders.culprits``).
The warning repeats only when the picture changes: other holders, or a per-call rate
``rate_change`` times higher or lower than the one last reported (a rate change starts a new
window, so the new rate is measured on its own).

This module keeps the series and their state machine, and the span hooks that feed them.
Beside it, one job each: the slope (``_trend``), a span's capture of the storages it
created (``_capture``: also ``leaks=True``'s report), what explains a growth
(``_explained``: holders, cuBLAS workspaces) and the telling of it (``_warn``: the hooks
integrations add, the ``LeakWarning``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from ..base.format import format_bytes
from ..holders.census import StorageSnapshot
from ..holders.culprits import Culprit
from ..spans.state import add_entry_hook, add_exit_hook
from . import _trend
from ._capture import begin, end
from ._explained import name_culprits, workspace_notes
from ._warn import emit
from .report import Growth
from .settings import LeakSettings, LeakWarning, _validate

if TYPE_CHECKING:
    from ..spans.raw import RawSpan

__all__ = ["configure_leaks", "leak_settings"]


logger = logging.getLogger("cudamem.leaks")


#: Distinct span names watched; further names are not watched (bounded memory).
MAX_SERIES = 1000


#: Consecutive calls looked at for survivors before a slope they do not explain is let go.
MAX_ATTEMPTS = 3


_settings = LeakSettings()


def leak_settings() -> LeakSettings:
    """The settings in force."""
    return _settings


def configure_leaks(**changes: Any) -> LeakSettings:
    """Change growth-detection settings (any field of ``LeakSettings``); returns them.

    ``cudamem.configure_leaks(min_bytes_per_call=1024**2, window=16)``. Unknown names raise
    ``TypeError``, bad values ``ValueError``; series already watched restart with the new
    rule. ``configure_leaks()`` with no argument restores the defaults.
    """
    global _settings
    known = {f.name for f in fields(LeakSettings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(
            f"unknown leak {'setting' if len(unknown) == 1 else 'settings'} {unknown}; "
            f"known: {sorted(known)}"
        )
    new = replace(_settings, **changes) if changes else LeakSettings()
    _validate(new)
    _settings = new
    _detector.reset()
    return new


_WATCH, _ARMED, _PENDING, _CHECKING, _LEAKING = range(5)


#: Span names whose next call the detector wants captured. Replaced, never mutated, so the
#: entry hook reads it without a lock.
_armed: frozenset[str] = frozenset()


class _Series:
    """The exit levels of one span name and where its investigation stands."""

    __slots__ = (
        "armed_exits",
        "attempts",
        "calls",
        "captured",
        "checked_rate",
        "cooldown",
        "hold",
        "inbox",
        "last",
        "levels",
        "pending",
        "phase",
        "quiet",
        "rises",
        "steady",
        "warned",
    )

    def __init__(self, window: int) -> None:
        #: Watching with no rise in the window: a call that did not grow by the threshold
        #: itself cannot change anything but the levels and the countdowns, so its exit only
        #: appends its level to ``inbox`` (atomic, no lock); the next locked step folds the
        #: inbox in first. Set and cleared under the detector's lock only.
        self.steady = False
        self.inbox: deque[int] = deque()
        self.calls = 0
        self.last = 0
        self.levels: deque[int] = deque(maxlen=window + 1)
        self.rises: deque[bool] = deque(maxlen=window)
        self.phase = _WATCH
        self.armed_exits = 0
        self.cooldown = 0
        #: The capture of the call that just ended (set by ``end`` before exit hooks).
        self.captured: StorageSnapshot | None = None
        #: The capture whose survivors are checked at the next exit.
        self.pending: StorageSnapshot | None = None
        #: Captured calls already found not to explain the growth, this episode.
        self.attempts = 0
        self.checked_rate = 0.0
        #: Episodes in a row whose growth no survivors explained, and the calls left before
        #: another capture may be armed (doubling each time: a slope that is the allocator's
        #: cache must not keep the census running).
        self.quiet = 0
        self.hold = 0
        #: (holder groups, per-call rate) of the last warning.
        self.warned: tuple[frozenset[str], float] | None = None


#: Levels the lock-free path queues per series before the exiting thread drains them.
_SERIES_DRAIN_AT = 64


#: An investigation made due: (captured storages, levels, calls, settings).
_Due = tuple[StorageSnapshot, tuple[int, ...], int, LeakSettings]


class _Detector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.series: dict[str, _Series] = {}
        self.findings: deque[Growth] = deque(maxlen=100)

    def reset(self) -> None:
        global _armed
        with self.lock:
            self.series.clear()
            self.findings.clear()
            _armed = frozenset()
            add_entry_hook(_on_span_enter, leaks_only=True)

    def _arm(self, name: str, s: _Series) -> None:
        global _armed
        s.phase = _ARMED
        s.armed_exits = 0
        s.attempts = 0
        s.captured = None
        if not _armed:  # every span now asks whether its name is armed
            add_entry_hook(_on_span_enter)
        _armed = _armed | {name}

    def _disarm(self, name: str, s: _Series) -> None:
        global _armed
        s.captured = None
        if name in _armed:
            _armed = _armed - {name}
            if not _armed:  # back to spans opened with leaks=True alone
                add_entry_hook(_on_span_enter, leaks_only=True)

    def _give_up(
        self, name: str, s: _Series, settings: LeakSettings, *, unexplained: bool = False
    ) -> None:
        """Back to watching, after a window's rest: the episode is over without a finding.

        ``unexplained``: the slope went on but nothing confirmed it; no capture for a while
        (one window, then two, four, ... up to 32), whatever the slope does meanwhile.
        """
        self._disarm(name, s)
        s.phase, s.pending, s.cooldown = _WATCH, None, settings.window
        if unexplained:
            s.hold = settings.window * 2 ** min(s.quiet, 5)
            s.quiet += 1

    def captured(self, name: str, refs: StorageSnapshot) -> None:
        """A span of ``name`` finished a capture (called before the exit hooks run)."""
        with self.lock:
            s = self.series.get(name)
            if s is not None and s.phase in (_ARMED, _PENDING, _CHECKING):
                s.captured = refs

    def drain(self, name: str, s: _Series, due: list[_Due]) -> None:
        """Fold the levels the lock-free path queued into the series, adding investigations
        they made due to ``due``; caller holds ``lock``."""
        inbox = s.inbox
        n = len(inbox)
        if not n:
            return
        settings = _settings
        if s.steady:  # the common case: n flat calls at once
            levels = [inbox.popleft() for _ in range(n)]
            s.calls += n
            s.levels.extend(levels[-(settings.window + 1) :])
            s.rises.extend([False] * min(n, settings.window))
            s.last = levels[-1]
            s.cooldown = max(0, s.cooldown - n)
            s.hold = max(0, s.hold - n)
            return
        # A lock-free exit raced with a locked step that ended the steady state: judge each
        # queued call in full (own 0: it did not grow by the threshold itself).
        for _ in range(n):
            self._judge(name, s, inbox.popleft(), 0, settings, due)

    def drain_soon(self, name: str, s: _Series) -> None:
        """Drain ``s`` unless another thread holds the lock (its next step drains it); past
        four batches, wait for the lock rather than let the inbox grow."""
        due: list[_Due] = []
        if self.lock.acquire(blocking=len(s.inbox) >= 4 * _SERIES_DRAIN_AT):
            try:
                self.drain(name, s, due)
            finally:
                self.lock.release()
        for args in due:
            self._investigate(name, *args)

    def on_exit(self, name: str, level: int, own: int) -> None:
        """A call of ``name`` ended at ``level`` allocated bytes, ``own`` of them its own
        (allocated at exit minus at entry), summed over the devices it measured."""
        settings = _settings
        if not settings.enabled:
            return
        due: list[_Due] = []
        with self.lock:
            s = self.series.get(name)
            if s is None:
                if len(self.series) >= MAX_SERIES:
                    return
                s = self.series[name] = _Series(settings.window)
            self.drain(name, s, due)
            self._judge(name, s, level, own, settings, due)
        # The census runs outside the lock: other threads' spans keep going meanwhile.
        for args in due:
            self._investigate(name, *args)

    def _judge(
        self,
        name: str,
        s: _Series,
        level: int,
        own: int,
        settings: LeakSettings,
        due: list[_Due],
    ) -> None:
        """One call of the series; caller holds ``lock``."""
        try:
            if self._count(name, s, level, own, settings):
                due.append(
                    (
                        s.pending or StorageSnapshot(),
                        _trend.trimmed(s.levels, s.rises),
                        s.calls,
                        settings,
                    )
                )
                s.pending, s.phase = None, _CHECKING
        finally:
            s.steady = bool(s.levels) and s.phase == _WATCH and True not in s.rises

    def _count(self, name: str, s: _Series, level: int, own: int, settings: LeakSettings) -> bool:
        """Advance the series by one call; whether survivors are due."""
        s.calls += 1
        if s.calls < settings.warmup:
            return False
        if not s.levels:
            # The level at the end of the warm-up is the baseline of the series.
            s.levels.append(level)
            s.last = level
            return False
        threshold = settings.min_bytes_per_call
        rose = level - s.last >= threshold and own >= threshold
        s.last = level
        s.levels.append(level)
        s.rises.append(rose)
        if s.cooldown:
            s.cooldown -= 1
        if s.hold:
            s.hold -= 1
        if s.phase == _WATCH and True not in s.rises:
            return False  # the steady state: arming needs at least one rise in the window
        return self._step(name, s, settings) is not None

    def _step(self, name: str, s: _Series, settings: LeakSettings) -> str | None:
        """Advance the series' state machine; ``'investigate'`` when survivors are due.

        While an investigation runs the name stays armed, so that every call is captured:
        when one call's survivors do not explain the growth, the next call's are looked at.
        """
        if s.phase == _CHECKING:
            return None  # another thread is looking at this series' survivors
        rises = sum(s.rises)
        # The slope only where enough rises make it matter (it sorts ~120 pairwise slopes).
        rate = _trend.rate(s.levels, s.rises) if rises >= settings.min_rises else 0.0
        sustained = rises >= settings.min_rises and rate >= settings.min_bytes_per_call
        if s.phase == _ARMED:
            s.armed_exits += 1
            if s.captured is not None:
                s.pending, s.captured = s.captured, None
                s.phase = _PENDING
            elif s.armed_exits >= 2:
                # No call could be captured (the census failed): nothing can confirm it.
                logger.debug("cudamem: %r could not be captured; growth not checked", name)
                self._give_up(name, s, settings, unexplained=True)
            return None
        if s.phase == _PENDING:
            if sustained:
                return "investigate"
            self._give_up(name, s, settings)
            return None
        if s.phase == _LEAKING:
            if not sustained:
                s.phase = _WATCH  # the leak stopped; a new episode warns only if it differs
                return None
            ratio = rate / s.checked_rate if s.checked_rate > 0 else math.inf
            if ratio >= settings.rate_change or ratio <= 1 / settings.rate_change:
                # A new regime: measure it on a window of its own, from this level on.
                last = s.levels[-1]
                s.levels.clear()
                s.levels.append(last)
                s.rises.clear()
                s.phase = _WATCH
            return None
        # _WATCH: suspicion (one rise short of the rule) arms a capture of the next call.
        if s.hold == 0 and (sustained or (s.cooldown == 0 and rises >= settings.min_rises - 1)):
            self._arm(name, s)
        return None

    def _unexplained(self, name: str, rate: float, retained: int, settings: LeakSettings) -> None:
        """One captured call's survivors do not explain the slope: look at the next call,
        or let it go. Never a warning: growth no live tensor holds is not this kind of leak."""
        with self.lock:
            s = self.series.get(name)
            if s is None or s.phase != _CHECKING:
                return
            s.attempts += 1
            if s.attempts < MAX_ATTEMPTS and s.captured is not None:
                s.pending, s.captured, s.phase = s.captured, None, _PENDING
                return
            self._give_up(name, s, settings, unexplained=True)
        logger.debug(
            "cudamem: %r grows by %s per call, but the storages a call creates that outlive "
            "the next call hold %s: not reported (the allocator's cache, workspaces, or memory "
            "made outside the span; see cudamem.unaccounted())",
            name,
            format_bytes(round(rate)),
            format_bytes(retained),
        )

    def _investigate(
        self,
        name: str,
        pending: StorageSnapshot,
        levels: tuple[int, ...],
        calls: int,
        settings: LeakSettings,
    ) -> None:
        rate = _trend.theil_sen(levels)
        try:
            # The cheap test first: do the captured call's storages still exist?
            retained = pending.alive().nbytes
        except Exception as exc:  # never into the user's step
            logger.debug("cudamem: checking the survivors of %r failed: %r", name, exc)
            retained = 0
        notes: list[str] = []
        if retained < settings.min_explained * rate:
            # No tensor explains it; piling cuBLAS workspaces (held by no tensor) still can.
            notes = workspace_notes()
            if not notes:
                self._unexplained(name, rate, retained, settings)
                return
        with self.lock:
            s = self.series.get(name)
            if s is not None:
                self._disarm(name, s)
        culprits: list[Culprit] = []
        if not notes:
            try:
                culprits = name_culprits(pending, notes, settings.min_bytes_per_call)
            except Exception as exc:  # never into the user's step
                notes.append(f"naming the culprits failed: {type(exc).__name__}: {exc}")
        growth = Growth(
            name=name,
            per_call=round(rate),
            calls=calls,
            levels=levels,
            culprits=tuple(culprits[: settings.max_culprits]),
            retained=retained,
            notes=tuple(notes),
        )
        signature = (frozenset(c.holder for c in growth.culprits), rate)
        with self.lock:
            s = self.series.get(name)
            if s is None:
                return
            s.phase, s.checked_rate, s.pending, s.quiet = _LEAKING, rate, None, 0
            previous = s.warned
            if previous is not None and previous[0] == signature[0]:
                ratio = rate / previous[1] if previous[1] > 0 else math.inf
                if 1 / settings.rate_change < ratio < settings.rate_change:
                    return  # the same picture: said already
            s.warned = signature
            self.findings.append(growth)
        emit(growth)


_detector = _Detector()


_series_get = _detector.series.get


#: Where the capture of a span lives in ``RawSpan.extras`` (``MemorySpan.leaks`` reads it).
_CAPTURE = "leaks"


_START = "leaks.start"


def _on_span_enter(span: RawSpan) -> None:
    """The span entry hook: snapshot the storages for ``leaks=True`` or an armed name.

    Registered for ``leaks=True`` spans alone while no name is armed (``_Detector._arm``
    widens it to every span, ``_disarm`` narrows it again): a plain span pays no call."""
    if span.leaks or (_armed and span.name in _armed):
        if span.extras is None:
            span.extras = {}
        span.extras[_START] = begin(span.name)


def _on_span_exit(span: RawSpan) -> None:
    """The span exit hook: finish a capture, then growth detection (not for calls that
    raised: an aborted call's level says nothing about growth)."""
    extras = span.extras
    if extras is not None and _START in extras:
        extras[_CAPTURE] = end(
            span.name, extras.pop(_START), explicit=span.leaks, captured=_detector.captured
        )
    if span.exception is None and span.after:
        settings = _settings
        if settings.enabled:
            s = _series_get(span.name)
            if s is not None and s.steady and span.alloc_delta < settings.min_bytes_per_call:
                # The steady state, lock-free: a call that did not grow by the threshold
                # cannot be a rise, so only its level is queued (see _Series.steady).
                inbox = s.inbox
                inbox.append(span.level)
                if len(inbox) >= _SERIES_DRAIN_AT:
                    _detector.drain_soon(span.name, s)
                return
            _detector.on_exit(span.name, span.level, span.alloc_delta)


add_entry_hook(_on_span_enter, leaks_only=True)


# A LeakWarning the user turned into an error (-W error) reaches the user's code as itself.
add_exit_hook(_on_span_exit, propagate=(LeakWarning,))
