"""The per-module profile's unit costs, each timed alone: the C++ log's calls, an autograd
node's hook, and a module call's hooks on a chain of one-multiply modules.

Three parts, in µs (median over rounds, with the fastest):

- **calls**: one call of each of the C++ reader's entry points the profile makes per module
  call (``mark`` with and without its slot, the counter read, the read with a peak reset)
  and of the two torch checks its hooks make (``_current_graph_task_id``,
  ``torch.compiler.is_compiling``), 20,000 calls a reading, against an empty loop; with
  ``torch.cuda.memory_allocated`` beside them, the plain-PyTorch read.
- **backward, per autograd node**: the backward of a chain of 400 multiplies, with nothing
  on its nodes, with the profile's C++ gate on every node (a counter read and a peak reset
  under one lock, one event logged) and with a no-op Python pre-hook on every node (what a
  Python gate would cost: the GIL and a tuple of the gradients), in rotating order.
- **a module call**: a forward and backward through 61 one-multiply modules (20 blocks of
  two), timed as blocks of steps in rotating order: bare, a second bare copy (the host's
  noise), no-op forward hooks (torch's hook dispatch alone), the profile paused (its hooks
  installed, returning at once) and the profile measuring, one profile over the whole run.

On a GPU the real C++ reader serves; on a CPU the same source built against a stub
allocator (``CUDAMEM_STUB_ALLOCATOR``: counters set by hand), so the CPU figures are the
code's own, without the allocator's.

Usage: ``python benchmarks/module_units.py [--rounds N] [--out PATH]`` (default
``benchmarks/results/module-units.json``; about a minute).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import CUDA, ConstantReader, emit
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from module_profile import DEVICE, _sync, ready_paths

import cudamem
from cudamem.allocator import backend as _backend

CALLS_PER_READING = 20_000
CHAIN_NODES = 400


def stub_reader() -> Any:
    """The C++ reader's source built against the stub allocator, as a backend (CPU)."""
    import torch.utils.cpp_extension as cpp_extension

    from cudamem.native import reader_build

    text = reader_build.bundle()
    build = os.path.join(tempfile.gettempdir(), "cudamem-module-units-stub")
    os.makedirs(build, exist_ok=True)
    stub = cpp_extension.load_inline(  # type: ignore[no-untyped-call]
        name="cudamem_units_stub",
        cpp_sources=[text],
        extra_cflags=["-O2", "-DCUDAMEM_STUB_ALLOCATOR"],
        build_directory=build,
        no_implicit_headers=True,
        is_python_module=True,
    )

    class StubReader(ConstantReader):
        fast_counters = staticmethod(stub.counters)
        fast_reset = staticmethod(stub.counters_reset_peak)
        gates = stub

    return StubReader()


def per_call(loop: Callable[[int], None], rounds: int) -> list[float]:
    """µs per iteration of ``loop(n)``, one reading per round."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        loop(CALLS_PER_READING)
        out.append((time.perf_counter_ns() - t0) / CALLS_PER_READING / 1e3)
    return out


def calls(api: Any, device: int, rounds: int) -> dict[str, list[float]]:
    owner = api.log_start()
    mark, counters, reset = api.mark, api.counters, api.counters_reset_peak
    task, compiling = torch._C._current_graph_task_id, torch.compiler.is_compiling

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def mark_entry(n: int) -> None:
        for i in range(n):
            mark(owner, device, i * 4, 0, -1)

    def mark_exit(n: int) -> None:
        for i in range(n):
            mark(owner, device, i * 4 + 1)

    def read(n: int) -> None:
        for _ in range(n):
            counters(device)

    def read_reset(n: int) -> None:
        for _ in range(n):
            reset(device)

    def task_id(n: int) -> None:
        for _ in range(n):
            task()

    def is_compiling(n: int) -> None:
        for _ in range(n):
            compiling()

    loops: dict[str, Callable[[int], None]] = {
        "an empty loop's iteration": empty,
        "mark: a forward's entry (slot, parent)": mark_entry,
        "mark: a forward's exit": mark_exit,
        "counters (C++ reader)": read,
        "counters_reset_peak (C++ reader)": read_reset,
        "torch._C._current_graph_task_id": task_id,
        "torch.compiler.is_compiling": is_compiling,
    }
    if CUDA:
        allocated = torch.cuda.memory_allocated

        def plain(n: int) -> None:
            for _ in range(n):
                allocated(device)

        loops["torch.cuda.memory_allocated (plain PyTorch)"] = plain
    try:
        out = {name: per_call(loop, rounds) for name, loop in loops.items()}
    finally:
        api.log_replay(owner, 0, False, True, False)
        api.log_stop(owner)
    return out


def backward_per_node(api: Any, device: int, rounds: int) -> dict[str, list[float]]:
    x = torch.ones(16, device=DEVICE, requires_grad=True)

    def once(kind: str) -> float:
        owner = api.log_start() if kind == "cpp" else 0
        try:
            y, fns = x, []
            for _ in range(CHAIN_NODES):
                y = y * 1.0001
                fns.append(y.grad_fn)
            if kind == "cpp":
                for i, fn in enumerate(fns):
                    api.gate(fn, i * 4 + 2, owner, 0, device)
            elif kind == "python":
                for fn in fns:
                    fn.register_prehook(lambda grads: None)
            loss = y.sum()
            del fns
            _sync()
            t0 = time.perf_counter_ns()
            loss.backward()
            _sync()
            return (time.perf_counter_ns() - t0) / CHAIN_NODES / 1e3
        finally:
            if owner:
                api.log_replay(owner, 0, False, True, False)
                api.log_stop(owner)

    kinds = ["none", "cpp", "python"]
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds + 1):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            t = once(kind)
            if r:  # the first round warms up
                out[kind].append(t)
    return out


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Scale()
        self.b = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


MODULE_CALLS = 61  # the Sequential, 20 pairs, 40 multiplies


def module_call(rounds: int, steps: int) -> tuple[dict[str, list[float]], bool]:
    x = torch.ones(16, device=DEVICE, requires_grad=True)
    cases = ["bare", "control", "no-op hooks", "paused", "cudamem"]
    models = {c: nn.Sequential(*(Pair() for _ in range(20))).to(DEVICE) for c in cases}
    handles = []
    for m in models["no-op hooks"].modules():
        handles.append(
            m.register_forward_pre_hook(lambda m, a, k: None, prepend=True, with_kwargs=True)
        )
        handles.append(m.register_forward_hook(lambda m, a, o: None, always_call=True))
    paused = cudamem.track_modules(models["paused"]).start()
    paused.pause()
    measuring = cudamem.track_modules(models["cudamem"]).start()
    try:

        def stepper(model: nn.Module) -> Callable[[], None]:
            def step() -> None:
                model(x).sum().backward()

            return step

        steppers = {c: stepper(m) for c, m in models.items()}
        for step in steppers.values():
            for _ in range(3):
                step()
        native = measuring._native is not None
        out: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(rounds + 1):
            for case in cases[r % 5 :] + cases[: r % 5]:
                gc.collect()
                steppers[case]()
                _sync()
                t0 = time.perf_counter_ns()
                for _ in range(steps):
                    steppers[case]()
                _sync()
                if r:
                    out[case].append((time.perf_counter_ns() - t0) / steps / 1e3)
    finally:
        measuring.stop()
        paused.stop()
        for h in handles:
            h.remove()
    return out, native


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f} to {max(xs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each part (15)")
    parser.add_argument("--steps", type=int, default=40, help="steps per chain block (40)")
    parser.add_argument("--out", default="benchmarks/results/module-units.json")
    args = parser.parse_args()
    for flag in ("rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if CUDA:
        paths = ready_paths()
        backend = _backend.get()
        api = getattr(backend, "gates", None)
        if api is None:
            sys.exit(f"the C++ reader does not serve here: {paths}")
        device = torch.cuda.current_device()
        scope = _backend.use(backend)
    else:
        paths = {"counter reader": "the C++ reader's source on a stub allocator (CPU)"}
        stub = stub_reader()
        api, device, scope = stub.gates, 0, _backend.use(stub)
    with scope:
        unit = calls(api, device, args.rounds)
        nodes = backward_per_node(api, device, args.rounds)
        chain, native = module_call(args.rounds, args.steps)
    rows: list[list[str]] = []
    empty = statistics.median(unit["an empty loop's iteration"])
    for name, xs in unit.items():
        rows.append(["calls", name, _fmt(xs), ""])
    rows[0][3] = "(the loop's own cost, in every row)"
    base = nodes["none"]
    for kind, label in (
        ("none", "nothing on the nodes"),
        ("cpp", "C++ gate"),
        ("python", "Python hook"),
    ):
        extra = (
            "" if kind == "none" else _fmt([a - b for a, b in zip(nodes[kind], base, strict=True)])
        )
        rows.append(["backward, per node", label, _fmt(nodes[kind]), extra])
    bare = chain["bare"]
    for case, xs in chain.items():
        per = [(a - b) / MODULE_CALLS for a, b in zip(xs, bare, strict=True)]
        extra = (
            ""
            if case == "bare"
            else f"{_fmt(per)}; fastest {(min(xs) - min(bare)) / MODULE_CALLS:.2f}"
        )
        rows.append([f"a step of {MODULE_CALLS} module calls", case, _fmt(xs), extra])
    emit(
        f"the module profile's unit costs on {DEVICE}, µs (median, range over "
        f"{args.rounds} rounds); C++ log measuring: {native}",
        ["part", "what", "µs (median, range)", "over the baseline, µs per call or node"],
        rows,
        {
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "device": DEVICE,
            "paths": paths,
            "empty_loop_us": empty,
            "calls_us": unit,
            "backward_us_per_node": nodes,
            "chain_us_per_step": chain,
            "chain_module_calls": MODULE_CALLS,
            "c++_log_measuring": native,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
