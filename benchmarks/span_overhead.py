"""What a span costs: enter+exit alone, and around a real training step.

Compares, in one run:
  * one ``cudamem.track()`` enter+exit (sync=False and sync=True) against the plain-PyTorch way,
    reading ``torch.cuda.memory_allocated()`` + ``memory_reserved()`` at both edges;
  * a 1024-wide MLP training step (batch 256), timed with CUDA events: bare, inside
    ``track()`` (sync=False / sync=True), under ``torch.profiler.profile(profile_memory=True)``
    and under ``torch.cuda.memory._record_memory_history()``.

Goal (issue 2): a span without sync costs <= 25 µs enter+exit; track() slows the step <= 2 %.
Usage: ``python benchmarks/span_overhead.py [--out benchmarks/results/span_overhead.json]``.
Without a GPU it runs a CPU smoke version (the figures then mean little).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _common import emit, median

import cudamem

CUDA = torch.cuda.is_available()


def time_edges(fn: Callable[[], None], n: int, rounds: int) -> list[float]:
    """Per-call µs of ``fn`` over ``rounds`` rounds of ``n`` calls."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1e3)
    return out


def edge_benchmarks(n: int, rounds: int) -> dict[str, list[float]]:
    if CUDA:
        keep = torch.ones(1024, device="cuda:0")  # a context and some allocation exist
        torch.cuda.synchronize()
    else:
        keep = torch.ones(1024)

    def public() -> None:
        if CUDA:
            torch.cuda.memory_allocated(0)
            torch.cuda.memory_reserved(0)
            torch.cuda.memory_allocated(0)
            torch.cuda.memory_reserved(0)

    def public_sync() -> None:
        if CUDA:
            torch.cuda.synchronize()
        public()
        if CUDA:
            torch.cuda.synchronize()

    def span_nosync() -> None:
        with cudamem.track("s", sync=False):
            pass

    def span_nosync_nopeak() -> None:
        with cudamem.track("s", sync=False, peak=False):
            pass

    def span_sync() -> None:
        with cudamem.track("s"):
            pass

    cases = {
        "memory_allocated()+memory_reserved() at both edges": public,
        "  same + synchronize() at both edges": public_sync,
        "track(sync=False)": span_nosync,
        "track(sync=False, peak=False)": span_nosync_nopeak,
        "track() (sync=True)": span_sync,
    }
    results: dict[str, list[float]] = {k: [] for k in cases}
    # Interleave rounds so drift hits every case alike.
    for _ in range(rounds):
        for name, fn in cases.items():
            results[name].extend(time_edges(fn, n, 1))
    del keep
    cudamem.clear_history()
    return results


class MLP(torch.nn.Module):
    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def make_step(device: str) -> Callable[[], None]:
    model = MLP().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def time_steps(step: Callable[[], None], wrap: Callable[[], Any], n: int) -> float:
    """Mean ms per step over ``n`` steps, each step inside ``wrap()``."""
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            with wrap():
                step()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / n
    t0 = time.perf_counter()
    for _ in range(n):
        with wrap():
            step()
    return (time.perf_counter() - t0) * 1e3 / n


def step_benchmarks(n: int, rounds: int) -> dict[str, list[float]]:
    device = "cuda:0" if CUDA else "cpu"
    step = make_step(device)
    for _ in range(20):
        step()

    def span_nosync() -> Any:
        return cudamem.track("step", sync=False)

    def span_sync() -> Any:
        return cudamem.track("step")

    cases: dict[str, Callable[[], Any]] = {
        "bare step": nothing,
        "inside track(sync=False)": span_nosync,
        "inside track() (sync=True)": span_sync,
    }
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, wrap in cases.items():
            results[name].append(time_steps(step, wrap, n))
    cudamem.clear_history()

    # The heavy peers run once per round after the cheap ones (they cannot be nested in a
    # span-per-step loop without distorting each other).
    prof_ms: list[float] = []
    hist_ms: list[float] = []
    for _ in range(rounds):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if CUDA:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, profile_memory=True):
            prof_ms.append(time_steps(step, nothing, n))
        if CUDA:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            try:
                hist_ms.append(time_steps(step, nothing, n))
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
    results["under profiler(profile_memory=True)"] = prof_ms
    if hist_ms:
        results["under _record_memory_history()"] = hist_ms
    return results


# Other benchmark families register here (e.g. growth detection, issue 6).
EXTRA_STEP_CASES: list[Callable[[Callable[[], None], int, int], dict[str, list[float]]]] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/span_overhead.json")
    parser.add_argument("--edge-calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not CUDA:
        print("no CUDA GPU: CPU smoke run; the figures below do not describe GPU overhead\n")

    edges = edge_benchmarks(args.edge_calls, args.rounds)
    base_edge = median(edges["memory_allocated()+memory_reserved() at both edges"])
    rows = []
    for name, xs in edges.items():
        rows.append(
            [
                name,
                f"{median(xs):.1f}",
                f"{min(xs):.1f}",
                f"{max(xs):.1f}",
                f"{median(xs) / base_edge:.2f}x" if base_edge else "n/a",
            ]
        )
    emit_rows = rows

    steps = step_benchmarks(args.steps, args.rounds)
    device = "cuda:0" if CUDA else "cpu"
    for extra in EXTRA_STEP_CASES:
        steps.update(extra(make_step(device), args.steps, args.rounds))
    bare = median(steps["bare step"])
    step_rows = []
    for name, xs in steps.items():
        med = median(xs)
        step_rows.append(
            [
                name,
                f"{med:.3f}",
                f"{min(xs):.3f}",
                f"{max(xs):.3f}",
                f"{(med / bare - 1) * 100:+.1f} %",
            ]
        )

    emit(
        "span enter+exit (µs per span, median of rounds)",
        ["case", "median µs", "min", "max", "vs public accessors"],
        emit_rows,
        {
            "edges_us": edges,
            "steps_ms": steps,
            "summary": {
                "span_nosync_us": median(edges["track(sync=False)"]),
                "span_sync_us": median(edges["track() (sync=True)"]),
                "public_accessors_us": base_edge,
                "bare_step_ms": bare,
                "step_overhead_pct": {k: (median(v) / bare - 1) * 100 for k, v in steps.items()},
            },
        },
        args.out,
    )
    print()
    from cudamem.render.text import render_table

    print(
        render_table(
            ["training step (1024-wide MLP, batch 256)", "median ms", "min", "max", "vs bare"],
            step_rows,
            title=f"training step, {args.steps} steps x {args.rounds} rounds, CUDA events",
        )
    )


if __name__ == "__main__":
    main()
