"""What logging a loss every step costs: no logging, ``.item()``, ``loss.detach()`` kept, and
``cudamem.ScalarLogger``, over three kinds of training step.

Step kinds (each a real step: forward, loss, and for the MLPs backward + SGD):
  * ``balanced``: an MLP whose GPU time is close to its CPU launch time (the batch is
    calibrated on the GPU). A per-step sync serialises the two, so ``.item()`` costs most.
  * ``gpu-bound``: fp32 matmuls, ~100 ms of GPU work per step (calibrated); a sync costs
    little because the CPU waits anyway.
  * ``launch-bound``: a 1024-wide MLP at batch 256 (~0.85 ms on an H200): the GPU idles
    between kernels, so waiting for it adds little.

Each method runs ``steps`` steps per repeat; methods are interleaved within a repeat and the
median per-step time over repeats is reported (CUDA events; ``perf_counter`` on CPU), with
the ratio to no logging and the device memory each method left allocated after the run.
Goal (issue 4): ScalarLogger within 1 % of no logging everywhere, faster than ``.item()``
where the sync hurts, flat device memory.

Usage: ``python benchmarks/scalars.py [--out benchmarks/results/scalars.json]``
(~1-2 minutes on an H200). Without a GPU it runs a small CPU smoke version (``--steps``,
``--repeats`` to change the size); its figures mean little.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import emit, median

import cudamem

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda:0" if CUDA else "cpu")
METHODS = ("none", "item", "detach", "ScalarLogger")


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
    steps: int


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


def matmul_step(size: int, count: int) -> Callable[[], torch.Tensor]:
    a = torch.randn(size, size, device=DEVICE)
    b = torch.randn(size, size, device=DEVICE) / size**0.5

    def step() -> torch.Tensor:
        y = a
        for _ in range(count):
            y = torch.tanh(y @ b)
        return y.mean()

    return step


def cpu_and_gpu_ms(step: Callable[[], torch.Tensor], n: int = 20) -> tuple[float, float]:
    """(CPU launch ms, GPU ms) of one step. The GPU time is measured behind a spin kernel so
    that the CPU has queued all ``n`` steps before the GPU starts them."""
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    cpu = (time.perf_counter() - t0) / n * 1e3
    sync()
    if not CUDA:
        return cpu, cpu
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))  # ~1 s of spinning: the CPU gets ahead of the GPU
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return cpu, start.elapsed_time(end) / n


def calibrate_balanced(width: int) -> tuple[int, float, float]:
    """The batch at which the MLP's GPU time first reaches its CPU launch time."""
    best = (256, 0.0, 0.0)
    for batch in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        cpu, gpu = cpu_and_gpu_ms(mlp_step(width, batch))
        best = (batch, cpu, gpu)
        if gpu >= cpu:
            break
    return best


def calibrate_gpu_bound(size: int, target_ms: float) -> int:
    _cpu, gpu = cpu_and_gpu_ms(matmul_step(size, 1), n=5)
    return max(1, round(target_ms / max(gpu, 1e-3)))


def run_method(method: str, step: Callable[[], torch.Tensor], steps: int) -> tuple[float, int]:
    """Per-step ms of ``steps`` steps with ``method``, and the bytes left allocated after."""
    history: Any = cudamem.ScalarLogger() if method == "ScalarLogger" else []
    gc.collect()
    sync()
    before = allocated()
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
        if method == "item":
            history.append(loss.item())
        elif method == "detach":
            history.append(loss.detach())
        elif method == "ScalarLogger":
            history.append(loss)
    if method == "ScalarLogger":
        history.flush()  # every value on the host, inside the timed region
    if CUDA:
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
    else:
        ms = (time.perf_counter() - t0) * 1e3 / steps
    del loss
    gc.collect()
    sync()
    growth = allocated() - before
    assert method == "none" or len(history) == steps
    return ms, growth


def build_kinds(args: argparse.Namespace) -> list[StepKind]:
    if not CUDA:  # smoke sizes
        return [
            StepKind("balanced", mlp_step(64, 64), {"width": 64, "batch": 64}, args.steps),
            StepKind("gpu-bound", matmul_step(128, 4), {"size": 128, "count": 4}, args.steps),
            StepKind("launch-bound", mlp_step(32, 8), {"width": 32, "batch": 8}, args.steps),
        ]
    torch.backends.cuda.matmul.allow_tf32 = False
    batch, cpu, gpu = calibrate_balanced(1024)
    count = calibrate_gpu_bound(4096, args.gpu_bound_ms)
    return [
        StepKind(
            "balanced",
            mlp_step(1024, batch),
            {"width": 1024, "batch": batch, "calibrated_cpu_ms": cpu, "calibrated_gpu_ms": gpu},
            args.steps,
        ),
        StepKind(
            "gpu-bound",
            matmul_step(4096, count),
            {"size": 4096, "count": count, "dtype": "float32"},
            args.gpu_bound_steps,
        ),
        StepKind("launch-bound", mlp_step(1024, 256), {"width": 1024, "batch": 256}, args.steps),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/scalars.json")
    parser.add_argument("--steps", type=int, default=300 if CUDA else 20)
    parser.add_argument("--gpu-bound-steps", type=int, default=30 if CUDA else 5)
    parser.add_argument("--gpu-bound-ms", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=5 if CUDA else 2)
    args = parser.parse_args()

    kinds = build_kinds(args)
    rows, data = [], {"device": str(DEVICE), "repeats": args.repeats, "kinds": {}}
    for kind in kinds:
        cpu, gpu = cpu_and_gpu_ms(kind.step)
        for method in METHODS:  # warm up every path (buffers, pinned memory, allocator)
            run_method(method, kind.step, min(kind.steps, 70))
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        growth: dict[str, int] = {}
        for r in range(args.repeats):
            # rotate the order so no method always runs first after the others
            order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
            for method in order:
                ms, grew = run_method(method, kind.step, kind.steps)
                samples[method].append(ms)
                growth[method] = max(growth.get(method, 0), grew)
        base = median(samples["none"])
        methods = {}
        for method in METHODS:
            med = median(samples[method])
            methods[method] = {
                "median_step_ms": med,
                "ratio_vs_none": med / base,
                "samples_ms": samples[method],
                "allocated_growth_bytes": growth[method],
            }
            rows.append(
                [
                    kind.name,
                    method,
                    f"{med:.3f}",
                    f"{(med / base - 1) * 100:+.1f} %",
                    f"{min(samples[method]):.3f}-{max(samples[method]):.3f}",
                    cudamem_bytes(growth[method]),
                ]
            )
        data["kinds"][kind.name] = {
            "params": kind.params,
            "steps": kind.steps,
            "cpu_launch_ms": cpu,
            "gpu_ms": gpu,
            "methods": methods,
        }
        print(f"{kind.name}: CPU launch {cpu:.3f} ms, GPU {gpu:.3f} ms per step", flush=True)
    emit(
        f"Logging a loss every step ({DEVICE}, median of {args.repeats} repeats)",
        ["step", "method", "ms/step", "vs none", "range ms", "device growth"],
        rows,
        data,
        args.out,
    )


def cudamem_bytes(n: int) -> str:
    from cudamem.render.text import format_bytes

    return format_bytes(n, signed=True)


if __name__ == "__main__":
    main()
