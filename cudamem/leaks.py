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
not count) are named through ``who_holds`` and grouped by holder. If growth is then
sustained, one :class:`LeakWarning` (also sent to the ``cudamem.leaks`` logger) says how much
each call retains and who holds it. It repeats only when the picture changes: other holders,
or a per-call rate ``rate_change`` times higher or lower than the one last reported (a rate
change starts a new window, so the new rate is measured on its own).

**What a span left behind.** ``track(..., leaks=True)`` snapshots the live storages at entry
and exit; ``span.leaks`` lists those created inside and alive at exit, with holders, and
:func:`leaks` (``cudamem.leaks(since=span)``) lists those of them still alive now.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
import warnings
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from . import _backend, _storages
from .span import MemorySpan, add_entry_hook, add_exit_hook

if TYPE_CHECKING:
    from .span import RawSpan

__all__ = [
    "Culprit",
    "Growth",
    "LeakReport",
    "LeakSettings",
    "LeakWarning",
    "LeakedStorage",
    "configure_leaks",
    "leak_settings",
    "leaks",
]

logger = logging.getLogger("cudamem.leaks")

#: Distinct span names watched; further names are not watched (bounded memory).
MAX_SERIES = 1000
#: Storage keys kept per capture (the largest); a span creating more is summarised.
MAX_KEYS = 100_000
#: Storages listed in a :class:`LeakReport` (the largest; totals count all of them).
MAX_LISTED = 50

_ARROW = re.compile(r"\s+(?:→|->)\s+")
_TRAILING_INDEX = re.compile(r"(?:\[\d+\])+$")


class LeakWarning(UserWarning):
    """Memory keeps growing across calls of a span. ``warning.growth`` has the details."""

    def __init__(self, message: str, growth: Growth | None = None) -> None:
        super().__init__(message)
        self.growth = growth


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class LeakSettings:
    """Thresholds of growth detection (see the module docstring for the rule)."""

    #: Watch repeated spans at all.
    enabled: bool = True
    #: Calls not judged; the level after the last of them is the baseline (the first step
    #: allocates optimizer state, cuBLAS workspaces, caches).
    warmup: int = 1
    #: Calls looked at: the last ``window`` level changes.
    window: int = 8
    #: Calls of the window that must have risen by ``min_bytes_per_call`` or more.
    min_rises: int = 3
    #: Smallest per-call growth that counts (a rise, and the window's robust slope).
    min_bytes_per_call: int = 64 * 1024
    #: Warn again for the same holders when the rate changes by this factor.
    rate_change: float = 2.0
    #: Holder groups named in a warning.
    max_culprits: int = 5
    #: Print an out-of-memory post-mortem when an OOM leaves a span (see ``cudamem.on_oom``).
    span_oom_reports: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return asdict(self)

    def __str__(self) -> str:
        from .render.text import format_bytes

        return (
            f"growth detection {'on' if self.enabled else 'off'}: after {self.warmup} warm-up "
            f"call(s), {self.min_rises} of the last {self.window} calls rising by at least "
            f"{format_bytes(self.min_bytes_per_call)} per call"
        )


def _validate(s: LeakSettings) -> None:
    def positive_int(name: str, value: Any, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    positive_int("warmup", s.warmup, 1)
    positive_int("window", s.window, 2)
    positive_int("min_rises", s.min_rises, 2)
    positive_int("min_bytes_per_call", s.min_bytes_per_call, 1)
    positive_int("max_culprits", s.max_culprits, 1)
    if s.min_rises > s.window:
        raise ValueError(f"min_rises ({s.min_rises}) cannot exceed window ({s.window})")
    if not isinstance(s.rate_change, (int, float)) or not s.rate_change > 1.0:
        raise ValueError(f"rate_change must be a number > 1, got {s.rate_change!r}")
    for name in ("enabled", "span_oom_reports"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(s, name)!r}")


_settings = LeakSettings()


def leak_settings() -> LeakSettings:
    """The settings in force."""
    return _settings


def configure_leaks(**changes: Any) -> LeakSettings:
    """Change growth-detection settings (any field of :class:`LeakSettings`); returns them.

    ``cudamem.configure_leaks(min_bytes_per_call=1024**2, window=16)``. Unknown names raise
    ``TypeError``, bad values ``ValueError``; series already watched restart with the new
    rule. ``configure_leaks()`` with no argument restores the defaults.
    """
    global _settings
    known = {f.name for f in fields(LeakSettings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"unknown leak setting(s) {unknown}; known: {sorted(known)}")
    new = replace(_settings, **changes) if changes else LeakSettings()
    _validate(new)
    _settings = new
    _detector.reset()
    return new


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class LeakedStorage:
    """One storage a span created that was still alive afterwards."""

    nbytes: int
    device: str
    dtype: str | None
    shape: tuple[int, ...] | None
    #: Holder paths (``who_holds``); empty when nothing reachable from Python holds it.
    holders: tuple[str, ...]

    @property
    def through_autograd(self) -> bool:
        """Held only through another tensor's autograd graph."""
        return bool(self.holders) and all(_through_graph(h) for h in self.holders)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "nbytes": self.nbytes,
            "device": self.device,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "holders": list(self.holders),
            "through_autograd": self.through_autograd,
        }

    def __str__(self) -> str:
        from .render.text import format_bytes

        where = self.holders[0] if self.holders else "no holder reachable from Python"
        return f"{format_bytes(self.nbytes)} on {self.device}: {where}"


@dataclass(frozen=True, slots=True)
class Culprit:
    """Storages grouped by what holds them: a container, an attribute, a frame's local."""

    #: The holder with list/tuple indices removed: ``__main__.loss_history``.
    holder: str
    #: Distinct items of the holder that keep memory (``loss_history[0]``, ``[1]``, ...).
    tensors: int
    storages: int
    nbytes: int
    #: Bytes of those held only through autograd graphs (saved tensors).
    autograd_bytes: int
    #: One full path, e.g. ``__main__.loss_history[3] → grad_fn MeanBackward0 → ...``.
    example: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        from .render.leaks import render_culprit

        return render_culprit(self)


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Storages created during a span that were still alive after it, with holders."""

    span: str
    #: When the storages were checked: ``'at exit'`` or ``'now'``.
    checked: str
    count: int
    nbytes: int
    #: The largest ones (at most ``MAX_LISTED``); ``count``/``nbytes`` cover all.
    storages: tuple[LeakedStorage, ...]
    culprits: tuple[Culprit, ...]
    notes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "span": self.span,
            "checked": self.checked,
            "count": self.count,
            "nbytes": self.nbytes,
            "storages": [s.to_dict() for s in self.storages],
            "culprits": [c.to_dict() for c in self.culprits],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.leaks import render_leak_report

        return render_leak_report(self)


@dataclass(frozen=True, slots=True)
class Growth:
    """A sustained rise of a repeated span's allocated level, and who holds it."""

    name: str
    #: Robust per-call growth of the allocated level (bytes).
    per_call: int
    #: Calls of the span observed so far.
    calls: int
    #: Exit levels of the window that triggered the finding, oldest first.
    levels: tuple[int, ...]
    culprits: tuple[Culprit, ...]
    #: Bytes the captured call created that outlived the next call (the named part).
    retained: int | None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "name": self.name,
            "per_call": self.per_call,
            "calls": self.calls,
            "levels": list(self.levels),
            "culprits": [c.to_dict() for c in self.culprits],
            "retained": self.retained,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.leaks import render_growth

        return render_growth(self)


# --------------------------------------------------------------------------- grouping


def _through_graph(path: str) -> bool:
    """Whether a holder path reaches the storage through an autograd graph."""
    parts = _ARROW.split(path)
    return len(parts) > 1 and any("grad_fn" in p or "saved" in p for p in parts[1:])


def holder_group(path: str) -> tuple[str, str]:
    """``(group, item)`` of a holder path.

    The item is the path's first step (what Python holds: ``__main__.loss_history[3]``);
    the group drops trailing list/tuple indices from it (``__main__.loss_history``) so that
    a list of ten losses is one culprit. Dict keys stay: ``outputs['val']`` is a container.
    """
    item = _ARROW.split(path, maxsplit=1)[0].strip()
    group = _TRAILING_INDEX.sub("", item) or item
    return group, item


def _in_container(path: str) -> bool:
    """Whether the path's first step is an element (``x[3]``, ``d['k']``): on a tie, a
    container that accumulates beats the loop variable that holds the latest item."""
    return holder_group(path)[1].endswith("]")


def _candidates(holders: tuple[str, ...]) -> tuple[str, ...]:
    """The holders a storage is attributed to: direct ones if any, else all."""
    direct = tuple(h for h in holders if not _through_graph(h))
    return direct or holders


def group_culprits(storages: Iterable[_storages.LiveStorage]) -> list[Culprit]:
    """Group storages by holder; each storage counts once, largest group first.

    A storage Python holds directly (not only through an autograd graph) belongs to one of
    its direct holders: a parameter that every loss's graph reaches stays the model's. Among
    the candidates, the holder group that holds the most of the storages given wins (a loss
    history list rather than the loop's ``loss`` local that also holds the latest one).
    """
    items = list(storages)
    votes: dict[str, int] = {}
    for s in items:
        for g in {holder_group(h)[0] for h in _candidates(s.holders)}:
            votes[g] = votes.get(g, 0) + 1
    acc: dict[str, dict[str, Any]] = {}
    for s in items:
        if s.holders:
            path = max(
                _candidates(s.holders),
                key=lambda h: (votes.get(holder_group(h)[0], 0), _in_container(h), -len(h)),
            )
            group, item = holder_group(path)
        else:
            path = group = item = "(no holder reachable from Python)"
        a = acc.setdefault(
            group, {"items": set(), "storages": 0, "nbytes": 0, "autograd": 0, "example": path}
        )
        a["items"].add(item)
        a["storages"] += 1
        a["nbytes"] += s.nbytes
        if s.holders and _through_graph(path):
            a["autograd"] += s.nbytes
    culprits = [
        Culprit(g, len(a["items"]), a["storages"], a["nbytes"], a["autograd"], a["example"])
        for g, a in acc.items()
    ]
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits


def _to_leaked(s: _storages.LiveStorage) -> LeakedStorage:
    return LeakedStorage(s.nbytes, s.device, s.dtype, s.shape, s.holders)


def _report(name: str, checked: str, keys: Mapping[Hashable, int], notes: list[str]) -> LeakReport:
    """Holders for the storages in ``keys`` still alive now (any device)."""
    found = _storages.live_storages(None, holders=True, keys=keys.keys())
    if found is None:
        notes.append("the census (cudamem.census) is unavailable: storages not enumerated")
        found = []
    return LeakReport(
        span=name,
        checked=checked,
        count=len(found),
        nbytes=sum(s.nbytes for s in found),
        storages=tuple(_to_leaked(s) for s in found[:MAX_LISTED]),
        culprits=tuple(group_culprits(found)),
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- span capture


class _Capture:
    """Storages a span created that were alive at its exit (keys only: nothing kept alive)."""

    __slots__ = ("keys", "name", "notes", "report")

    def __init__(self, name: str, keys: dict[Hashable, int], notes: list[str]) -> None:
        self.name = name
        self.keys = keys
        self.notes = notes
        self.report: LeakReport | None = None


def _largest(keys: dict[Hashable, int], notes: list[str]) -> dict[Hashable, int]:
    if len(keys) <= MAX_KEYS:
        return keys
    notes.append(f"{len(keys)} new storages; only the largest {MAX_KEYS} are followed")
    top = sorted(keys.items(), key=lambda kv: kv[1], reverse=True)[:MAX_KEYS]
    return dict(top)


def begin(name: str) -> dict[Hashable, int] | None:
    """Span entry (``leaks=True`` or a capture armed by the detector): live storage keys.

    Every device: a span's report names host storages too; the detector keeps only those
    of the allocator it watches.
    """
    try:
        return _storages.live_keys(None)
    except Exception as exc:  # the census must never break the user's step
        logger.debug("cudamem: storage snapshot at entry of %r failed: %r", name, exc)
        return None


def end(name: str, start: dict[Hashable, int] | None, *, explicit: bool) -> _Capture | None:
    """Span exit: the storages created inside and alive now; the report when ``explicit``."""
    notes: list[str] = []
    try:
        if start is None:
            if not explicit:
                return None
            notes.append("the census (cudamem.census) is unavailable: storages not enumerated")
            capture = _Capture(name, {}, notes)
            capture.report = LeakReport(name, "at exit", 0, 0, (), (), tuple(notes))
            return capture
        now = _storages.live_keys(None) or {}
        new = _largest({k: n for k, n in now.items() if k not in start}, notes)
        capture = _Capture(name, new, notes)
        watched = _backend.get().storage_device_type()
        _detector.captured(
            name,
            {
                k: n
                for k, n in new.items()
                if _storages.matches_type(_storages.key_device(k), watched)
            },
        )
        if explicit:
            capture.report = _report(name, "at exit", new, list(notes))
        return capture
    except Exception as exc:
        logger.debug("cudamem: storage snapshot at exit of %r failed: %r", name, exc)
        if not explicit:
            return None
        notes.append(f"leak capture failed: {type(exc).__name__}: {exc}")
        capture = _Capture(name, {}, notes)
        capture.report = LeakReport(name, "at exit", 0, 0, (), (), tuple(notes))
        return capture


def leaks(since: MemorySpan) -> LeakReport:
    """The storages created during ``since`` that are still alive now, with holders.

    ``since`` must be a closed span run with ``leaks=True`` (that records which storages
    existed at its entry and exit; without it there is nothing to compare against)::

        with cudamem.track("val", leaks=True) as span:
            run_validation()
        ...
        print(cudamem.leaks(since=span))
    """
    if not isinstance(since, MemorySpan):
        raise TypeError(f"since must be a MemorySpan, not {type(since).__name__}")
    capture = since._leak_capture()
    return _report(capture.name, "now", capture.keys, list(capture.notes))


# --------------------------------------------------------------------------- detector


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


_WATCH, _ARMED, _PENDING, _LEAKING = range(4)

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
        "calls",
        "captured",
        "checked_rate",
        "cooldown",
        "last",
        "levels",
        "pending",
        "phase",
        "rises",
        "warned",
    )

    def __init__(self, window: int) -> None:
        self.calls = 0
        self.last = 0
        self.levels: deque[int] = deque(maxlen=window + 1)
        self.rises: deque[bool] = deque(maxlen=window)
        self.phase = _WATCH
        self.armed_exits = 0
        self.cooldown = 0
        self.captured: dict[Hashable, int] | None = None
        self.pending: dict[Hashable, int] | None = None
        self.checked_rate = 0.0
        #: (holder groups, per-call rate) of the last warning.
        self.warned: tuple[frozenset[str], float] | None = None


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

    def _arm(self, name: str, s: _Series) -> None:
        global _armed
        s.phase = _ARMED
        s.armed_exits = 0
        s.captured = None
        _armed = _armed | {name}

    def _disarm(self, name: str) -> None:
        global _armed
        if name in _armed:
            _armed = _armed - {name}

    def captured(self, name: str, keys: dict[Hashable, int]) -> None:
        """A span of ``name`` finished a capture (called before the exit hooks run)."""
        with self.lock:
            s = self.series.get(name)
            if s is not None and s.phase == _ARMED:
                s.captured = keys
                self._disarm(name)

    def on_exit(self, name: str, level: int, own: int) -> None:
        """A call of ``name`` ended at ``level`` allocated bytes, ``own`` of them its own
        (allocated at exit minus at entry), summed over the devices it measured."""
        settings = _settings
        if not settings.enabled:
            return
        with self.lock:
            s = self.series.get(name)
            if s is None:
                if len(self.series) >= MAX_SERIES:
                    return
                s = self.series[name] = _Series(settings.window)
            s.calls += 1
            if s.calls < settings.warmup:
                return
            if not s.levels:
                # The level at the end of the warm-up is the baseline of the series.
                s.levels.append(level)
                s.last = level
                return
            threshold = settings.min_bytes_per_call
            rose = level - s.last >= threshold and own >= threshold
            s.last = level
            s.levels.append(level)
            s.rises.append(rose)
            if s.cooldown:
                s.cooldown -= 1
            if s.phase == _WATCH and True not in s.rises:
                return  # the steady state: arming needs at least one rise in the window
            action = self._step(name, s, settings)
            if action is None:
                return
            pending, levels, calls = s.pending, _trimmed(s), s.calls
            s.pending = None
        # The census runs outside the lock: other threads' spans keep going meanwhile.
        self._investigate(name, pending, levels, calls, settings)

    def _step(self, name: str, s: _Series, settings: LeakSettings) -> str | None:
        """Advance the series' state machine; ``'investigate'`` when culprits are due."""
        rises = sum(s.rises)
        sustained = rises >= settings.min_rises and _rate(s) >= settings.min_bytes_per_call
        if s.phase == _ARMED:
            s.armed_exits += 1
            if s.captured is not None:
                s.pending, s.captured = s.captured, None
                s.phase = _PENDING
            elif s.armed_exits >= 2:
                # The call after arming was not captured (no census, or it failed): say what
                # is known without culprits rather than wait for ever.
                self._disarm(name)
                s.pending = None
                if sustained:
                    return "investigate"
                s.phase, s.cooldown = _WATCH, settings.window
            return None
        if s.phase == _PENDING:
            if sustained:
                return "investigate"
            s.phase, s.pending, s.cooldown = _WATCH, None, settings.window
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
        if sustained or (s.cooldown == 0 and rises >= settings.min_rises - 1):
            self._arm(name, s)
        return None

    def _investigate(
        self,
        name: str,
        pending: dict[Hashable, int] | None,
        levels: tuple[int, ...],
        calls: int,
        settings: LeakSettings,
    ) -> None:
        rate = theil_sen(levels)
        notes: list[str] = []
        culprits: list[Culprit] = []
        retained: int | None = None
        try:
            culprits, retained = _name_culprits(pending, notes)
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
            s.phase, s.checked_rate = _LEAKING, rate
            previous = s.warned
            if previous is not None and previous[0] == signature[0]:
                ratio = rate / previous[1] if previous[1] > 0 else math.inf
                if 1 / settings.rate_change < ratio < settings.rate_change:
                    return  # the same picture: said already
            s.warned = signature
            self.findings.append(growth)
        _emit(growth)


def _name_culprits(
    pending: dict[Hashable, int] | None, notes: list[str]
) -> tuple[list[Culprit], int | None]:
    """Culprit groups for the storages a captured call left alive, with group totals."""
    if pending is None:
        if not _storages.available():
            notes.append("culprits not named: the census (cudamem.census) is unavailable")
        else:
            notes.append("culprits not named: the call could not be captured")
        return [], None
    device_type = _backend.get().storage_device_type()
    everything = _storages.live_storages(device_type, holders=True)
    if everything is None:
        notes.append("culprits not named: the census (cudamem.census) is unavailable")
        return [], None
    survivors = [s for s in everything if s.key in pending]
    retained = sum(s.nbytes for s in survivors)
    if not survivors:
        notes.append(
            "no storage the span created outlived the next call: the growth is memory no "
            "live tensor accounts for (see cudamem.unaccounted()), or it is created "
            "outside the span"
        )
        return [], retained
    # Name the groups from the survivors, then total each group over every live storage it
    # holds: "loss_history: 10 tensors, 40 MiB" rather than the one captured call's share.
    named = group_culprits(survivors)
    wanted = {c.holder for c in named}
    members = [
        s for s in everything if any(holder_group(h)[0] in wanted for h in _candidates(s.holders))
    ]
    totals = {c.holder: c for c in group_culprits(members) if c.holder in wanted}
    culprits = [totals.get(c.holder, c) for c in named]
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits, retained


_detector = _Detector()


# --------------------------------------------------------------------------- output


def _stacklevel() -> int:
    """The stack level of the first frame outside cudamem and torch: the user's ``with``, or
    the user's ``optimizer.step()`` when ``cudamem run`` closed the span from torch's hook."""
    import torch

    skip = (
        os.path.dirname(os.path.abspath(__file__)) + os.sep,
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    )
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _emit(growth: Growth) -> None:
    """One warning, and the same text to logging when anyone listens."""
    from .render.leaks import render_growth

    text = render_growth(growth)
    warnings.warn(LeakWarning(text, growth), stacklevel=_stacklevel())
    # Only when logging is configured: Python's last-resort handler would otherwise print
    # the same text a second time under the warning.
    if logger.hasHandlers():
        logger.warning(text)


#: Where the capture of a span lives in ``RawSpan.extras`` (``MemorySpan.leaks`` reads it).
_CAPTURE = "leaks"
_START = "leaks.start"


def _on_span_enter(span: RawSpan) -> None:
    """The span entry hook: snapshot the storages for ``leaks=True`` or an armed name."""
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
    if span.exception is None and span.after and _settings.enabled:
        _detector.on_exit(span.name, span.level, span.alloc_delta)


add_entry_hook(_on_span_enter)
# A LeakWarning the user turned into an error (-W error) reaches the user's code as itself.
add_exit_hook(_on_span_exit, propagate=(LeakWarning,))
