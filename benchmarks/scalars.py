"""What logging a loss every step costs: no logging, ``.item()``, ``loss.detach()`` kept, and
``cudamem.ScalarLogger``, in one interleaved run; and what a logger fed 10 M values keeps.

Three measurements:

1. **Per append** (no training step): µs per call on a loss that is already computed, for
   ``.item()``, ``list.append(loss.detach())``, ``ScalarLogger.append(loss)`` and the floor
   of any buffered logger, one ``slot.copy_(loss.detach())`` (one copy kernel).
2. **Per training step**, on three kinds of step (forward, loss, and for the MLPs backward +
   SGD):
     * ``launch-bound``: a 1024-wide MLP at batch 256: the GPU idles between kernels, every
       method pays its CPU time. Goal: ScalarLogger <= 1 %.
     * ``balanced``: the same MLP at the batch where GPU time first reaches CPU launch time:
       a per-step ``.item()`` serialises the two.
     * ``gpu-bound``: fp32 matmuls, ~100 ms of GPU work per step.
   Blocks of ``--steps`` steps run in the order bare, method, bare, method, ... (the method
   order rotating per round); each method block is divided by the mean of the bare blocks
   on either side of it, and the table gives the median of those ratios with their range.
   Each method keeps one history for the whole run, as a training script would (the kept
   ``detach()`` tensors are dropped between blocks, outside the timing, and their device
   growth reported).
3. **Soak**: ``--soak N`` host floats into ``ScalarLogger()``, ``ScalarLogger(maxlen=...)``
   and a plain list: resident memory before and after, and what the logger says it keeps.

Usage: ``python benchmarks/scalars.py [--out benchmarks/results/scalars.json]`` (~3 minutes
on an H200). Without a GPU it runs a small CPU smoke version (``--steps``, ``--rounds``,
``--soak`` change the sizes); its figures mean little.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import cpu_and_gpu_ms, emit, matmul_step, median

import cudamem
from cudamem.base.data import to_data

CUDA = torch.cuda.is_available()
#: Cycles of the spin kernel that holds the GPU back while the steps are queued.
SPIN = int(2e9)
DEVICE = torch.device("cuda:0" if CUDA else "cpu")
METHODS = ("item", "detach", "ScalarLogger")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated(DEVICE) if CUDA else 0


@dataclass
class StepKind:
    name: str
    step: Callable[[], torch.Tensor]
    params: dict[str, Any]


def mlp_step(width: int, batch: int, depth: int = 3) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    model = torch.nn.Sequential(*layers).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(batch, width, device=DEVICE)
    target = torch.randn(batch, width, device=DEVICE)

    def step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def calibrate_balanced(width: int) -> tuple[int, float, float]:
    """The batch at which the MLP's GPU time first reaches its CPU launch time."""
    best = (256, 0.0, 0.0)
    for batch in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        cpu, gpu = cpu_and_gpu_ms(mlp_step(width, batch), n=20, spin_cycles=SPIN)
        best = (batch, cpu, gpu)
        if gpu >= cpu:
            break
    return best


def calibrate_gpu_bound(size: int, target_ms: float) -> int:
    _cpu, gpu = cpu_and_gpu_ms(matmul_step(size, 1, DEVICE), n=5, spin_cycles=SPIN)
    return max(1, round(target_ms / max(gpu, 1e-3)))


# --------------------------------------------------------------------------- methods


class Method:
    """One way of logging the loss, with the history it keeps across blocks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.logger = cudamem.ScalarLogger() if name == "ScalarLogger" else None
        self.kept: list[Any] = []
        self.slot = torch.zeros((), dtype=torch.float64, device=DEVICE)

    def __call__(self, loss: torch.Tensor) -> None:
        if self.name == "item":
            self.kept.append(loss.item())
        elif self.name == "detach":
            self.kept.append(loss.detach())
        elif self.name == "ScalarLogger":
            assert self.logger is not None
            self.logger.append(loss)
        elif self.name == "copy_":
            self.slot.copy_(loss.detach())

    def between_blocks(self) -> int:
        """Drop what the block kept (outside the timing); the device bytes it held."""
        before = allocated()
        self.kept.clear()
        gc.collect()
        return before - allocated()


def time_block(step: Callable[[], torch.Tensor], method: Method | None, steps: int) -> float:
    """ms per step of ``steps`` steps, logging with ``method`` (None: bare)."""
    sync()
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
        if method is not None:
            method(loss)
    if CUDA:
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    return (time.perf_counter() - t0) * 1e3 / steps


def per_step(kind: StepKind, steps: int, rounds: int) -> dict[str, Any]:
    methods = {name: Method(name) for name in METHODS}
    for m in (None, *methods.values()):  # warm up every path (buffers, pinned memory)
        time_block(kind.step, m, min(steps, 70))
    for m in methods.values():
        m.between_blocks()
    ratios: dict[str, list[float]] = {name: [] for name in METHODS}
    ms: dict[str, list[float]] = {name: [] for name in ("none", *METHODS)}
    growth: dict[str, int] = dict.fromkeys(METHODS, 0)
    for r in range(rounds):
        order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
        bare = time_block(kind.step, None, steps)
        ms["none"].append(bare)
        for name in order:
            t = time_block(kind.step, methods[name], steps)
            growth[name] = max(growth[name], methods[name].between_blocks())
            after = time_block(kind.step, None, steps)
            ms["none"].append(after)
            ms[name].append(t)
            ratios[name].append(t / ((bare + after) / 2))
            bare = after
    logger = methods["ScalarLogger"].logger
    assert logger is not None
    logger.flush()
    stats = logger.stats
    return {
        "ms": ms,
        "ratios": ratios,
        "growth": growth,
        "logger_stats": to_data(stats),
        "logger_transfers_per_value": stats.transfers / max(stats.logged, 1),
    }


def per_append(n: int, rounds: int) -> dict[str, list[float]]:
    """µs per call of each method on a loss that is already computed (GPU idle)."""
    x = torch.randn(1024, device=DEVICE, requires_grad=True)
    loss = (x * 2).sum()
    names = ("item", "detach", "ScalarLogger", "copy_")
    methods = {name: Method(name) for name in names}
    for m in methods.values():
        for _ in range(200):
            m(loss)
        m.between_blocks()
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            m = methods[name]
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                m(loss)
            sync()
            out[name].append((time.perf_counter_ns() - t0) / n / 1e3)
            m.between_blocks()
    return out


# --------------------------------------------------------------------------- soak


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def soak(n: int, maxlen: int) -> dict[str, Any]:
    """Feed ``n`` host floats to each container; resident memory it added."""
    results: dict[str, Any] = {}
    cases: dict[str, Callable[[], Any]] = {
        "ScalarLogger()": lambda: cudamem.ScalarLogger(),
        f"ScalarLogger(maxlen={maxlen})": lambda: cudamem.ScalarLogger(maxlen=maxlen),
        "list": list,
    }
    for name, make in cases.items():
        gc.collect()
        before = rss_bytes()
        history = make()
        t0 = time.perf_counter()
        for i in range(n):
            history.append(i * 0.5)
        seconds = time.perf_counter() - t0
        gc.collect()
        after = rss_bytes()
        entry: dict[str, Any] = {
            "values": n,
            "rss_growth_bytes": None if before is None or after is None else after - before,
            "us_per_append": seconds / n * 1e6,
        }
        if isinstance(history, cudamem.ScalarLogger):
            entry["stats"] = to_data(history.stats)
            entry["len"] = len(history)
        results[name] = entry
        del history
        gc.collect()
    return results


# --------------------------------------------------------------------------- main


def build_kinds(args: argparse.Namespace) -> list[StepKind]:
    if not CUDA:  # smoke sizes
        return [
            StepKind("launch-bound", mlp_step(32, 8), {"width": 32, "batch": 8}),
            StepKind("balanced", mlp_step(64, 64), {"width": 64, "batch": 64}),
            StepKind("gpu-bound", matmul_step(128, 4, DEVICE), {"size": 128, "count": 4}),
        ]
    torch.backends.cuda.matmul.allow_tf32 = False
    batch, cpu, gpu = calibrate_balanced(1024)
    count = calibrate_gpu_bound(4096, args.gpu_bound_ms)
    return [
        StepKind("launch-bound", mlp_step(1024, 256), {"width": 1024, "batch": 256}),
        StepKind(
            "balanced",
            mlp_step(1024, batch),
            {"width": 1024, "batch": batch, "calibrated_cpu_ms": cpu, "calibrated_gpu_ms": gpu},
        ),
        StepKind(
            "gpu-bound",
            matmul_step(4096, count, DEVICE),
            {"size": 4096, "count": count, "dtype": "float32"},
        ),
    ]


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/scalars.json")
    parser.add_argument("--steps", type=int, default=100 if CUDA else 10, help="steps a block")
    parser.add_argument("--gpu-bound-steps", type=int, default=5 if CUDA else 3)
    parser.add_argument("--gpu-bound-ms", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=15 if CUDA else 3)
    parser.add_argument("--appends", type=int, default=2000 if CUDA else 200)
    parser.add_argument("--soak", type=int, default=10_000_000 if CUDA else 200_000)
    parser.add_argument("--soak-maxlen", type=int, default=100_000)
    args = parser.parse_args()

    data: dict[str, Any] = {"device": str(DEVICE), "rounds": args.rounds}
    rows: list[list[str]] = []

    appends = per_append(args.appends, args.rounds)
    data["per_append_us"] = appends
    for name, samples in appends.items():
        rows.append(
            [
                "per append (GPU idle)",
                name,
                f"{median(samples):.2f} µs",
                "",
                f"{min(samples):.2f}-{max(samples):.2f} µs",
                "",
            ]
        )

    data["kinds"] = {}
    for kind in build_kinds(args):
        cpu, gpu = cpu_and_gpu_ms(kind.step, n=20, spin_cycles=SPIN)
        steps = args.gpu_bound_steps if kind.name == "gpu-bound" else args.steps
        result = per_step(kind, steps, args.rounds)
        bare = median(result["ms"]["none"])
        rows.append([kind.name, "none", f"{bare:.3f} ms", "", "", ""])
        for name in METHODS:
            r = result["ratios"][name]
            rows.append(
                [
                    kind.name,
                    name,
                    f"{median(result['ms'][name]):.3f} ms",
                    pct(median(r)),
                    f"{pct(min(r))} .. {pct(max(r))}",
                    cudamem_bytes(result["growth"][name]),
                ]
            )
        data["kinds"][kind.name] = {
            "params": kind.params,
            "steps_per_block": steps,
            "cpu_launch_ms": cpu,
            "gpu_ms": gpu,
            "median_ratio": {n: median(result["ratios"][n]) for n in METHODS},
            "ratio_quartiles": {
                n: statistics.quantiles(result["ratios"][n], n=4) if args.rounds > 1 else []
                for n in METHODS
            },
            **result,
        }
        print(f"{kind.name}: CPU launch {cpu:.3f} ms, GPU {gpu:.3f} ms per step", flush=True)

    data["soak"] = soak(args.soak, args.soak_maxlen)
    for name, entry in data["soak"].items():
        growth = entry["rss_growth_bytes"]
        kept = entry.get("stats", {})
        rows.append(
            [
                f"soak {entry['values']:,} floats",
                name,
                f"{entry['us_per_append']:.2f} µs",
                "",
                "",
                (cudamem_bytes(growth) + " RSS" if growth is not None else "n/a")
                + (
                    f"; keeps {kept['kept']:,} ({cudamem_bytes(kept['host_bytes'], signed=False)})"
                    if kept
                    else ""
                ),
            ]
        )
    emit(
        f"Logging a loss every step ({DEVICE}; {args.rounds} rounds, blocks interleaved with "
        "bare blocks, median ratio to the adjacent bare blocks)",
        ["what", "method", "time", "vs bare", "range", "device growth / memory"],
        rows,
        data,
        args.out,
    )


def cudamem_bytes(n: int, *, signed: bool = True) -> str:
    from cudamem.base.format import format_bytes

    return format_bytes(n, signed=signed)


if __name__ == "__main__":
    main()
