"""What grew between two steps or two runs, grouped by what holds it: ``cudamem.diff(a, b)``.

Three kinds of input, both sides of one kind:

* **censuses** (``cudamem.live_tensors(holders=True)``): live storages grouped by holder the
  way leak warnings group them (``__main__.loss_history[0..9]`` is one group,
  ``__main__.loss_history``); storage addresses are never compared, so two runs compare too;
* **snapshots** (``torch.cuda.memory._snapshot()`` dicts, or files from
  ``cudamem.dump_snapshot`` / ``_dump_snapshot``): live blocks grouped by the holder
  frame ``cudamem.dump_snapshot`` wrote, else by the first allocation frame outside
  torch (with history recorded), else as one unnamed group;
* **spans** run with ``leaks=True``: what each span left behind (storages created inside and
  alive at its exit), grouped by holder: ``diff(step_10, step_11)`` says whether step 11 kept
  more than step 10, and where; the totals are the allocated levels at the two exits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..allocator.snapshot import (
    CONTAINER_KEY,
    HOLDER_FILENAME,
    LIVE_STATES,
    NOTE_FILENAME,
    load_snapshot,
)
from ..base.format import format_bytes, plural
from ..base.frames import PACKAGE_DIR
from ..base.present import Presented
from ..base.sequence import ItemSequence
from ..holders.census import Census
from ..holders.culprits import NO_HOLDER, group_culprits
from ..spans.record import SpanRecord
from ..spans.span import MemorySpan

__all__ = ["DiffEntry", "MemoryDiff", "diff"]

_UNNAMED = "(blocks without holder or allocation stack)"


@dataclass(frozen=True, slots=True)
class DiffEntry:
    """One holder group on both sides. Bytes are ints."""

    json_properties: ClassVar[tuple[str, ...]] = ("delta",)

    #: The holder group (``__main__.loss_history``), or where its blocks were allocated.
    holder: str
    before: int
    after: int
    #: Items of the group (storages, blocks, or distinct holder items for spans).
    count_before: int
    count_after: int
    #: One full path of the group, from the ``after`` side when it has one.
    example: str

    @property
    def delta(self) -> int:
        """``after - before``."""
        return self.after - self.before


@dataclass(frozen=True, slots=True)
class MemoryDiff(ItemSequence[DiffEntry], Presented):
    """The result of ``diff``: groups that changed, the largest growth first."""

    json_properties: ClassVar[tuple[str, ...]] = ("delta",)

    #: ``census``, ``snapshot`` or ``span``.
    kind: str
    #: Bytes on each side (live storages, live blocks, or allocated at span exit);
    #: ``None`` for a span that measured no CUDA device (nothing measured: ``n/a``).
    before_total: int | None
    after_total: int | None
    entries: tuple[DiffEntry, ...]
    #: Groups present on both sides with the same bytes (not listed in ``entries``).
    unchanged: int = 0
    notes: tuple[str, ...] = ()

    def _items(self) -> tuple[DiffEntry, ...]:
        """The entries."""
        return self.entries

    @property
    def delta(self) -> int | None:
        """``after_total - before_total`` (``None`` when either side was not measured)."""
        if self.before_total is None or self.after_total is None:
            return None
        return self.after_total - self.before_total

    @property
    def grew(self) -> tuple[DiffEntry, ...]:
        """Groups holding more on the ``after`` side, the largest growth first."""
        return tuple(e for e in self.entries if e.delta > 0)

    @property
    def shrank(self) -> tuple[DiffEntry, ...]:
        """Groups holding less on the ``after`` side."""
        return tuple(e for e in self.entries if e.delta < 0)

    def entry(self, holder: str) -> DiffEntry:
        """The entry of one holder group (``KeyError`` if it did not change)."""
        for e in self.entries:
            if e.holder == holder:
                return e
        raise KeyError(f"no changed group {holder!r}")


# --------------------------------------------------------------------------- groups


@dataclass
class _Group:
    nbytes: int = 0
    count: int = 0
    example: str = ""


def _join(
    kind: str,
    a: Mapping[str, _Group],
    b: Mapping[str, _Group],
    totals: tuple[int | None, int | None],
    notes: list[str],
) -> MemoryDiff:
    entries = []
    unchanged = 0
    for holder in dict.fromkeys([*a, *b]):
        x, y = a.get(holder, _Group()), b.get(holder, _Group())
        if x.nbytes == y.nbytes and x.count == y.count:
            unchanged += 1
            continue
        example = y.example or x.example or holder
        entries.append(DiffEntry(holder, x.nbytes, y.nbytes, x.count, y.count, example))
    entries.sort(key=lambda e: (-e.delta, e.holder))
    return MemoryDiff(kind, totals[0], totals[1], tuple(entries), unchanged, tuple(notes))


def _census_groups(census: Any, notes: list[str]) -> dict[str, _Group]:

    items = list(census.storages)
    unsearched = sum(1 for s in items if s.holders is None)
    if unsearched:
        notes.append(
            f"{plural(unsearched, 'storage')} without holders: take the census with "
            "cudamem.live_tensors(holders=True) to group them by holder"
        )
    groups: dict[str, _Group] = {}
    for c in group_culprits(items):
        holder = NO_HOLDER if c.holder.startswith("(") else c.holder
        g = groups.setdefault(holder, _Group(example=c.example))
        g.nbytes += c.nbytes
        g.count += c.storages
    return groups


def _library_dirs() -> tuple[str, ...]:
    import torch

    return (
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
        PACKAGE_DIR,
    )


def _block_group(frames: Any, skip: tuple[str, ...]) -> tuple[str, str]:
    """``(group, example)`` of one live block, from its frames."""

    if not isinstance(frames, list):
        return _UNNAMED, _UNNAMED
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename, name = str(f.get("filename", "")), str(f.get("name", ""))
        if filename == HOLDER_FILENAME:
            return str(f.get(CONTAINER_KEY, name)), name
        if filename == NOTE_FILENAME:
            return f"({name})", name
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename = str(f.get("filename", ""))
        if not filename or filename.startswith(skip) or filename.startswith("<frozen"):
            continue
        site = f"allocated at {filename}:{f.get('line', '?')} in {f.get('name', '?')}"
        return site, site
    return _UNNAMED, _UNNAMED


def _snapshot_groups(snapshot: Mapping[str, Any]) -> tuple[dict[str, _Group], int, int]:
    """Groups of the live blocks, their bytes, and the reserved bytes."""

    skip = _library_dirs()
    groups: dict[str, _Group] = {}
    live = reserved = 0
    for seg in snapshot.get("segments") or ():
        if not isinstance(seg, Mapping):
            continue
        total = seg.get("total_size")
        reserved += total if isinstance(total, int) else 0
        for block in seg.get("blocks") or ():
            if not isinstance(block, Mapping) or block.get("state") not in LIVE_STATES:
                continue
            size = block.get("size")
            size = size if isinstance(size, int) else 0
            group, example = _block_group(block.get("frames"), skip)
            g = groups.setdefault(group, _Group(example=example))
            g.nbytes += size
            g.count += 1
            live += size
    return groups, live, reserved


def _span_side(span: Any, notes: list[str], side: str) -> tuple[dict[str, _Group], int | None]:

    record = span.record if isinstance(span, MemorySpan) else span
    # A span that measured no CUDA device has no allocated level: None (n/a), never 0 B.
    level = sum(d.after.allocated for d in record.devices) if record.devices else None
    groups: dict[str, _Group] = {}
    report = None
    if isinstance(span, MemorySpan):
        try:
            report = span.leaks
        except ValueError:
            report = None
    if report is None:
        notes.append(
            f"{side} span {record.name!r} ran without leaks=True: only its allocated level "
            "is compared (run spans with cudamem.track(..., leaks=True) to group by holder)"
        )
        return groups, level
    for c in report.culprits:
        holder = NO_HOLDER if c.holder.startswith("(") else c.holder
        g = groups.setdefault(holder, _Group(example=c.example))
        g.nbytes += c.nbytes
        g.count += c.tensors
    return groups, level


# --------------------------------------------------------------------------- diff()


def _kind(value: Any, name: str) -> str:

    if isinstance(value, Census):
        return "census"
    if isinstance(value, (MemorySpan, SpanRecord)):
        return "span"
    if isinstance(value, (str, os.PathLike)) or (
        isinstance(value, Mapping) and isinstance(value.get("segments"), list)
    ):
        return "snapshot"
    raise TypeError(
        f"{name} must be a Census (cudamem.live_tensors), a span (cudamem.track), or a "
        f"snapshot (a dict or a file path), not {type(value).__name__}"
    )


def _load(value: Any) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value

    return load_snapshot(value)


def diff(a: Any, b: Any) -> MemoryDiff:
    """What grew from ``a`` to ``b``, grouped by holder.

    Args:
        a: the earlier side: a ``cudamem.holders.census.Census``, a span (``MemorySpan`` run with
            ``leaks=True``, or a ``SpanRecord``), or a snapshot (dict or file).
        b: the later side, of the same kind.

    Returns:
        ``MemoryDiff``: groups that changed, the largest growth first (``diff.grew``,
        ``diff.shrank``); ``print()`` it for a table.

    Raises:
        TypeError: an argument is none of those kinds, or the two kinds differ.
    """
    kind_a, kind_b = _kind(a, "a"), _kind(b, "b")
    if kind_a != kind_b:
        raise TypeError(f"b must be a {kind_a} like a, not a {kind_b}")
    notes: list[str] = []
    if kind_a == "census":
        ga, gb = _census_groups(a, notes), _census_groups(b, notes)
        notes = list(dict.fromkeys(notes))
        return _join("census", ga, gb, (a.total, b.total), notes)
    if kind_a == "snapshot":
        sa, sb = _load(a), _load(b)
        ga, live_a, res_a = _snapshot_groups(sa)
        gb, live_b, res_b = _snapshot_groups(sb)
        if res_a != res_b:
            notes.append(
                f"reserved {format_bytes(res_a)} → {format_bytes(res_b)} "
                f"({format_bytes(res_b - res_a, signed=True)})"
            )
        if _UNNAMED in ga or _UNNAMED in gb:
            notes.append(
                "some blocks carry neither a holder nor a stack: write snapshots with "
                "cudamem.dump_snapshot() (holders) or record history (stacks)"
            )
        return _join("snapshot", ga, gb, (live_a, live_b), notes)
    ga, level_a = _span_side(a, notes, "first")
    gb, level_b = _span_side(b, notes, "second")
    kept = {h: g.nbytes for h, g in gb.items() if g.nbytes and ga.get(h, _Group()).nbytes}
    if kept:
        top = max(kept, key=lambda h: kept[h])
        notes.append(
            f"both spans left memory behind in {top} ({format_bytes(kept[top])} in the "
            "second): if every call does, it grows by that much per call"
        )
    return _join("span", ga, gb, (level_a, level_b), notes)
