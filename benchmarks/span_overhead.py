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
from cudamem.render.text import render_table

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


@contextlib.contextmanager
def profiler_on() -> Iterator[None]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if CUDA:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True):
        yield


@contextlib.contextmanager
def memory_history_on() -> Iterator[None]:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


#: Step cases: name -> (per-step wrapper factory, whole-run context). Other benchmark families
#: (e.g. growth detection, issue 6) add theirs here before main() runs.
STEP_CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "inside track(sync=False)": (lambda: cudamem.track("step", sync=False), nothing),
    "inside track() (sync=True)": (lambda: cudamem.track("step"), nothing),
    "inside track(sync=False, peak=False)": (
        lambda: cudamem.track("step", sync=False, peak=False),
        nothing,
    ),
    "under profiler(profile_memory=True)": (nothing, profiler_on),
}
if CUDA:
    STEP_CASES["under _record_memory_history()"] = (nothing, memory_history_on)


# -- growth detection (issue 6) --
@contextlib.contextmanager
def growth_detection(enabled: bool) -> Iterator[None]:
    """Growth detection on or off for a run, then the settings as they were."""
    previous = cudamem.leak_settings()
    cudamem.configure_leaks(enabled=enabled)
    try:
        yield
    finally:
        cudamem.configure_leaks(**previous.to_dict())


def add_growth_detection_cases() -> None:
    """The training step inside ``track()`` with growth detection on (a clean loop: the
    detector only compares levels, no census ever runs) and off. Goal: the same <= 2 % as a
    plain span, i.e. no difference between the two."""
    span = lambda: cudamem.track("step", sync=False)  # noqa: E731
    STEP_CASES["inside track(sync=False), growth detection off"] = (
        span,
        lambda: growth_detection(False),
    )
    STEP_CASES["inside track(sync=False), growth detection on"] = (
        span,
        lambda: growth_detection(True),
    )


add_growth_detection_cases()


def _block(step: Callable[[], None], wrap: Callable[[], Any], n: int) -> Callable[[], float]:
    """Run ``n`` steps, each inside ``wrap()``; returns a function giving their ms per step.

    On a GPU the block is bracketed by CUDA events and nothing synchronizes: blocks queue
    back to back, exactly as a training loop runs, and are read after the round.
    """
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            with wrap():
                step()
        end.record()
        return lambda: float(start.elapsed_time(end)) / n
    t0 = time.perf_counter()
    for _ in range(n):
        with wrap():
            step()
    ms = (time.perf_counter() - t0) * 1e3 / n
    return lambda: ms


def step_benchmarks(n: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per case: ms per step of each block, and the ratio to the bare block right before it.

    A launch-bound 1.5 ms step drifts by ±10 % and more between runs on a shared host, far
    more than the effect measured. So every case runs in short blocks (``n`` steps),
    alternating with bare blocks, queued back to back without synchronizing (as a training
    loop runs), ``rounds`` times; the median of the paired ratios cancels the drift.
    """
    device = "cuda:0" if CUDA else "cpu"
    step = make_step(device)
    for _ in range(30):
        step()
    times: dict[str, list[float]] = {"bare step": []}
    ratios: dict[str, list[float]] = {}
    for _ in range(rounds):
        pending = []
        for name, (wrap, around) in STEP_CASES.items():
            bare = _block(step, nothing, n)
            with around():
                timed = _block(step, wrap, n)
            pending.append((name, bare, timed))
        if CUDA:
            torch.cuda.synchronize()
        for name, bare, timed in pending:
            b, t = bare(), timed()
            times["bare step"].append(b)
            times.setdefault(name, []).append(t)
            ratios.setdefault(name, []).append(t / b)
        cudamem.clear_history()
    return times, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/span_overhead.json")
    parser.add_argument("--edge-calls", type=int, default=2000)
    parser.add_argument("--edge-rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    if not CUDA:
        print("no CUDA GPU: CPU smoke run; the figures below do not describe GPU overhead\n")

    edges = edge_benchmarks(args.edge_calls, args.edge_rounds)
    base_edge = median(edges["memory_allocated()+memory_reserved() at both edges"])
    edge_rows = [
        [
            name,
            f"{median(xs):.1f}",
            f"{min(xs):.1f}",
            f"{max(xs):.1f}",
            f"{median(xs) / base_edge:.2f}x" if base_edge else "n/a",
        ]
        for name, xs in edges.items()
    ]
    steps, ratios = step_benchmarks(args.steps, args.rounds)
    bare = median(steps["bare step"])
    step_rows = [["bare step", f"{bare:.3f}", f"{min(steps['bare step']):.3f}", "", ""]]
    for name, xs in ratios.items():
        step_rows.append(
            [
                name,
                f"{median(steps[name]):.3f}",
                f"{min(steps[name]):.3f}",
                f"{(median(xs) - 1) * 100:+.1f} %",
                f"{(min(xs) - 1) * 100:+.1f} .. {(max(xs) - 1) * 100:+.1f} %",
            ]
        )
    summary = {
        "span_nosync_us": median(edges["track(sync=False)"]),
        "span_sync_us": median(edges["track() (sync=True)"]),
        "public_accessors_us": base_edge,
        "bare_step_ms": bare,
        "step_overhead_pct": {k: (median(v) - 1) * 100 for k, v in ratios.items()},
    }
    emit(
        "span enter+exit (µs per span, median of rounds)",
        ["case", "median µs", "min", "max", "vs public accessors"],
        edge_rows,
        {"edges_us": edges, "steps_ms": steps, "step_ratios": ratios, "summary": summary},
        args.out,
    )
    print()
    print(
        render_table(
            [
                "training step (1024-wide MLP, batch 256)",
                "median ms",
                "min ms",
                "vs adjacent bare (median)",
                "range",
            ],
            step_rows,
            title=(
                f"training step, blocks of {args.steps} steps alternating with bare blocks, "
                f"{args.rounds} rounds, CUDA events"
            ),
        )
    )


if __name__ == "__main__":
    main()
