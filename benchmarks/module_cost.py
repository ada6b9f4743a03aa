"""Where the per-module profile's time goes, in µs per module call: before issue 36 and now.

Each case is a small training step (forward, backward, optimizer step), small enough that the
host's work is what a step costs (launch-bound on a GPU): a ResNet-18 (torchvision's module
tree, rebuilt here: 76 module calls a step, batch 2 at 32²) and a 2-layer GPT-2 built from a
transformers config (no download). Each runs bare, under the profile as it was before issue 36
(``benchmarks/_modules_before.py``, a frozen copy) and under ``cudamem.track_modules`` now, in
interleaved rounds of blocks of steps inside one profile (hooks installed once per block, as a
user's run keeps them over many steps). The cost per module call is (profiled - bare) over the
module calls of a step: median over rounds, with the range.

Counter reads: on a GPU the real allocator's (the C++ reader, the span core); on the CPU two
stand-ins: ``constant``, a device whose reads are C-level calls as cheap as the C++ reader's,
and ``fake``, the tests' fake allocator (reads in Python, under a lock).

The breakdown splits one more profiled block per implementation with exclusive timers around
its parts (each timer's own cost, calibrated on an empty function, taken off): the forward
pre- and post-hooks, the search for the first grad-requiring input and output, the autograd
hooks registered for the backward (before: two ``register_prehook`` and a ``_Backward`` per
call; now: one gate per node), those hooks when they run, the spans' open and close, step
detection with the engine's end-of-backward callback, state reads; torch's own hook dispatch
(``nn.Module._call_impl`` with no-op hooks, timed on ``nn.Identity``); cyclic garbage
collection (``gc.callbacks``: profiled minus bare, a part of the rows above, shown apart as
the cost of allocation churn); ``other``: the total less the rows, the autograd engine's calls
into Python among it. Host time: CPU time of the process on the CPU, wall time on a GPU.

Usage: ``python benchmarks/module_cost.py [--quick] [--case resnet|gpt2|chain] [--step-span] [--json PATH]``
(about a minute on the CPU machine with ``--quick``; on an H200 well under two).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _modules_before as before  # noqa: E402
from _common import ConstantReader, machine  # noqa: E402

import cudamem  # noqa: E402
from cudamem.allocator import backend as _backend  # noqa: E402
from cudamem.allocator import backend_base as _backend_base  # noqa: E402
from cudamem.modules import _backward as _backward  # noqa: E402
from cudamem.modules import profiler as after  # noqa: E402
from cudamem.render.text import render_table  # noqa: E402
from cudamem.spans import span  # noqa: E402
from cudamem.spans import state as _spans_state  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
IMPLS = {"before": before, "after": after}


# --------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)  # type: ignore[no-any-return]


class ResNet18(nn.Module):
    """torchvision's ResNet-18 module tree (the same 76 module calls a step), ``width``
    channels in its first layer."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i in range(4):
            cout = width << i
            layer = nn.Sequential(
                BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)
            )
            setattr(self, f"layer{i + 1}", layer)
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


Case = tuple[str, nn.Module, list[Any], Callable[[], None]]


def resnet_case() -> Case:
    torch.manual_seed(0)
    model = ResNet18().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (2,), device=DEVICE)

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return "ResNet-18 tree, batch 2 at 32²", model, [opt], step


def gpt2_case() -> Case | None:
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (2, 32), device=DEVICE)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return "GPT-2 2x64, batch 2x32", model, [opt], step


def in_step_span(case: Case) -> Case:
    """``case`` with each step inside a ``cudamem.track("step")`` span."""
    label, model, external, step = case
    track = cudamem.track

    def spanned() -> None:
        with track("step"):
            step()

    return f"{label}, each step in a track() span", model, external, spanned


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def chain_case() -> Case:
    """60 modules in a row, one multiply each: the least work a module call can carry, so
    that the profile's cost stands out of a noisy machine's timings (not in the default
    run: ``--case chain``)."""
    model = nn.Sequential(*[Scale() for _ in range(60)]).to(DEVICE)
    x = torch.ones(4, device=DEVICE, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    return "a chain of 60 one-multiply modules", model, [], step


def module_calls(step: Callable[[], None]) -> int:
    """Module calls in one step (every module, as the profile hooks the whole model)."""
    calls = [0]

    def count(module: nn.Module, args: Any) -> None:
        calls[0] += 1

    handle = nn.modules.module.register_module_forward_pre_hook(count)
    try:
        step()
    finally:
        handle.remove()
    return calls[0]


# --------------------------------------------------------------------------- timing


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


#: Host time: the process's CPU time on the CPU (robust on a shared machine; the backward
#: runs on the calling thread), wall time on a GPU (the backward runs on the engine's device
#: thread, and a launch-bound step's time is the host's).
clock = time.perf_counter if CUDA else time.process_time


def block(step: Callable[[], None], steps: int) -> float:
    """Seconds of host time per step over ``steps`` steps."""
    _sync()
    t0 = clock()
    for _ in range(steps):
        step()
    _sync()
    return (clock() - t0) / steps


class GcTime:
    """Seconds spent in cyclic garbage collection while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0

    @contextmanager
    def counting(self) -> Iterator[GcTime]:
        self.total = 0.0
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


def profiled(impl: Any, model: nn.Module, external: list[Any]) -> Any:
    return impl.ModuleProfiler(model, tuple(external))


def time_case(case: Case, rounds: int, steps: int) -> dict[str, Any]:
    """Per-step host seconds and gc seconds of bare and of each implementation, interleaved."""
    _, model, external, step = case
    gcs = GcTime()
    out: dict[str, dict[str, list[float]]] = {k: {"step": [], "gc": []} for k in ("bare", *IMPLS)}

    def run(name: str) -> None:
        gc.collect()
        with gcs.counting():
            if name == "bare":
                out[name]["step"].append(block(step, steps))
            else:
                prof = profiled(IMPLS[name], model, external).start()
                try:
                    out[name]["step"].append(block(step, steps))
                finally:
                    prof.stop()
        out[name]["gc"].append(gcs.total / steps)

    for name in out:  # warm each path
        run(name)
    for series in out.values():
        series["step"].clear()
        series["gc"].clear()
    for _ in range(rounds):
        for name in out:
            run(name)
    return out


# --------------------------------------------------------------------------- breakdown

#: The labelled parts of each implementation: (row, owner, attribute names).
#: Stands for the C++ reader's module (``_backend.get().gates``), found when the profile runs.
GATES = "the C++ reader"
#: Stands for a profiler's forward hooks in C (``_NativeLog.fwd``'s ``pre`` and ``post``, which
#: ``_choose_gates`` puts in ``_fwd_pre`` and ``_fwd_post``): what they hand on to ``_pre`` and
#: ``_post`` lands in those rows.
FWD = "the forward hooks in C"
PARTS: dict[str, list[tuple[str, Any, tuple[str, ...]]]] = {
    "before": [
        ("forward pre-hook", before.ModuleProfiler, ("_pre",)),
        ("forward post-hook", before.ModuleProfiler, ("_post",)),
        ("first grad input / output search", before, ("_grad_tensor",)),
        ("backward hooks registered", before.ModuleProfiler, ("_watch",)),
        ("backward hooks run", before._Backward, ("start", "end")),
        ("backward hooks run", before.ModuleProfiler, ("_record_backward",)),
        ("spans (open + close)", before, ("open_quiet", "close_quiet")),
        (
            "step detection, end of backward",
            before.ModuleProfiler,
            ("_end_step", "_backward_started", "_backward_ended"),
        ),
        ("state reads", before.ModuleProfiler, ("_read_state",)),
    ],
    "after": [
        ("forward pre-hook", after.ModuleProfiler, ("_pre",)),
        ("forward post-hook", after.ModuleProfiler, ("_post",)),
        ("forward hooks in C (pre + post)", FWD, ("_fwd_pre", "_fwd_post")),
        ("first grad input / output search", after, ("_grad_tensor",)),
        ("forward edges logged (C++ log)", GATES, ("mark",)),
        ("backward hooks registered", after.ModuleProfiler, ("_gate", "_native_fallback")),
        ("backward hooks registered", GATES, ("gate",)),
        ("backward hooks run", _backward._Gate, ("fire",)),
        ("backward hooks run", after.ModuleProfiler, ("_end_backward", "_native_backward")),
        ("C++ log replay", after.ModuleProfiler, ("_replay",)),
        ("spans (open + close)", after, ("open_quiet", "close_quiet")),
        (
            "step detection, end of backward",
            after.ModuleProfiler,
            ("_end_step", "_backward_started", "_backward_ended", "_native_ended"),
        ),
        ("state reads", after.ModuleProfiler, ("_read_state",)),
    ],
}
ROWS = [
    "torch's hook dispatch (no-op hooks)",
    "forward pre-hook",
    "forward post-hook",
    "forward hooks in C (pre + post)",
    "first grad input / output search",
    "backward hooks registered",
    "forward edges logged (C++ log)",
    "backward hooks run",
    "C++ log replay",
    "spans (open + close)",
    "step detection, end of backward",
    "state reads",
    "other (engine's calls into Python, ...)",
]


#: The breakdown's clock (wall time: the backward's hooks run on the engine's device thread
#: on a GPU; a preemption inside a reading is left out by the median over blocks).
timer_ns = time.perf_counter_ns


#: Not a row of µs: span opens per module call that the Python open served.
PY_OPENS = "span opens on the Python path"


class Timers:
    """Exclusive nanoseconds per label of wrapped functions (a callee's time is its own),
    and how many wrapped calls each label made (their timers' cost lands in it)."""

    def __init__(self) -> None:
        self.ns: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.kids: dict[str, int] = {}
        self._stack: list[list[Any]] = [[0, 0]]

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock_ns = timer_ns
        stack, ns, calls, kids = self._stack, self.ns, self.calls, self.kids
        for d in (ns, calls, kids):
            d.setdefault(label, 0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            mine = [0, 0]
            stack.append(mine)
            t0 = clock_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock_ns() - t0
                stack.pop()
                ns[label] += dt - mine[0]
                kids[label] += mine[1]
                calls[label] += 1
                outer = stack[-1]
                outer[0] += dt
                outer[1] += 1

        return timed

    def reset(self) -> None:
        for d in (self.ns, self.calls, self.kids):
            for label in d:
                d[label] = 0


def timer_cost() -> tuple[float, float]:
    """Nanoseconds a timer adds inside its own reading (an empty function's reading) and
    outside it (the rest of a wrapped call's cost, which its caller's reading takes)."""
    t = Timers()
    empty = lambda: None  # noqa: E731
    wrapped = t.wrap("x", empty)
    n = 20000
    best_wrapped = best_bare = float("inf")
    for _ in range(5):
        t0 = timer_ns()
        for _ in range(n):
            wrapped()
        best_wrapped = min(best_wrapped, (timer_ns() - t0) / n)
        t0 = timer_ns()
        for _ in range(n):
            empty()
        best_bare = min(best_bare, (timer_ns() - t0) / n)
    inner = t.ns["x"] / t.calls["x"]
    return inner, max(0.0, best_wrapped - best_bare - inner)


@contextmanager
def instrumented(impl: str, timers: Timers) -> Iterator[None]:
    saved = []
    for label, part, names in PARTS[impl]:
        if part is FWD:
            profiler = after.ModuleProfiler
            choose = profiler.__dict__["_choose_gates"]

            def chosen(self: Any, _real: Any = choose, _label: str = label) -> None:
                had = self._native
                _real(self)
                # The C hooks serve from here: time them, once (a profile chooses at every
                # step's start; wrapping again there nested a timer a step, and their own
                # cost grew into this row).
                if had is None and self._native is not None:
                    self._fwd_pre = timers.wrap(_label, self._fwd_pre)
                    self._fwd_post = timers.wrap(_label, self._fwd_post)

            saved.append((profiler, "_choose_gates", choose))
            profiler._choose_gates = chosen
            continue
        owner = getattr(_backend.get(), "gates", None) if part is GATES else part
        if owner is None:  # no C++ reader here: that row stays empty
            continue
        for name in names:
            real = owner.__dict__[name]
            saved.append((owner, name, real))
            setattr(owner, name, timers.wrap(label, real))
    try:
        yield
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def dispatch_cost() -> float:
    """µs torch's ``_call_impl`` adds to a module call for a pre-hook (``prepend``,
    ``with_kwargs``) and a forward hook (``always_call``) that do nothing."""
    m = nn.Identity()
    x = torch.ones(1)

    def best(n: int = 20000) -> float:
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                m(x)
            out.append((time.perf_counter() - t0) / n)
        return min(out)

    bare = best()
    hooks = [
        m.register_forward_pre_hook(lambda *a: None, prepend=True, with_kwargs=True),
        m.register_forward_hook(lambda *a: None, always_call=True),
    ]
    hooked = best()
    for h in hooks:
        h.remove()
    return (hooked - bare) * 1e6


def breakdown(case: Case, impl: str, steps: int, calls: int, blocks: int) -> dict[str, float]:
    """µs per module call of each labelled part (timers' own cost taken off), the median
    over ``blocks`` blocks of ``steps`` steps in one profile."""
    _, model, external, step = case
    inner, outer = timer_cost()
    timers = Timers()
    samples: dict[str, list[float]] = {}
    py_opens = [0]
    py_open = _spans_state.STATE.py_open

    def counted(*args: Any, **kwargs: Any) -> Any:
        py_opens[0] += 1
        return py_open(*args, **kwargs)

    # The compiled span core hands a span it cannot serve (several devices visible and not
    # all of them settled, a reader that is not the C++ one) to the Python open: count them.
    _spans_state.STATE.py_open = counted
    with instrumented(impl, timers):
        prof = profiled(IMPLS[impl], model, external).start()
        step()  # the first steps' state reads and first-use work, outside the figures
        step()
        try:
            for _ in range(blocks):
                timers.reset()
                _sync()
                for _ in range(steps):
                    step()
                _sync()
                for label, ns in timers.ns.items():
                    own = ns - inner * timers.calls[label] - outer * timers.kids[label]
                    samples.setdefault(label, []).append(max(0.0, own) / 1e3 / steps / calls)
                samples.setdefault(PY_OPENS, []).append(py_opens[0] / steps / calls)
                py_opens[0] = 0
        finally:
            prof.stop()
            _spans_state.STATE.py_open = py_open
    return {label: statistics.median(xs) for label, xs in samples.items()}


# --------------------------------------------------------------------------- report


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(case: Case, backend: str, rounds: int, steps: int) -> dict[str, Any]:
    label, _, _, step = case
    for _ in range(2):  # warm: optimizer state, the span core's switch
        step()
    calls = module_calls(step)
    times = time_case(case, rounds, steps)
    active = _backend.get()
    result: dict[str, Any] = {
        "case": label,
        "backend": backend,
        "devices_visible": active.device_count(),
        "settled_devices": active.settled_devices,
        "module_calls": calls,
        "bare_ms_per_step": _stats([t * 1e3 for t in times["bare"]["step"]]),
        "impls": {},
    }
    dispatch = dispatch_cost()
    for impl in IMPLS:
        per_call = [
            (p - b) / calls * 1e6
            for p, b in zip(times[impl]["step"], times["bare"]["step"], strict=True)
        ]
        pct = [
            (p / b - 1) * 100
            for p, b in zip(times[impl]["step"], times["bare"]["step"], strict=True)
        ]
        gc_us = [
            (p - b) / calls * 1e6
            for p, b in zip(times[impl]["gc"], times["bare"]["gc"], strict=True)
        ]
        parts = breakdown(case, impl, steps, calls, rounds)
        py_opens = parts.pop(PY_OPENS, 0.0)
        parts["torch's hook dispatch (no-op hooks)"] = dispatch
        total = statistics.median(per_call)
        parts["other (engine's calls into Python, ...)"] = total - sum(parts.values())
        best = (min(times[impl]["step"]) - min(times["bare"]["step"])) / calls * 1e6
        result["impls"][impl] = {
            "us_per_module_call": _stats(per_call),
            "us_per_module_call_best": best,
            "overhead_percent": _stats(pct),
            "gc_us_per_module_call": _stats(gc_us),
            "ms_per_step": _stats([t * 1e3 for t in times[impl]["step"]]),
            "breakdown_us_per_module_call": {row: parts.get(row, 0.0) for row in ROWS},
            "python_path_span_opens_per_module_call": py_opens,
        }
    return result


def table(result: dict[str, Any]) -> str:
    impls = result["impls"]
    rows = []
    for row in ROWS:
        rows.append([row, *(f"{impls[i]['breakdown_us_per_module_call'][row]:.1f}" for i in IMPLS)])
    rows.append(
        ["  of which cyclic gc (profiled - bare)"]
        + [f"{impls[i]['gc_us_per_module_call']['median']:.1f}" for i in IMPLS]
    )
    rows.append(
        ["total, µs per module call (median, range)"]
        + [
            "{median:.1f} ({min:.1f} to {max:.1f})".format(**impls[i]["us_per_module_call"])
            for i in IMPLS
        ]
    )
    rows.append(
        ["  best block less best bare block"]
        + [f"{impls[i]['us_per_module_call_best']:.1f}" for i in IMPLS]
    )
    rows.append(
        ["over bare per step"]
        + [
            "{median:+.1f} % ({min:+.1f} to {max:+.1f})".format(**impls[i]["overhead_percent"])
            for i in IMPLS
        ]
    )
    rows.append(
        ["span opens per module call on the Python path (count)"]
        + [f"{impls[i]['python_path_span_opens_per_module_call']:.1f}" for i in IMPLS]
    )
    bare = result["bare_ms_per_step"]
    title = (
        f"{result['case']} ({result['module_calls']} module calls, bare "
        f"{bare['median']:.2f} ms a step), counters: {result['backend']}; devices visible: "
        f"{result['devices_visible']}, settled: {result['settled_devices']}"
    )
    return render_table(["µs per module call", *IMPLS], rows, title=title)


@contextmanager
def backend_named(name: str) -> Iterator[None]:
    if name == "cuda":
        yield
        return
    if name == "constant":
        chosen: _backend_base.Backend = ConstantReader()
    elif name == "stub":  # the C++ log and C hooks on the CPU: the reader's source, stubbed
        from module_units import stub_reader

        chosen = stub_reader()
    else:
        from tests.fakes import FakeAllocator

        chosen = FakeAllocator(devices=1, contexts=(0,))
    with _backend.use(chosen):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, one CPU backend")
    parser.add_argument("--json", metavar="PATH", help="write the figures there too")
    parser.add_argument("--case", choices=["resnet", "gpt2", "chain"], action="append")
    parser.add_argument(
        "--backend",
        choices=["constant", "fake", "stub"],
        action="append",
        help="the CPU's counters (default: constant with --quick, else constant and fake); "
        "stub builds the C++ reader against a stub allocator, so the C++ log and the C "
        "hooks serve as on a GPU",
    )
    parser.add_argument(
        "--step-span",
        action="store_true",
        help="each step inside cudamem.track('step'), as `cudamem run` and the trainer "
        "callbacks run it (on a GPU the backward's spans then open on the engine's thread "
        "while the step's span is open on the main one)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one host thread: the CPU's figures are the hooks', not BLAS's
    if CUDA:  # the C++ counter reader serves, as in a user's run once it is built
        torch.empty(1, device="cuda")
        _backend.build_reader()
    span.span_core_status(wait=60)  # the compiled span core serves, as in a user's run
    rounds, steps = (5, 5) if args.quick else (9, 8)
    default = ["constant"] if args.quick else ["constant", "fake"]
    backends = ["cuda"] if CUDA else args.backend or default
    makers: dict[str, Callable[[], Case | None]] = {
        "resnet": resnet_case,
        "gpt2": gpt2_case,
        "chain": chain_case,
    }
    results = []
    for backend in backends:
        with backend_named(backend):
            for name in args.case or ["resnet", "gpt2"]:
                case = makers[name]()
                if case is None:
                    print(f"{name}: transformers is not installed, skipped")
                    continue
                if args.step_span:
                    case = in_step_span(case)
                result = measure(case, backend, rounds, steps)
                results.append(result)
                print(table(result))
                print()
    core = span.span_core_status()
    print(f"span core: {core.state} ({core.reason})")
    if CUDA:
        reader = _backend.reader_status()
        print(f"counter reader: {reader.reader} ({reader.state}: {reader.reason})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "machine": machine(),
                    "rounds": rounds,
                    "steps_per_block": steps,
                    "cases": results,
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
