"""What the per-module profile costs per training step, against PyTorch's ``MemTracker`` and
against no instrumentation, in one interleaved run; and whether the two agree.

Steps: a GPT-2 built from a transformers config (no download; GPT-2 small's shape by default:
12 layers, 768 wide, batch 8 x 512 tokens, AdamW) and a torchvision ResNet-18 (batch 32 at
224², SGD with momentum). Each round times one block of ``--steps`` steps per case, back to
back, in turn: ``bare``, ``cudamem`` (``track_modules`` around the block; installing and
removing its hooks is timed apart, once per profile), ``memtracker`` (``MemTracker`` around
each step, its stats reset in between: it refuses a second iteration otherwise). Per-step
time is the block's wall time (synchronized at both ends) over its steps; the overhead is the
median over rounds of each round's ratio to its own bare block.

Agreement: each module's bytes kept by its forward, cudamem's against MemTracker's (its
total at the forward's exit minus at entry), for the same step.

Goals (issue 22): <= 3 % per step on the GPT-2 step; at least 10x cheaper than MemTracker.

Usage: ``python benchmarks/module_profile.py [--quick] [--out benchmarks/results/module-profile.json]``
(``--quick``: a 2-layer, 128-wide GPT-2 and fewer rounds, about a minute on an H200; the
full run's MemTracker steps on GPT-2 small dominate its time: a few minutes).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import CUDA, emit, fmt_seconds

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudamem
from tests.memtracker import memtracker_kept

DEVICE = "cuda" if CUDA else "cpu"


def gpt2_case(quick: bool) -> tuple[torch.nn.Module, list[Any], Callable[[], None], str]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if quick:
        shape = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 8192}
        batch, seq = 8, 128
    else:
        shape = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
        batch, seq = 8, 512
    if not CUDA:
        shape.update(n_layer=2, n_embd=64, n_head=2, vocab_size=512)
        batch, seq = 2, 32
    config = transformers.GPT2Config(n_positions=max(seq, 128), **shape)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=DEVICE)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    label = f"GPT-2 {shape['n_layer']}x{shape['n_embd']}, batch {batch}x{seq}"
    return model, [opt], step, label


def resnet_case() -> tuple[torch.nn.Module, list[Any], Callable[[], None], str]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch, side = (32, 224) if CUDA else (2, 64)
    x = torch.randn(batch, 3, side, side, device=DEVICE)
    y = torch.randint(0, 1000, (batch,), device=DEVICE)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return model, [opt], step, f"ResNet-18, batch {batch} at {side}²"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_cases(
    model: torch.nn.Module, external: list[Any], step: Callable[[], None], steps: int, rounds: int
) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per step of each case, one block per case per round, interleaved; and the
    seconds cudamem's profile took to install and remove its hooks (outside its block's
    time: a profile is meant to run over many steps)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *external)
    setup: list[float] = []

    def bare() -> float:
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        return time.perf_counter() - t0

    def profiled() -> float:
        s0 = time.perf_counter()
        prof = cudamem.track_modules(model, optimizer=external).start()
        s1 = time.perf_counter()
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        elapsed = time.perf_counter() - t0
        s2 = time.perf_counter()
        prof.stop()
        setup.append(s1 - s0 + time.perf_counter() - s2)
        return elapsed

    def tracked() -> float:  # MemTracker is entered per iteration: it refuses a second one
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tracker.reset_mod_stats()
            with tracker:
                step()
        _sync()
        return time.perf_counter() - t0

    cases = {"bare": bare, "cudamem": profiled, "memtracker": tracked}
    for fn in cases.values():  # warm every path
        fn()
    setup.clear()
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            gc.collect()
            out[name].append(fn() / steps)
    return out, setup


def overhead(times: dict[str, list[float]], case: str) -> tuple[float, float, float]:
    """(median, min, max) percent over the same round's bare block."""
    ratios = [(c / b - 1) * 100 for c, b in zip(times[case], times["bare"], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def agreement(
    model: torch.nn.Module, external: list[Any], step: Callable[[], None]
) -> dict[str, Any]:
    """cudamem's and MemTracker's kept bytes per module for one step each."""
    gc.collect()
    with cudamem.track_modules(model, optimizer=external) as prof:
        step()
    if prof.profile.unmeasured:
        return {"modules": [], "worst_relative_difference_at_1MiB": None, "compared": 0}
    gc.collect()
    theirs = memtracker_kept(model, external, step, DEVICE)
    rows = []
    for row in prof.profile.modules:
        ref = theirs.get(row.name)
        if ref is None:
            continue
        rows.append({"module": row.name, "cudamem": int(row.kept.max), "memtracker": ref})
    big = [r for r in rows if max(abs(r["cudamem"]), abs(r["memtracker"])) >= 1 << 20]
    worst = max(
        (abs(r["cudamem"] - r["memtracker"]) / max(abs(r["memtracker"]), 1) for r in big),
        default=0.0,
    )
    return {"modules": rows, "worst_relative_difference_at_1MiB": worst, "compared": len(big)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/module-profile.json")
    args = parser.parse_args()
    rounds = 5 if args.quick else 9
    steps = 5 if args.quick else 6
    cases = [gpt2_case(args.quick)]
    try:
        cases.append(resnet_case())
    except ImportError:
        print("torchvision is not installed: the ResNet-18 rows are skipped")
    rows, data = [], {"rounds": rounds, "steps_per_block": steps, "device": DEVICE, "cases": {}}
    for model, external, step, label in cases:
        times, setup = time_cases(model, external, step, steps, rounds)
        ours, theirs = overhead(times, "cudamem"), overhead(times, "memtracker")
        ratio = theirs[0] / ours[0] if ours[0] > 0 else None
        for name in ("bare", "cudamem", "memtracker"):
            pct = (
                ""
                if name == "bare"
                else "{:+.1f} % ({:+.1f} to {:+.1f})".format(*overhead(times, name))
            )
            rows.append([label if name == "bare" else "", name, fmt_seconds(times[name]), pct])
        shown = "n/a (cudamem's median is not above bare)" if ratio is None else f"{ratio:.1f}x"
        rows.append(["", "MemTracker / cudamem overhead", "", shown])
        rows.append(
            ["", "cudamem hooks installed + removed", fmt_seconds(setup), "once per profile"]
        )
        agree = agreement(model, external, step)
        worst = agree["worst_relative_difference_at_1MiB"]
        rows.append(
            [
                "",
                "kept per module vs MemTracker",
                f"{agree['compared']} modules >= 1 MiB",
                "not measured (no CUDA)" if worst is None else f"worst {worst * 100:.2f} %",
            ]
        )
        data["cases"][label] = {
            "seconds_per_step": times,
            "overhead_percent": {"cudamem": ours, "memtracker": theirs},
            "memtracker_over_cudamem": ratio,
            "cudamem_install_and_remove_seconds": setup,
            "agreement": agree,
        }
        del model, external, step
    emit(
        "per-module profile: time per step (median, range over rounds), interleaved",
        ["step", "case", "time per step", "over bare"],
        rows,
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
