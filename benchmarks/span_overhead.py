"""What a span costs: per counter read, per enter+exit, and per training step, in one run.

Measured, interleaved so that drift hits every case alike:

  * **readers**, µs per call: ``backend.counters(0)`` (the active reader: the C++ one once
    built and validated, else the raw dict), the raw-dict read of the same three ints,
    ``torch._C._cuda_memoryStats(0)`` alone and ``torch.cuda.memory_allocated(0)``;
  * **enter+exit**, µs per span, per variant: ``track()`` with defaults, ``peak=False``,
    ``sync=True``, a decorated function, a nested pair, growth detection off, over the raw-dict
    reader and over a constant reader (cudamem's Python bookkeeping alone), against a minimal
    Python span over the active reader (the floor);
  * **per step**, % over the adjacent bare block (median of the paired ratios, with range), on
    a launch-bound step (a 1024-wide MLP at batch 256: ~1.3 ms CPU / 0.3 ms GPU), a balanced
    one (a 12-layer MLP, batch calibrated so that GPU time ~ CPU time, ~4.5 ms) and a
    GPU-bound one (a chain of 4096² matmuls calibrated to ~47 ms): ``track()``,
    ``track(sync=True)``, hand-written ``memory_allocated()`` before/after,
    ``torch.cuda.memory._record_memory_history()``, ``torch.profiler`` with
    ``profile_memory=True``, ``ScalarLogger.append(loss)`` and ``loss.item()``.

Blocks of steps are bracketed by CUDA events and queued back to back without synchronizing,
as a training loop runs; each case's block follows a bare block, and the median of the
per-round ratios cancels the drift of a shared host.

Goals: enter+exit <= 3 µs on the C++ reader (<= 25 µs on the dict path); with defaults
<= 1 % per step launch-bound and <= 0.2 % balanced; ``track()`` cheaper than
``_record_memory_history()`` on every step kind.

Usage: ``python benchmarks/span_overhead.py [--quick] [--out benchmarks/results/span_overhead.json]``
(under 4 minutes on an H200; ``--quick`` under one). Without a GPU it measures the CPU rows
(bookkeeping over a constant reader, the no-device path) and says which rows it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import ConstantReader, cpu_and_gpu_ms, machine, matmul_step

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import backend_base as _backend_base
from cudamem.native import spancore as _spancore
from cudamem.render.text import render_table
from cudamem.spans import span as _span

CUDA = torch.cuda.is_available()
#: Cycles of the spin kernel that holds the GPU back while the steps are queued.
SPIN = int(1e9)
DEVICE = "cuda:0" if CUDA else "cpu"
GPU_ONLY = "needs a CUDA GPU"


# --------------------------------------------------------------------------- readers


def dict_counters(device: int) -> tuple[int, int, int]:
    """The raw-dict read of the three counters (what serves until the C++ reader is ready)."""
    raw = torch._C._cuda_memoryStats(device)
    a = raw["allocated_bytes"]["all"]
    return (a["current"], raw["reserved_bytes"]["all"]["current"], a["peak"])


class DictReader(_backend_base.Backend):
    """The real backend, with counters read from the raw dict whatever reader is active."""

    def __init__(self, real: _backend_base.Backend) -> None:
        self.real = real

    def device_count(self) -> int:
        return self.real.device_count()

    def initialized_devices(self) -> tuple[int, ...]:
        return self.real.initialized_devices()

    def has_context(self, device: int) -> bool:
        return self.real.has_context(device)

    def counters(self, device: int) -> tuple[int, int, int]:
        return dict_counters(device)

    def counters_reset_peak(self, device: int) -> tuple[int, int, int]:
        values = dict_counters(device)
        torch._C._cuda_resetPeakMemoryStats(device)
        return values

    def synchronize(self, device: int) -> None:
        self.real.synchronize(device)

    def reset_peak(self, device: int) -> None:
        self.real.reset_peak(device)


def reader_name() -> str:
    """Which reader ``backend.counters()`` uses in this process, as the library says it."""
    status = getattr(_backend, "reader_status", None)
    if callable(status):
        with contextlib.suppress(Exception):
            s = status()
            return f"{s.reader} ({s.state}: {s.reason})"
    return "raw dict (this cudamem has no C++ reader)"


class MinimalSpan:
    """The floor: two counter reads and two clock reads, nothing else."""

    __slots__ = ("after", "before", "end", "start")

    def __init__(self, counters: Callable[[int], tuple[int, int, int]]) -> None:
        self.before = counters(0)
        self.start = time.perf_counter_ns()

    def close(self, counters: Callable[[int], tuple[int, int, int]]) -> None:
        self.end = time.perf_counter_ns()
        self.after = counters(0)


# --------------------------------------------------------------------------- timing


def per_call_us(
    cases: dict[str, Callable[[], object]],
    target_s: float,
    rounds: int,
    around: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] | None = None,
) -> dict[str, list[float]]:
    """µs per call of each case: ``rounds`` interleaved rounds of ~``target_s`` each
    (``around[name]()``: entered around that case's loops, e.g. ``python_path()``)."""
    around = around or {}
    counts = {}
    for name, fn in cases.items():  # calibrate the calls per round
        n, elapsed = 10, 0.0
        with around[name]() if name in around else contextlib.nullcontext():
            while elapsed < target_s / 4:
                n *= 2
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                elapsed = time.perf_counter() - t0
        counts[name] = max(10, int(n * target_s / elapsed))
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            n = counts[name]
            with around[name]() if name in around else contextlib.nullcontext():
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                out[name].append((time.perf_counter_ns() - t0) / n / 1e3)
        cudamem.clear_history()
    return out


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# --------------------------------------------------------------------------- steps


def mlp_step(width: int, batch: int, depth: int) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


@dataclass
class StepKind:
    name: str
    step: Callable[[], torch.Tensor]
    steps_per_block: int
    rounds: int
    params: dict[str, Any] = field(default_factory=dict)


def build_kinds(quick: bool) -> list[StepKind]:
    torch.backends.cuda.matmul.allow_tf32 = False
    launch = mlp_step(1024, 256, 3)
    cpu, gpu = cpu_and_gpu_ms(launch, n=10, spin_cycles=SPIN)
    kinds = [StepKind("launch-bound", launch, 20, 8 if quick else 24, _p(1024, 256, 3, cpu, gpu))]
    batch, cpu, gpu = 256, 0.0, 0.0
    for batch in (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192):
        cpu, gpu = cpu_and_gpu_ms(mlp_step(1024, batch, 12), n=5, spin_cycles=SPIN)
        if gpu >= 0.93 * cpu:
            break
    gc.collect()
    torch.cuda.empty_cache()
    balanced = mlp_step(1024, batch, 12)
    kinds.append(
        StepKind("balanced", balanced, 8, 6 if quick else 16, _p(1024, batch, 12, cpu, gpu))
    )
    _, one = cpu_and_gpu_ms(matmul_step(4096, 1, DEVICE), n=5, spin_cycles=SPIN)
    count = max(1, round(47.0 / max(one, 1e-3)))
    heavy = matmul_step(4096, count, DEVICE)
    cpu, gpu = cpu_and_gpu_ms(heavy, n=3, spin_cycles=SPIN)
    kinds.append(
        StepKind(
            "GPU-bound",
            heavy,
            2,
            3 if quick else 6,
            {"size": 4096, "matmuls": count, "cpu_ms": cpu, "gpu_ms": gpu},
        )
    )
    return kinds


def _p(width: int, batch: int, depth: int, cpu: float, gpu: float) -> dict[str, Any]:
    return {"width": width, "batch": batch, "layers": depth, "cpu_ms": cpu, "gpu_ms": gpu}


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def memory_history() -> Iterator[None]:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def profiler() -> Iterator[None]:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, profile_memory=True):
        yield


def run_steps(step: Callable[[], torch.Tensor], n: int, case: str, logger: Any) -> None:
    """``n`` steps instrumented as ``case`` says (the loop stays out of every case's way)."""
    if case in ("bare", "_record_memory_history()", "profiler(profile_memory=True)"):
        for _ in range(n):
            step()
    elif case == "track()":
        for _ in range(n):
            with cudamem.track("step"):
                step()
    elif case == "track(sync=True)":
        for _ in range(n):
            with cudamem.track("step", sync=True):
                step()
    elif case == "memory_allocated() before/after":
        for _ in range(n):
            torch.cuda.memory_allocated(0)
            step()
            torch.cuda.memory_allocated(0)
    elif case == "ScalarLogger.append(loss)":
        for _ in range(n):
            logger.append(step())
    elif case == "loss.item()":
        for _ in range(n):
            step().item()
    else:  # pragma: no cover
        raise ValueError(case)


STEP_CASES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "track()": nothing,
    "track(sync=True)": nothing,
    "memory_allocated() before/after": nothing,
    "_record_memory_history()": memory_history,
    "profiler(profile_memory=True)": profiler,
    "ScalarLogger.append(loss)": nothing,
    "loss.item()": nothing,
}


def block(step: Callable[[], torch.Tensor], n: int, case: str, logger: Any) -> Callable[[], float]:
    """Run one block of ``n`` steps; returns how to read its ms per step (after a sync)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with STEP_CASES.get(case, nothing)():
        start.record()
        run_steps(step, n, case, logger)
        end.record()
    return lambda: float(start.elapsed_time(end)) / n


def step_benchmarks(kinds: list[StepKind]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in kinds:
        logger = cudamem.ScalarLogger()
        for _ in range(5):
            run_steps(kind.step, kind.steps_per_block, "bare", logger)
        bare: list[float] = []
        ratios: dict[str, list[float]] = {case: [] for case in STEP_CASES}
        for _ in range(kind.rounds):
            pending = []
            for case in STEP_CASES:
                b = block(kind.step, kind.steps_per_block, "bare", logger)
                t = block(kind.step, kind.steps_per_block, case, logger)
                pending.append((case, b, t))
            torch.cuda.synchronize()
            for case, b, t in pending:
                bms, tms = b(), t()
                bare.append(bms)
                ratios[case].append(tms / bms)
            cudamem.clear_history()
        logger.close()
        results[kind.name] = {"params": kind.params, "bare_ms": bare, "ratios": ratios}
        print(f"  {kind.name}: done", file=sys.stderr)
    return results


# --------------------------------------------------------------------------- main


def span_core() -> Any:
    """The compiled span core, built (or loaded from the cache) and switched on before any
    timing, so that every span below runs on the path a user's spans run on after their
    first; ``None`` where it cannot serve (the Python path then serves every case)."""
    _spancore.EXTENSION.wait()
    with cudamem.track("switch"):  # the first open after the build switches to the core
        pass
    return _spancore.EXTENSION.native()


PYTHON_ROW = "track() defaults, Python open/close"


def python_path() -> contextlib.AbstractContextManager[None]:
    """Around a case's timed loop: spans open and close through the Python functions (the
    compiled core's figures beside them, in the same interleaved rounds)."""
    return _span._serving(None)


def span_cases(backend: _backend_base.Backend) -> dict[str, Callable[[], object]]:
    counters = backend.counters

    def minimal() -> None:
        MinimalSpan(counters).close(counters)

    def defaults() -> None:
        with cudamem.track("s"):
            pass

    def no_peak() -> None:
        with cudamem.track("s", peak=False):
            pass

    def synced() -> None:
        with cudamem.track("s", sync=True):
            pass

    @cudamem.track("decorated")
    def decorated() -> None:
        pass

    def nested() -> None:
        with cudamem.track("outer"), cudamem.track("inner"):
            pass

    return {
        "minimal Python span (the floor)": minimal,
        "track() defaults": defaults,
        "track(peak=False)": no_peak,
        "track(sync=True)": synced,
        "@track function call": decorated,
        "nested pair (2 spans)": nested,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/span_overhead.json")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 1 minute)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    target, rounds = (0.01, 5) if args.quick else (0.02, 15)
    skipped: list[str] = []
    data: dict[str, Any] = {"quick": args.quick}

    real = _backend.get()
    keep = None
    core = span_core()
    data["span_core"] = str(_spancore.status().reason)
    print(f"span core: {'compiled' if core is not None else 'Python'} ({data['span_core']})")
    if CUDA:
        keep = torch.ones(1 << 20, device=DEVICE)  # a context and some allocation
        torch.cuda.synchronize()
        real.counters(0)  # the first read starts the C++ reader's build, if there is one
        deadline = time.perf_counter() + 60
        while "building" in reader_name() and time.perf_counter() < deadline:
            time.sleep(0.5)
            real.counters(0)

    # -- readers
    reader_rows: list[list[str]] = []
    if CUDA:
        readers = per_call_us(
            {
                "backend.counters(0): active reader": lambda: real.counters(0),
                "backend.counters_reset_peak(0): active reader": lambda: real.counters_reset_peak(
                    0
                ),
                "raw dict: _cuda_memoryStats + 3 ints": lambda: dict_counters(0),
                "torch._C._cuda_memoryStats(0)": lambda: torch._C._cuda_memoryStats(0),
                "torch.cuda.memory_allocated(0)": lambda: torch.cuda.memory_allocated(0),
            },
            target,
            rounds,
        )
        data["readers_us"] = readers
        data["reader"] = reader_name()  # after the reads above, which validate a new reader
        reader_rows = [[k, *_us(v)] for k, v in readers.items()]
    else:
        skipped.append(f"counter readers: {GPU_ONLY}")
        data["reader"] = "none (no CUDA device)"

    # -- enter+exit
    spans: dict[str, list[float]] = {}
    if CUDA:
        measured = _spans(real, target, rounds)
        spans.update({f"{k} [active reader]": v for k, v in measured.items()})
        measured = _spans(DictReader(real), target, rounds, only=2)
        spans.update({f"{k} [raw dict]": v for k, v in measured.items()})
    else:
        skipped.append(f"enter+exit over a real reader: {GPU_ONLY}")
        spans["track() defaults [no CUDA device: nothing to read]"] = per_call_us(
            {"x": span_cases(real)["track() defaults"]}, target, rounds
        )["x"]
    measured = _spans(ConstantReader(), target, rounds)
    spans.update({f"{k} [constant reader]": v for k, v in measured.items()})
    data["spans_us"] = spans
    span_rows = [[k, *_us(v)] for k, v in spans.items()]

    # -- steps
    step_rows: list[list[str]] = []
    if CUDA:
        print("calibrating the steps ...", file=sys.stderr)
        kinds = build_kinds(args.quick)
        steps = step_benchmarks(kinds)
        data["steps"] = steps
        for kind, res in steps.items():
            p = res["params"]
            step_rows.append(
                [
                    f"{kind} ({p['cpu_ms']:.1f} ms CPU / {p['gpu_ms']:.1f} ms GPU)",
                    f"{statistics.median(res['bare_ms']):.2f} ms",
                    "",
                ]
            )
            for case, xs in res["ratios"].items():
                step_rows.append([f"  {case}", *_pct(xs)])
    else:
        skipped.append(f"per-step overhead (launch-bound, balanced, GPU-bound): {GPU_ONLY}")

    goals = check_goals(data)
    data["goals"] = goals
    data["seconds"] = time.perf_counter() - t_start
    del keep

    print()
    if reader_rows:
        print(
            render_table(
                ["counter read", "median µs", "range µs"],
                reader_rows,
                title="readers (µs per call)",
            )
        )
        print()
    print(
        render_table(["span", "median µs", "range µs"], span_rows, title="enter+exit (µs per span)")
    )
    print()
    if step_rows:
        print(
            render_table(
                ["per step", "vs adjacent bare (median)", "range"],
                step_rows,
                title="training steps: % over the adjacent bare block, median of the paired ratios",
            )
        )
        print()
    for line in skipped:
        print(f"skipped: {line}")
    print(f"reader: {data['reader']}")
    print(f"span core: {data['span_core']}")
    for goal in goals:
        print(f"goal: {goal['goal']}: {goal['measured']} -> {goal['verdict']}")
    print(f"({data['seconds']:.1f} s)")
    data["skipped"] = skipped
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"machine": machine(), **data}, fh, indent=2)
    print(f"wrote {args.out}")


def _spans(
    backend: _backend_base.Backend, target: float, rounds: int, only: int | None = None
) -> dict[str, list[float]]:
    """enter+exit µs of each span variant with ``backend`` serving the counters (the first
    ``only`` variants when given)."""
    cases = span_cases(backend)
    if only is not None:
        cases = dict(list(cases.items())[:only])
    around: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {}
    if only is None and _spancore.EXTENSION.native() is not None:
        cases[PYTHON_ROW] = cases["track() defaults"]
        around[PYTHON_ROW] = python_path
    with _backend.use(backend):
        out = per_call_us(cases, target, rounds, around)
        out["nested pair (2 spans)"] = [x / 2 for x in out.get("nested pair (2 spans)", [])]
        if only is None:
            previous = cudamem.leak_settings()
            cudamem.configure_leaks(enabled=False)
            try:
                out["track(), growth detection off"] = per_call_us(
                    {"x": cases["track() defaults"]}, target, rounds
                )["x"]
            finally:
                cudamem.configure_leaks(**dataclasses.asdict(previous))
    if not out["nested pair (2 spans)"]:
        del out["nested pair (2 spans)"]
    else:
        out["nested pair, per span"] = out.pop("nested pair (2 spans)")
    return out


def _us(xs: list[float]) -> list[str]:
    return [f"{statistics.median(xs):.2f}", f"{min(xs):.2f} .. {max(xs):.2f}"]


def _pct(ratios: list[float]) -> list[str]:
    med = (statistics.median(ratios) - 1) * 100
    lo, hi = (min(ratios) - 1) * 100, (max(ratios) - 1) * 100
    return [f"{med:+.2f} %", f"{lo:+.1f} .. {hi:+.1f} %"]


def check_goals(data: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's goals against this run's medians."""
    goals: list[dict[str, str]] = []
    spans = data["spans_us"]

    def add(goal: str, value: float | None, limit: float, unit: str) -> None:
        if value is None:
            goals.append({"goal": goal, "measured": "n/a", "verdict": "not measured (no GPU)"})
            return
        verdict = "met" if value <= limit else "NOT met"
        goals.append({"goal": goal, "measured": f"{value:.2f} {unit}", "verdict": verdict})

    active = spans.get("track() defaults [active reader]")
    reader = data.get("reader", "")
    label = "C++ reader" if reader.startswith("C++") else "active reader (not the C++ one)"
    add(f"track() enter+exit <= 3 µs, {label}", _med(active), 3.0, "µs")
    add(
        "track() enter+exit <= 25 µs, raw dict",
        _med(spans.get("track() defaults [raw dict]")),
        25.0,
        "µs",
    )
    steps = data.get("steps", {})
    for kind, limit in (("launch-bound", 1.0), ("balanced", 0.2)):
        r = steps.get(kind, {}).get("ratios", {}).get("track()")
        add(
            f"track() per step <= {limit} %, {kind}",
            None if r is None else (_med(r) - 1) * 100,
            limit,
            "%",
        )
    for kind, res in steps.items():
        t = (_med(res["ratios"]["track()"]) - 1) * 100
        h = (_med(res["ratios"]["_record_memory_history()"]) - 1) * 100
        goals.append(
            {
                "goal": f"track() cheaper than _record_memory_history(), {kind}",
                "measured": f"{t:+.2f} % vs {h:+.2f} %",
                "verdict": "met" if t < h else "NOT met",
            }
        )
    return goals


def _med(xs: list[float] | None) -> float | None:
    return None if not xs else statistics.median(xs)


if __name__ == "__main__":
    main()
