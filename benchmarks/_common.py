"""Shared helpers of the benchmark scripts: timing statistics, tables, JSON output, the
steps and the reader the span benchmarks time."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cudamem.allocator import backend_base as _backend_base
from cudamem.render.text import render_table

CUDA = torch.cuda.is_available()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> tuple[float, float]:
    """(min, max) of the samples."""
    return min(xs), max(xs)


def interleaved(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    once: set[str] | None = None,
    *,
    cpu: dict[str, list[float]] | None = None,
    tag: str = "",
) -> dict[str, list[float]]:
    """Wall-clock seconds of each function, ``repeat`` times, alternating between them, after
    a collection each (those in ``once`` in the first round only); ``cpu``, when given,
    receives the CPU seconds under ``tag + name``."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeat):
        for name, fn in fns.items():
            if once and name in once and r > 0:
                continue
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(tag + name, []).append(time.process_time() - c0)
    return out


def fmt_seconds(xs: Sequence[float]) -> str:
    """``median (min–max)`` in s from one second up, else in ms."""
    lo, hi = spread(xs)
    m = median(xs)
    if m >= 1:
        return f"{m:.2f} s ({lo:.2f}–{hi:.2f})"
    return f"{m * 1e3:.0f} ms ({lo * 1e3:.0f}–{hi * 1e3:.0f})"


def emit(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    data: dict[str, Any],
    out: str,
) -> None:
    """Print the table and write the JSON next to it."""
    print(render_table(headers, rows, title=title))
    write_json(data, out)
    print(f"\nwrote {out}")


def write_json(data: dict[str, Any], out: str) -> None:
    """``data`` with the machine it was measured on, as JSON at ``out`` (a long run also
    writes what it has after each part, so that a run cut short keeps it)."""
    data = {"machine": machine(), **data}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(data, fh, indent=2)


class ConstantReader(_backend_base.Backend):
    """One device whose counters never change: what is left is cudamem's own bookkeeping.

    As the real backend once CUDA runs: its one device is settled (spans read it without
    asking), and its reads are C-level calls (a dict lookup standing in for the C++ reader,
    minus the allocator's own work)."""

    settled_devices = (0,)
    fast_counters = fast_reset = staticmethod({0: (1 << 20, 2 << 20, 1 << 20)}.__getitem__)

    def device_count(self) -> int:
        return 1

    def initialized_devices(self) -> tuple[int, ...]:
        return (0,)

    def has_context(self, device: int) -> bool:
        return True

    def counters(self, device: int) -> tuple[int, int, int]:
        return (1 << 20, 2 << 20, 1 << 20)

    def counters_reset_peak(self, device: int) -> tuple[int, int, int]:
        return (1 << 20, 2 << 20, 1 << 20)

    def synchronize(self, device: int) -> None:
        pass

    def reset_peak(self, device: int) -> None:
        pass


def matmul_step(size: int, count: int, device: Any) -> Callable[[], torch.Tensor]:
    """A GPU-bound step: ``count`` square matmuls of ``size``."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device) / size**0.5

    def step() -> torch.Tensor:
        y = a
        for _ in range(count):
            y = torch.tanh(y @ b)
        return y.mean()

    return step


def cpu_and_gpu_ms(
    step: Callable[[], torch.Tensor], n: int, *, spin_cycles: int
) -> tuple[float, float]:
    """(CPU launch ms, GPU ms) of one step. The GPU time is measured behind a spin kernel
    of ``spin_cycles`` so that the CPU has queued all ``n`` steps before the GPU starts
    them; without CUDA both are the CPU time."""
    for _ in range(3):
        step()
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    cpu = (time.perf_counter() - t0) / n * 1e3
    if not CUDA:
        return cpu, cpu
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin_cycles)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return cpu, start.elapsed_time(end) / n
