"""Text rendering of the integrations' results (a released Trainer, a test's memory check)."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..integrations.results import MemoryCheck, TrainerRelease
from .leaks import render_culprit

__all__ = ["render_memory_check", "render_trainer_release"]


@renders(TrainerRelease)
def render_trainer_release(r: TrainerRelease) -> str:
    """What was dropped, what of the model and optimizer state was freed, who holds the rest."""
    lines = [
        f"released the Trainer: {r.freed} of {plural(r.tracked, 'storage')} of the model, "
        "gradients and "
        f"optimizer state freed ({format_bytes(r.freed_bytes)} of "
        f"{format_bytes(r.tracked_bytes)})"
    ]
    if r.dropped:
        lines.append("  dropped: " + ", ".join(r.dropped))
    if r.remaining:
        lines.append(f"  still alive ({format_bytes(r.remaining_bytes)}), held by:")
        lines.extend(f"    {render_culprit(c)}" for c in r.remaining)
        lines.append(
            "  del those references (your own model variable too), then call "
            "release_trainer() or cudamem.release() again"
        )
    if r.release is not None:
        for d in r.release.devices:
            lines.append(
                f"  cuda:{d.device}: returned {format_bytes(d.freed_reserved)} to CUDA, "
                f"{format_bytes(d.still_allocated)} still allocated"
            )
    lines.extend(f"  note: {n}" for n in r.notes)
    return "\n".join(lines)


@renders(MemoryCheck)
def render_memory_check(check: MemoryCheck) -> str:
    """The failure text of a test: leaked storages with their holders, peaks over the limit."""
    lines: list[str] = []
    if check.leak_limit is not None and check.leaked_bytes > check.leak_limit and check.leaked:
        lines.append(
            f"cudamem: {len(check.leaked)} {check.device} storage"
            f"{'' if len(check.leaked) == 1 else 's'} ({format_bytes(check.leaked_bytes)}) "
            f"created by this test {'is' if len(check.leaked) == 1 else 'are'} still alive "
            f"after it (limit {format_bytes(check.leak_limit)}):"
        )
        for s in check.leaked[:10]:
            shape = "×".join(map(str, s.shape or ())) or "scalar"
            lines.append(f"  {format_bytes(s.nbytes)} {s.dtype}[{shape}] on {s.device}, held by:")
            paths = [h.path for h in (s.holders or ()) if not h.caller]
            lines.extend(f"    {h}" for h in paths[:5])
            if not paths:
                lines.append("    (no holder reachable from Python: C++ or an autograd graph)")
        if len(check.leaked) > 10:
            lines.append(f"  ... and {len(check.leaked) - 10} more")
    for device, grown in check.unexplained:
        lines.append(
            f"cudamem: {device} has {format_bytes(grown)} more allocated than before the test "
            "that no live tensor accounts for (autograd graphs without a Python object, "
            "C++ caches); warm-up runs (warmup=1) exclude what a first call caches"
        )
    for device, peak in check.peaks:
        if check.memory_limit is not None and peak > check.memory_limit:
            lines.append(
                f"cudamem: the test allocated up to {format_bytes(peak)} on {device} at once, "
                f"over the limit of {format_bytes(check.memory_limit)}"
            )
    lines.extend(f"  note: {n}" for n in check.notes)
    if not lines:
        top = "" if check.peak is None else f", peak {format_bytes(check.peak)}"
        return f"cudamem: {check.test}: no {check.device} storage outlived the test{top}"
    return "\n".join(lines)
