"""PyTorch's ``MemTracker`` as the anchor of the per-module profile's tests and benchmark:
what it says each module's forward kept in one step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def memtracker_kept(
    model: torch.nn.Module, external: Sequence[Any], step: Callable[[], Any], device: str
) -> dict[str, int]:
    """``{module name: bytes}``: the tracker's total at each forward's exit minus at its
    entry, summed over the module's forward calls in ``step`` (recomputations left out)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState

    tracker = MemTracker()
    tracker.track_external(model, *external)
    with tracker:
        step()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    kept: dict[str, int] = {}
    for stats in tracker.memory_tracking.values():
        pre = stats.snapshots.get(_ModState.PRE_FW, [])
        post = stats.snapshots.get(_ModState.POST_FW, [])
        total = 0
        for a, b in zip(pre, post, strict=False):
            total += b.get(dev, {}).get(_TOTAL_KEY, 0) - a.get(dev, {}).get(_TOTAL_KEY, 0)
        kept[stats.mod_fqn] = total
    return kept


def compare(
    ours: dict[str, float], theirs: dict[str, int], *, floor: int, slack: int = 0
) -> list[str]:
    """The modules (with at least ``floor`` bytes by either) whose figures differ by more
    than 5 % plus ``slack`` bytes, one line each."""
    bad = []
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name, 0.0), theirs.get(name, 0)
        if max(abs(a), abs(b)) < floor:
            continue
        if abs(a - b) > 0.05 * abs(b) + slack:
            bad.append(f"{name}: cudamem {a:.0f} B, MemTracker {b} B")
    return bad
