"""What ``cudamem.plan`` spends on garbage collection beyond its steps, in a process that
imported transformers and lightning (their heap: what a full collection walks), three ways:

* ``model= given (today)``: ``plan(step, model=, optimizer=)``, whose tensors account for
  the allocated bytes: no full collection at the start (``UNACCOUNTED_SHARE`` in
  ``cudamem/fit/_runner.py``), the heap frozen;
* ``no model= (today)``: ``plan(step)``: the full collection at the start, then the heap
  frozen;
* ``not frozen``: ``plan(step)`` with ``gc.freeze`` not used (the plan before 48faac4).

The steps are the fake allocator's of ``tests/fakes.py`` (instant: what is left is the
plan's own work): a training step whose first call creates 300 MiB of optimizer state (the
allocated level rises, so the plan runs a full collection after the warm-up, as on the GPU)
and whose peak is 1000 MiB + 50 MiB x n. Rounds interleave the ways; each reports the
plan's time, the start's full collection and the full collections after it, median and
range. On the GPU the same collections cost the same (they walk the same Python heap): the
plan's profile there is in ``docs/design.md`` ("Held out, and where the time beyond the
steps went"; "The start's collection, and a wider bracket").

Usage: ``python benchmarks/plan_gc.py [--rounds 7] [--out benchmarks/results/plan-gc.json]``.
No GPU; about fifteen seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import emit, fmt_seconds, median, spread

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.fit import planner
from tests.fakes import FakeAllocator

MiB = 1 << 20
GiB = 1 << 30


class Card(FakeAllocator):
    """The fake allocator with a capacity: what its reserved leaves is free. Its storages
    are the host's, so that a CPU model's tensors are on it."""

    storages = "cpu"
    total = 80 * GiB

    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        return (self.total - self.reserved[device], self.total)


def heap() -> dict[str, Any]:
    """Import what a training process imports (where installed); the heap's size."""
    imported = []
    for name in ("transformers", "lightning"):
        with contextlib.suppress(ImportError):
            __import__(name)
            imported.append(name)
    gc.collect()
    return {"imported": imported, "objects": len(gc.get_objects())}


@contextlib.contextmanager
def counted_collections() -> Iterator[list[tuple[int, float]]]:
    """Every ``gc.collect`` call while inside: (generation, seconds)."""
    real = gc.collect
    calls: list[tuple[int, float]] = []

    def timed(generation: int = 2) -> int:
        start = time.perf_counter()
        found = real(generation)
        calls.append((generation, time.perf_counter() - start))
        return found

    gc.collect = timed  # type: ignore[assignment]
    try:
        yield calls
    finally:
        gc.collect = real  # type: ignore[assignment]


class Plan(NamedTuple):
    seconds: float
    #: The full collection before the first step (0 where the plan skipped it).
    start_full: float
    #: The full collections after the first step, and how many.
    later_full: float
    later_count: int


def one_plan(frozen: bool, with_model: bool = False) -> Plan:
    """One plan of the fake step; ``with_model``: ``model=`` and ``optimizer=`` given, their
    bytes allocated on the card."""
    card = Card()
    made: list[int] = []
    began: list[int] = []

    def step(n: int) -> None:
        if not began:
            began.append(len(calls))
        if not made:
            card.alloc(300 * MiB)  # the optimizer state, kept
            made.append(1)
        peak = 1000 * MiB + 50 * MiB * n
        card.alloc(peak)
        card.free(peak)

    model = torch.nn.Linear(1024, 1024) if with_model else None
    optimizer = torch.optim.AdamW(model.parameters()) if model is not None else None
    saved = planner.frozen_heap
    if not frozen:
        planner.frozen_heap = lambda: contextlib.nullcontext(False)  # type: ignore[assignment]
    try:
        with _backend.use(card), counted_collections() as calls:
            if model is not None:
                card.alloc(sum(p.numel() * p.element_size() for p in model.parameters()))
            start = time.perf_counter()
            cudamem.plan(step, model=model, optimizer=optimizer)
            seconds = time.perf_counter() - start
    finally:
        planner.frozen_heap = saved
    first = began[0] if began else len(calls)
    start_full = sum(s for generation, s in calls[:first] if generation == 2)
    later = [s for generation, s in calls[first:] if generation == 2]
    return Plan(seconds, start_full, sum(later), len(later))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/plan-gc.json")
    args = parser.parse_args(argv)
    found = heap()
    ways: dict[str, Callable[[], Plan]] = {
        "model= given (today)": lambda: one_plan(True, with_model=True),
        "no model= (today)": lambda: one_plan(True),
        "not frozen": lambda: one_plan(False),
    }
    runs: dict[str, list[Plan]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            runs[name].append(way())
    rows, data = [], {}
    for name, results in runs.items():
        plan_s = [r.seconds for r in results]
        first = [r.start_full for r in results]
        later = [r.later_full for r in results]
        counts = sorted({r.later_count for r in results})
        rows.append(
            [
                name,
                fmt_seconds(plan_s),
                fmt_seconds(first),
                fmt_seconds(later),
                ", ".join(map(str, counts)),
            ]
        )
        data[name] = {
            "plan_seconds": plan_s,
            "start_full_collection_seconds": first,
            "later_full_collection_seconds": later,
            "median_plan_seconds": median(plan_s),
            "range_plan_seconds": spread(plan_s),
            "median_start_full_seconds": median(first),
            "median_later_full_seconds": median(later),
            "later_full_collections": counts,
        }
    result = {"heap": found, "rounds": args.rounds, "ways": data}
    emit(
        f"cudamem.plan's collections beyond its steps ({found['objects']:,} objects; "
        f"imported: {', '.join(found['imported']) or 'nothing more'})",
        [
            "way",
            "plan (fake steps)",
            "full collection at the start",
            "full collections after it",
            "how many",
        ],
        rows,
        result,
        args.out,
    )
    return result


if __name__ == "__main__":
    main()
