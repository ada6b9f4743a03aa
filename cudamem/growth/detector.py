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

**What a span left behind.** ``track(..., leaks=True)`` snapshots the live storages at entry
and exit; ``span.leaks`` lists those created inside and alive at exit, with holders, and
``leaks`` (``cudamem.leaks(since=span)``) lists those of them still alive now (the same
storages, not whatever the allocator has put at their addresses since).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from ..allocator import backend as _backend
from ..base.format import format_bytes, plural
from ..base.frames import is_library_file
from ..holders import census
from ..holders.census import StorageSnapshot
from ..holders.culprits import NO_HOLDER, Culprit, group_culprits, held_shapes
from ..spans.leftovers import LeakReport
from ..spans.span import MemorySpan
from ..spans.state import add_entry_hook, add_exit_hook
from .report import Growth

if TYPE_CHECKING:
    from ..holders.census import LiveStorage
    from ..spans.raw import RawSpan

from .settings import LeakSettings, LeakWarning, _validate

__all__ = ["configure_leaks", "leak_settings", "leaks"]


logger = logging.getLogger("cudamem.leaks")


#: Distinct span names watched; further names are not watched (bounded memory).
MAX_SERIES = 1000


#: Storage keys kept per capture (the largest); a span creating more is summarised.
MAX_KEYS = 100_000


#: Storages listed in a ``LeakReport`` (the largest; totals count all of them).
MAX_LISTED = 50


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


def _leak_report(
    name: str, checked: str, found: Iterable[LiveStorage], notes: list[str]
) -> LeakReport:
    found = sorted(found, key=census.listing_order)
    return LeakReport(
        span=name,
        checked=checked,
        count=len(found),
        nbytes=sum(s.nbytes for s in found),
        storages=tuple(found[:MAX_LISTED]),
        culprits=tuple(group_culprits(found)),
        notes=tuple(notes),
    )


class _Capture:
    """Storages a span created that were alive at its exit (weak references: nothing kept
    alive, and a storage freed since is not mistaken for whatever took its address)."""

    __slots__ = ("name", "notes", "refs", "report")

    def __init__(self, name: str, refs: StorageSnapshot, notes: list[str]) -> None:
        self.name = name
        self.refs = refs
        self.notes = notes
        self.report: LeakReport | None = None


def _cap_note(total: int) -> str:
    return f"{plural(total, 'new storage')}; only the largest {MAX_KEYS} are followed"


def _failed(name: str, notes: list[str]) -> _Capture:
    capture = _Capture(name, StorageSnapshot(), notes)
    capture.report = LeakReport(name, "at exit", 0, 0, (), (), tuple(notes))
    return capture


def begin(name: str) -> StorageSnapshot | None:
    """Span entry (``leaks=True`` or a capture armed by the detector): every live storage.

    Every device: a span's report names host storages too; the detector keeps only those
    of the allocator it watches.
    """
    try:
        return census.live_refs(None)
    except Exception as exc:  # the census must never break the user's step
        logger.debug("cudamem: storage snapshot at entry of %r failed: %r", name, exc)
        return None


def end(name: str, start: StorageSnapshot | None, *, explicit: bool) -> _Capture | None:
    """Span exit: the storages created inside and alive now; the report when ``explicit``.

    Returns the capture only when ``explicit`` (``leaks=True``): the detector keeps its own.
    """
    notes: list[str] = []
    try:
        if start is None:
            if not explicit:
                return None
            notes.append(
                "the census failed at entry (see the cudamem.leaks debug log): "
                "storages not enumerated"
            )
            return _failed(name, notes)
        watched = _backend.get().storage_device_type()
        if not explicit:  # the detector's capture: no holders yet
            new = census.live_refs(None).new_since(start).largest(MAX_KEYS)
            _detector.captured(name, new.on(watched))
            return None
        # One census: what is new since the entry, with holders (the largest MAX_KEYS).
        found, total = census.storages_since(start, limit=MAX_KEYS)
        if total > MAX_KEYS:
            notes.append(_cap_note(total))
        new = StorageSnapshot({s.ref: (s.device, s.nbytes) for s in found if s.ref is not None})
        _detector.captured(name, new.on(watched))
        capture = _Capture(name, new, notes)
        capture.report = _leak_report(name, "at exit", found, list(notes))
        return capture
    except Exception as exc:
        logger.debug("cudamem: storage snapshot at exit of %r failed: %r", name, exc)
        if not explicit:
            return None
        notes.append(f"leak capture failed: {type(exc).__name__}: {exc}")
        return _failed(name, notes)


def leaks(since: MemorySpan) -> LeakReport:
    """The storages created during ``since`` that are still alive now, with holders.

    ``since`` must be a closed span run with ``leaks=True`` (that records which storages
    existed at its entry and exit; without it there is nothing to compare against)::

        with cudamem.track("val", leaks=True) as span:
            run_validation()
        ...
        print(cudamem.leaks(since=span))

    The same storages, by identity: one freed since is gone from the answer even when the
    allocator has put a new one at its address.
    """
    if not isinstance(since, MemorySpan):
        raise TypeError(f"since must be a MemorySpan, not {type(since).__name__}")
    capture = since._leak_capture()
    found = capture.refs.storages(holders=True)
    return _leak_report(capture.name, "now", found, list(capture.notes))


def theil_sen(levels: tuple[int, ...] | list[int]) -> float:
    """Median of pairwise slopes of equally spaced ``levels`` (bytes per call)."""
    slopes = sorted(
        (levels[j] - levels[i]) / (j - i)
        for i in range(len(levels))
        for j in range(i + 1, len(levels))
    )
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return float(slopes[mid]) if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


_WATCH, _ARMED, _PENDING, _CHECKING, _LEAKING = range(5)


#: Span names whose next call the detector wants captured. Replaced, never mutated, so the
#: entry hook reads it without a lock.
_armed: frozenset[str] = frozenset()


def _trimmed(s: _Series) -> tuple[int, ...]:
    """The window's levels from the call before its first rise on (flat calls before a leak
    began would drag the slope down)."""
    levels = tuple(s.levels)
    for i, rose in enumerate(s.rises):
        if rose:
            # rises[i] is the change from levels[offset + i] to the next level.
            return levels[len(levels) - len(s.rises) - 1 + i :]
    return levels


def _rate(s: _Series) -> float:
    return theil_sen(_trimmed(s))


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
                due.append((s.pending or StorageSnapshot(), _trimmed(s), s.calls, settings))
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
        sustained = rises >= settings.min_rises and _rate(s) >= settings.min_bytes_per_call
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
            rate = _rate(s)
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
        rate = theil_sen(levels)
        try:
            # The cheap test first: do the captured call's storages still exist?
            retained = pending.alive().nbytes
        except Exception as exc:  # never into the user's step
            logger.debug("cudamem: checking the survivors of %r failed: %r", name, exc)
            retained = 0
        notes: list[str] = []
        if retained < settings.min_explained * rate:
            # No tensor explains it; piling cuBLAS workspaces (held by no tensor) still can.
            notes = _workspace_notes()
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
                culprits = _name_culprits(pending, notes)
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
        _emit(growth)


def _name_culprits(pending: StorageSnapshot, notes: list[str]) -> list[Culprit]:
    """Culprits for the storages a captured call left alive, with container totals.

    The containers are named from the survivors, by a holder search of their own: what
    else lives on the device (in a long process, storages an earlier step or test left
    behind, hanging off structures of hundreds of thousands of objects) cannot use up that
    search's limits. Each container is then totalled over every live storage it holds
    through paths of the survivors' shapes (``culprits.held_shapes``): "loss_history: 10
    tensors, 40 MiB" rather than the one captured call's share, and never what the same
    entries reach that no call made (the model a kept traceback's frame holds through its
    closure: it was there before the loop, and a captured call would have left none of
    it). When the search over every storage stopped at a limit before it reached a
    container, that container keeps the survivors' figures and a note says so.
    """
    device_type = _backend.get().storage_device_type()
    survivors = pending.storages(holders=True)
    named = group_culprits(survivors)
    shapes = held_shapes(survivors)
    totals: dict[str, Culprit] = {}
    stopped: set[str] = set()
    if shapes:
        everything = census.live_storages(device_type, holders=True)
        totals = {c.holder: c for c in group_culprits(everything, like=shapes)}
        stopped = {s.holders.stopped for s in everything if s.holders and s.holders.stopped}
    culprits = []
    for c in named:
        total = totals.get(c.holder)
        if c.holder != NO_HOLDER and total is not None and total.nbytes >= c.nbytes:
            culprits.append(total)
            continue
        culprits.append(c)
        if c.holder != NO_HOLDER and stopped:
            notes.append(
                f"{c.holder}: the storages this call left only; the holder search over every "
                f"storage (for the totals) stopped at its {'/'.join(sorted(stopped))} limit"
            )
    # A group holding less in all than the smallest growth counted per call is not where the
    # growth goes (a framework's latest logged scalar, say): name it only if nothing else is.
    floor = _settings.min_bytes_per_call
    culprits = [c for c in culprits if c.nbytes >= floor] or culprits
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits


#: cuBLAS workspaces of a training step: one for the forward thread, one for autograd's.
STEP_WORKSPACES = 2


def _cublas_workspaces() -> list[tuple[int, int, int]]:
    """``(device, bytes, count)`` of the cuBLAS workspaces on each device with a context (the
    census's split of allocated memory: blocks of the workspace size no tensor lives in)."""
    out = []
    for device in _backend.get().initialized_devices():
        try:
            split = census.unaccounted(device)
        except Exception:
            continue
        if split.cublas_workspaces:
            out.append((device, int(split.cublas_workspaces), int(split.workspace_count)))
    return out


def _workspace_notes() -> list[str]:
    """Growth no storage accounts for, when cuBLAS workspaces pile up: name them."""
    try:
        if _backend.get().storage_device_type() != "cuda":
            return []
        piles = _cublas_workspaces()
    except Exception as exc:  # never into the user's step
        logger.debug("cudamem: reading the cuBLAS workspaces failed: %r", exc)
        return []
    return [
        f"{format_bytes(nbytes)} of the allocated memory on cuda:{device} is {count} cuBLAS "
        "workspaces held by no tensor: cuBLAS keeps one per handle and stream (a training "
        "step uses two), so a new torch.cuda.Stream per call adds more every call; reuse one "
        "stream, or cudamem.release(clear_cublas=True) frees them"
        for device, nbytes, count in piles
        if count > STEP_WORKSPACES
    ]


_detector = _Detector()


_series_get = _detector.series.get


def _stacklevel() -> int:
    """The stack level of the first frame outside cudamem and torch: the user's ``with``, or
    the user's ``optimizer.step()`` when ``cudamem run`` closed the span from torch's hook."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


#: Called with every ``Growth`` about to be warned about (integrations count culprits
#: and dump snapshots there). Replaced, never mutated.
_growth_hooks: tuple[Callable[[Growth], None], ...] = ()


def add_growth_hook(hook: Callable[[Growth], None]) -> None:
    """Call ``hook(growth)`` before each ``LeakWarning`` (errors are swallowed)."""
    global _growth_hooks
    if hook not in _growth_hooks:
        _growth_hooks = (*_growth_hooks, hook)


def remove_growth_hook(hook: Callable[[Growth], None]) -> None:
    """Undo ``add_growth_hook``."""
    global _growth_hooks
    _growth_hooks = tuple(h for h in _growth_hooks if h is not hook)


def _emit(growth: Growth) -> None:
    """One warning, and the same text to logging when anyone listens."""
    for hook in _growth_hooks:
        try:
            hook(growth)
        except Exception as exc:  # an integration's hook must not stop the warning
            logger.debug("cudamem: growth hook %r failed: %r", hook, exc)
    text = str(growth)
    warnings.warn(LeakWarning(text, growth), stacklevel=_stacklevel())
    # Only when logging is configured: Python's last-resort handler would otherwise print
    # the same text a second time under the warning.
    if logger.hasHandlers():
        logger.warning(text)


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
        extras[_CAPTURE] = end(span.name, extras.pop(_START), explicit=span.leaks)
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
