"""Holder search and census against objgraph, on large heaps, in one interleaved run.

Questions, each timed ``--repeat`` times with cudamem and the peer alternating:

On a heap of ``--objects`` gc-tracked objects (default 3 M):

1. one tensor six containers deep: ``who_holds`` (every path) against objgraph's
   ``find_backref_chain`` (one chain);
2. holders of ``--targets`` tensors (default 10,000) in one search (``find_holders``, what
   ``live_tensors(holders=True)`` and leak reports use) against objgraph one chain per tensor
   (timed on ``--sample`` tensors and extrapolated: thousands of chains take hours);
3. ``live_tensors(holders=True)`` over the same tensors (census + search);
4. the timeout: ``who_holds(..., timeout=T)`` on a search that needs longer; how long the
   call took against ``T`` (the goal: within 20 %).

On a heap of ``--small-objects`` (default 450 k, the size of a process with transformers
imported), with a small model and AdamW:

5. a training step plain against the same step under ``track(leaks=True)``;
6. ``live_tensors(holders=True)``;
7. the census scan behind ``explain()`` (every live storage, no holders) against objgraph's
   ``by_type('Tensor')``; on a GPU also ``explain()`` itself.

Runs on CPU (the search is about Python objects); on a GPU machine the model runs there.

    PYTHONPATH=. python3 benchmarks/holders.py [--quick] [--repeat 5]
        [--out benchmarks/results/holders.json]
    PYTHONPATH=. python3 benchmarks/holders.py --real [--quick]   (a real training heap:
        transformers, lightning, GPT-2, against objgraph; see holders_real.py)

The figures in ``docs/guide/who-holds.md`` come from ``OMP_NUM_THREADS=1`` runs (CPU
seconds count torch's worker threads too; the JSON says how many there were).

``--quick`` (fewer repeats and samples, a 1.5 M-object first heap) finishes in about a
minute on a fast machine.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import objgraph
import torch
from _common import emit, fmt_seconds, median  # type: ignore[import-not-found]
from _common import interleaved as _interleaved

import cudamem
from cudamem.holders import census
from cudamem.holders._search_base import SearchLimits
from cudamem.holders.finder import find_holders

# A stand-in for the user's __main__: what is held hangs off its globals.
app = types.ModuleType("bench_app")
sys.modules["bench_app"] = app


def build_heap(n_objects: int) -> list[Any]:
    """About ``n_objects`` gc-tracked objects of the usual kinds (dicts, lists, tuples)."""
    heap: list[Any] = []
    for i in range(max(0, n_objects) // 4):
        heap.append({"id": i, "tags": [i, str(i)], "pair": (i, [i])})
    return heap


def is_app(obj: Any) -> bool:
    return obj is app.__dict__


def tracked() -> int:
    return len(gc.get_objects())


#: CPU seconds of every timed call, by the same keys as the wall-clock figures.
CPU: dict[str, list[float]] = {}


def interleaved(
    fns: dict[str, Callable[[], Any]], repeat: int, once: set[str] | None = None, tag: str = ""
) -> dict[str, list[float]]:
    """``_common.interleaved``, with CPU seconds going to ``CPU[tag + name]``."""
    return _interleaved(fns, repeat, once, cpu=CPU, tag=tag)


fmt = fmt_seconds


def big_heap(args: argparse.Namespace, rows: list[list[str]], data: dict[str, Any]) -> None:
    app.heap = build_heap(args.objects - tracked())
    gc.collect()
    size = tracked()
    data["big_heap_objects"] = size
    heap_text = f"{size / 1e6:.1f} M objects"

    # 1. one tensor six containers deep
    t = torch.ones(16)
    app.trainer = {"runs": [None, {"val": ({"outputs": [[t]]},)}]}
    expected = "bench_app.trainer['runs'][1]['val'][0]['outputs'][0][0]"
    assert expected in cudamem.who_holds(t).paths
    chain = objgraph.find_backref_chain(t, is_app, max_depth=12)
    assert chain[0] is app.__dict__, "objgraph did not find the chain"
    del chain
    one = interleaved(
        {
            "cudamem": lambda: cudamem.who_holds(t),
            "objgraph": lambda: objgraph.find_backref_chain(t, is_app, max_depth=12),
        },
        args.repeat,
        tag="one_tensor.",
    )
    ratio = median(one["objgraph"]) / median(one["cudamem"])
    rows.append(
        [
            f"who_holds: 1 tensor 6 deep, {heap_text}",
            fmt(one["cudamem"]),
            fmt(one["objgraph"]) + " (1 chain)",
            f"{ratio:.1f}×",
        ]
    )
    data["one_tensor"] = {**one, "ratio": ratio}
    del app.trainer

    # 2. many targets in one search
    n = args.targets
    app.pool = {f"layer{i}": [torch.full((4,), float(i))] for i in range(n // 2)}
    app.history = [torch.full((2,), float(i)) for i in range(n - n // 2)]

    def targets() -> list[Any]:
        # made afresh for every call: a list of the benchmark's own would be a holder too
        return [v[0] for v in app.pool.values()] + list(app.history)

    def batch() -> list[Any]:
        return find_holders(targets(), SearchLimits(), None)

    found = batch()
    named = sum(1 for h in found if h.holders)
    assert named == n, (named, n)
    assert [h.path for h in found[0]] == ["bench_app.pool['layer0'][0]"], found[0].paths
    del found
    sample = targets()[:: max(1, n // args.sample)][: args.sample]

    def chains() -> None:
        for x in sample:
            objgraph.find_backref_chain(x, is_app, max_depth=12)

    many = interleaved(
        {"cudamem": batch, "objgraph": chains}, args.repeat, {"objgraph"}, tag="many_targets."
    )
    og_total = median(many["objgraph"]) / len(sample) * n
    rows.append(
        [
            f"find_holders: {n:,} tensors, {heap_text}",
            fmt(many["cudamem"]),
            f"{og_total:.0f} s (extrapolated from {len(sample)} chains)",
            f"{og_total / median(many['cudamem']):.0f}×",
        ]
    )
    data["many_targets"] = {
        "targets": n,
        "cudamem_s": many["cudamem"],
        "objgraph_sample_s": many["objgraph"],
        "objgraph_sample": len(sample),
        "objgraph_extrapolated_s": og_total,
        "goal_s": 3.0,
    }

    # 3. live_tensors(holders=True) over the same tensors
    census_many = interleaved(
        {"cudamem": lambda: cudamem.live_tensors("cpu", holders=True)},
        args.repeat,
        tag="live_tensors_big.",
    )
    rows.append(
        [
            f"live_tensors(holders=True): {n:,} tensors, {heap_text}",
            fmt(census_many["cudamem"]),
            "-",
            "-",
        ]
    )
    data["live_tensors_big"] = census_many["cudamem"]

    # 4. the timeout holds: a 10,000-target search given less time than it needs
    limit = args.timeout
    taken: list[float] = []
    stopped: list[str | None] = []
    for _ in range(args.repeat):
        objs = targets()
        t0 = time.perf_counter()
        res = find_holders(objs, SearchLimits(timeout=limit), None)
        taken.append(time.perf_counter() - t0)
        stopped.append(res[0].stopped)
        del res
    rows.append(
        [
            f"timeout={limit:g} s on that search",
            fmt(taken) + f", {max(taken) / limit:.2f}× the timeout at most",
            "-",
            "-",
        ]
    )
    data["timeout"] = {"timeout_s": limit, "taken_s": taken, "stopped": stopped}
    sample.clear()
    del app.pool, app.history, app.heap
    gc.collect()


class Model(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def small_heap(args: argparse.Namespace, rows: list[list[str]], data: dict[str, Any]) -> None:
    app.heap = build_heap(args.small_objects - tracked())
    gc.collect()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Model(256).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256, device=device)
    app.model, app.opt = model, opt

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cudamem.log_scalar(loss)

    def tracked_step() -> None:
        with cudamem.track("bench-step", leaks=True):
            step()

    for _ in range(3):
        step()
    size = tracked()
    data["small_heap_objects"] = size
    heap_text = f"{size / 1e3:.0f} k objects"
    steps = interleaved({"plain": step, "tracked": tracked_step}, args.repeat * 2, tag="step.")
    rows.append(
        [
            f"training step, track(leaks=True), {heap_text}",
            fmt(steps["tracked"]),
            fmt(steps["plain"]) + " (plain step)",
            f"+{median(steps['tracked']) - median(steps['plain']):.2f} s",
        ]
    )
    data["track_leaks_step"] = {**steps, "goal_s": 0.5}

    app.outputs = [model(x) for _ in range(4)]  # four graphs kept alive: holders to name
    lt = interleaved(
        {
            "cudamem": lambda: cudamem.live_tensors(holders=True),
            "objgraph": lambda: objgraph.by_type("Tensor"),
        },
        args.repeat,
        tag="live_tensors_small.",
    )
    rows.append(
        [
            f"live_tensors(holders=True), {heap_text}",
            fmt(lt["cudamem"]),
            fmt(lt["objgraph"]) + " (by_type, no holders)",
            "-",
        ]
    )
    data["live_tensors_small"] = {**lt, "goal_s": 0.5}

    scans: dict[str, Callable[[], Any]] = {
        "census": census.live_storage_keys,
        "objgraph": lambda: objgraph.by_type("Tensor"),
    }
    if torch.cuda.is_available():
        scans["explain"] = cudamem.explain
    sc = interleaved(scans, args.repeat, tag="census_scan.")
    rows.append(
        [
            f"census scan behind explain(), {heap_text}",
            fmt(sc["census"]),
            fmt(sc["objgraph"]) + " (by_type)",
            f"{median(sc['objgraph']) / median(sc['census']):.1f}×",
        ]
    )
    if "explain" in sc:
        rows.append([f"explain(), {heap_text}", fmt(sc["explain"]), "-", "-"])
    data["census_scan"] = {**sc, "goal_s": 0.3}
    del app.outputs, app.model, app.opt, app.heap
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller heap")
    parser.add_argument("--objects", type=int, default=3_000_000)
    parser.add_argument("--small-objects", type=int, default=450_000)
    parser.add_argument("--targets", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sample", type=int, default=3, help="objgraph chains timed for 2")
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--out", default=None, help="default benchmarks/results/holders.json")
    parser.add_argument(
        "--real", action="store_true", help="the real training heap (holders_real.py) only"
    )
    args = parser.parse_args()
    if args.real:
        import holders_real  # type: ignore[import-not-found]

        if args.quick:
            args.repeat = min(args.repeat, 3)
        where = "gpu" if torch.cuda.is_available() else "cpu"
        args.out = args.out or f"benchmarks/results/holders-real-{where}.json"
        holders_real.real_heap(args)
        return
    args.out = args.out or "benchmarks/results/holders.json"
    if args.quick:
        args.repeat = min(args.repeat, 3)
        args.sample = min(args.sample, 2)
        args.objects = min(args.objects, 1_500_000)

    rows: list[list[str]] = []
    # CPU seconds count every thread: on a busy machine torch's spinning OpenMP workers add
    # up to 0.6 s to a 4 ms step; OMP_NUM_THREADS=1 keeps the step rows about cudamem.
    data: dict[str, Any] = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    big_heap(args, rows, data)
    small_heap(args, rows, data)
    data["cpu_s"] = CPU
    rows.append(
        [
            "CPU seconds (median): find_holders, track step, live_tensors, census",
            " / ".join(
                f"{median(CPU[k]):.2f}"
                for k in (
                    "many_targets.cudamem",
                    "step.tracked",
                    "live_tensors_small.cudamem",
                    "census_scan.census",
                )
            ),
            "-",
            "-",
        ]
    )
    emit(
        "cudamem holder search and census vs objgraph (median, range)",
        ["case", "cudamem", "peer", "ratio"],
        rows,
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
