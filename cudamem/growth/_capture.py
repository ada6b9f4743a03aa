"""What a span left behind. ``track(..., leaks=True)`` snapshots the live storages at entry
(``begin``) and exit (``end``); ``span.leaks`` lists those created inside and alive at exit,
with holders, and ``leaks`` (``cudamem.leaks(since=span)``) lists those of them still alive
now (the same storages, by identity, not whatever the allocator has put at their addresses
since). The growth detector captures a suspect call with the same two calls, without
holders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..allocator import backend as _backend
from ..base.format import plural
from ..holders import census
from ..holders.census import StorageSnapshot
from ..holders.culprits import group_culprits
from ..spans.leftovers import LeakReport
from ..spans.span import MemorySpan

if TYPE_CHECKING:
    from ..holders.census import LiveStorage

__all__ = ["MAX_KEYS", "MAX_LISTED", "Capture", "begin", "end", "leak_report", "leaks"]


logger = logging.getLogger("cudamem.leaks")


#: Storage keys kept per capture (the largest); a span creating more is summarised.
MAX_KEYS = 100_000


#: Storages listed in a ``LeakReport`` (the largest; totals count all of them).
MAX_LISTED = 50


def leak_report(
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


class Capture:
    """Storages a span created that were alive at its exit (weak references: nothing kept
    alive, and a storage freed since is not mistaken for whatever took its address)."""

    __slots__ = ("name", "notes", "refs", "report")

    def __init__(self, name: str, refs: StorageSnapshot, notes: list[str]) -> None:
        self.name = name
        self.refs = refs
        self.notes = notes
        self.report: LeakReport | None = None


def cap_note(total: int) -> str:
    return f"{plural(total, 'new storage')}; only the largest {MAX_KEYS} are followed"


def failed(name: str, notes: list[str]) -> Capture:
    capture = Capture(name, StorageSnapshot(), notes)
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


def end(
    name: str,
    start: StorageSnapshot | None,
    *,
    explicit: bool,
    captured: Callable[[str, StorageSnapshot], None],
) -> Capture | None:
    """Span exit: the storages created inside and alive now, on the watched device, handed
    to ``captured`` (the growth detector's); the report when ``explicit``.

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
            return failed(name, notes)
        watched = _backend.get().storage_device_type()
        if not explicit:  # the detector's capture: no holders yet
            new = census.live_refs(None).new_since(start).largest(MAX_KEYS)
            captured(name, new.on(watched))
            return None
        # One census: what is new since the entry, with holders (the largest MAX_KEYS).
        found, total = census.storages_since(start, limit=MAX_KEYS)
        if total > MAX_KEYS:
            notes.append(cap_note(total))
        new = StorageSnapshot({s.ref: (s.device, s.nbytes) for s in found if s.ref is not None})
        captured(name, new.on(watched))
        capture = Capture(name, new, notes)
        capture.report = leak_report(name, "at exit", found, list(notes))
        return capture
    except Exception as exc:
        logger.debug("cudamem: storage snapshot at exit of %r failed: %r", name, exc)
        if not explicit:
            return None
        notes.append(f"leak capture failed: {type(exc).__name__}: {exc}")
        return failed(name, notes)


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
    return leak_report(capture.name, "now", found, list(capture.notes))
