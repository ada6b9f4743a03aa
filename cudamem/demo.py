"""The seeds' experiments, reproduced through cudamem: collection only, no printing.

Each experiment returns a frozen :class:`Experiment` (a table, a one-line explanation and
PASS/FAIL checks); ``python -m cudamem demo`` renders them. Experiments that need a GPU are
returned as skipped on a machine without one.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _backend
from .render.text import format_bytes
from .span import MemorySpan, track

__all__ = ["Check", "Experiment", "experiments", "run_demo"]

MiB = 1024**2


@dataclass(frozen=True, slots=True)
class Check:
    """One PASS/FAIL line of the demo."""

    name: str
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Experiment:
    """One reproduced experiment: what it shows, its table and its checks."""

    key: str
    title: str
    explanation: str
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    checks: tuple[Check, ...] = ()
    #: Why the experiment did not run (no GPU), or None when it ran.
    skipped: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        """True when it ran and every check passed."""
        return self.skipped is None and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "key": self.key,
            "title": self.title,
            "explanation": self.explanation,
            "headers": list(self.headers),
            "rows": [list(r) for r in self.rows],
            "checks": [c.to_dict() for c in self.checks],
            "skipped": self.skipped,
            "notes": list(self.notes),
        }


def _gpu() -> int | None:
    return 0 if _backend.get().device_count() > 0 else None


def _span_row(span: MemorySpan, device: int) -> tuple[str, ...]:
    d = span.device(device)
    return (
        span.name,
        format_bytes(d.allocated_delta, signed=True),
        format_bytes(d.reserved_delta, signed=True),
        format_bytes(d.after.allocated),
        format_bytes(d.after.reserved),
    )


def _expect(name: str, span: MemorySpan, device: int, alloc: int, reserved: int) -> Check:
    d = span.device(device)
    ok = d.allocated_delta == alloc and d.reserved_delta == reserved
    detail = (
        f"allocated {format_bytes(d.allocated_delta, signed=True)} "
        f"(expected {format_bytes(alloc, signed=True)}), "
        f"reserved {format_bytes(d.reserved_delta, signed=True)} "
        f"(expected {format_bytes(reserved, signed=True)})"
    )
    return Check(name, ok, detail)


def seed000_lifecycle() -> Experiment:
    """Seed 000: a 256 MiB tensor through create, del-while-listed, clear, empty_cache."""
    key, title = "seed000-256mib", "Seed 000: a 256 MiB tensor, del, list.clear() and empty_cache()"
    explanation = (
        "del removes a name, not the tensor: while a list holds it nothing is freed; "
        "clearing the list frees the allocation, and only empty_cache() returns the cache."
    )
    device = _gpu()
    if device is None:
        return Experiment(key, title, explanation, skipped="needs a CUDA GPU")
    backend = _backend.get()
    gc.collect()
    backend.empty_cache()
    spans: list[MemorySpan] = []
    with track("create x = ones(8192, 8192)", device=device) as s:
        x = torch.ones((8192, 8192), device=f"cuda:{device}", dtype=torch.float32)
    spans.append(s)
    with track("empty_cache() while x is alive", device=device) as s:
        backend.empty_cache()
    spans.append(s)
    saved = [x]
    with track("del x (the list still holds it)", device=device) as s:
        del x
        gc.collect()
        backend.empty_cache()
    spans.append(s)
    with track("saved.clear()", device=device) as s:
        saved.clear()
        gc.collect()
    spans.append(s)
    with track("empty_cache()", device=device) as s:
        backend.empty_cache()
    spans.append(s)
    expected = [
        (256 * MiB, 256 * MiB),
        (0, 0),
        (0, 0),
        (-256 * MiB, 0),
        (0, -256 * MiB),
    ]
    checks = tuple(
        _expect(sp.name, sp, device, a, r) for sp, (a, r) in zip(spans, expected, strict=True)
    )
    return Experiment(
        key,
        title,
        explanation,
        headers=("step", "allocated Δ", "reserved Δ", "allocated", "reserved"),
        rows=tuple(_span_row(sp, device) for sp in spans),
        checks=checks,
    )


def experiments() -> Sequence[tuple[str, Callable[[], Experiment]]]:
    """Every experiment of the demo, in order: (key, function)."""
    return (("seed000-256mib", seed000_lifecycle),)


def run_demo(
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Experiment]:
    """Run the experiments (or ``only`` those keys) and return their results."""
    results = []
    for key, func in experiments():
        if only and key not in only:
            continue
        if progress is not None:
            progress(key)
        results.append(func())
    return results
