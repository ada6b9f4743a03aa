"""who_holds() against objgraph on a heap of about 1 M Python objects.

Two questions:

1. one tensor held six containers deep from a module global: ``cudamem.who_holds`` (every
   path) against ``objgraph.find_backref_chain`` (one chain);
2. holders of 1,000 live tensors: ``cudamem.live_tensors(holders=True)`` (one search for
   all of them) against objgraph one chain per tensor (timed on a sample and extrapolated,
   because 1,000 chains take minutes; the table says so).

Runs on CPU: the search is about Python objects, the device does not matter.

    python benchmarks/holders.py [--repeat 5] [--sample 5] [--out benchmarks/results/holders.json]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import types
from typing import Any

import objgraph
import torch
from _common import emit, median, spread  # type: ignore[import-not-found]

import cudamem

# A stand-in for the user's __main__: tensors hang off its globals.
app = types.ModuleType("bench_app")
sys.modules["bench_app"] = app


def build_heap(n_objects: int) -> list[Any]:
    """About ``n_objects`` gc-tracked objects of the usual kinds (dicts, lists, tuples)."""
    heap: list[Any] = []
    for i in range(n_objects // 4):
        heap.append({"id": i, "tags": [i, str(i)], "pair": (i, [i])})
    return heap


def is_app(obj: Any) -> bool:
    return obj is app.__dict__


def time_it(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sample", type=int, default=5, help="objgraph chains timed for Q2")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--out", default="benchmarks/results/holders.json")
    args = parser.parse_args()

    app.heap = build_heap(args.objects)
    gc.collect()
    tracked = len(gc.get_objects())

    # Q1: one tensor six containers deep.
    t = torch.ones(16)
    app.trainer = {"runs": [None, {"val": ({"outputs": [[t]]},)}]}
    expected = "bench_app.trainer['runs'][1]['val'][0]['outputs'][0][0]"
    result = cudamem.who_holds(t)
    assert expected in result.paths, result.paths
    cm_one = time_it(lambda: cudamem.who_holds(t), args.repeat)
    chain = objgraph.find_backref_chain(t, is_app, max_depth=12)
    assert chain[0] is app.__dict__, "objgraph did not find the chain"
    del chain
    og_one = time_it(
        lambda: objgraph.find_backref_chain(t, is_app, max_depth=12), max(1, args.repeat // 2)
    )

    # Q2: 1,000 live tensors, held from several containers.
    app.pool = {f"layer{i}": [torch.full((4,), float(i))] for i in range(args.tensors // 2)}
    app.history = [torch.full((2,), float(i)) for i in range(args.tensors - args.tensors // 2)]
    tensors = [v[0] for v in app.pool.values()] + list(app.history)
    census = cudamem.live_tensors("cpu", holders=True)
    named = sum(1 for s in census if s.holders is not None and s.holders.holders)
    assert named >= args.tensors, (named, args.tensors)
    del census
    cm_many = time_it(lambda: cudamem.live_tensors("cpu", holders=True), args.repeat)
    sample = tensors[:: max(1, len(tensors) // args.sample)][: args.sample]

    def chains() -> None:
        for x in sample:
            objgraph.find_backref_chain(x, is_app, max_depth=12)

    og_per_chain = time_it(chains, 1)[0] / len(sample)
    og_many = og_per_chain * len(tensors)
    sample.clear()
    tensors.clear()

    cm1, og1, cmn = median(cm_one), median(og_one), median(cm_many)
    rows = [
        [
            "1 tensor, 6 deep: who_holds (all paths)",
            f"{cm1 * 1e3:.0f} ms",
            f"{og1 * 1e3:.0f} ms",
            f"{og1 / cm1:.1f}×",
        ],
        [
            f"{args.tensors} tensors: live_tensors(holders=True)",
            f"{cmn * 1e3:.0f} ms",
            f"{og_many:.1f} s (extrapolated from {args.sample})",
            f"{og_many / cmn:.0f}×",
        ],
    ]
    emit(
        f"who_holds vs objgraph.find_backref_chain, {tracked:,} gc-tracked objects",
        ["case", "cudamem (median)", "objgraph (one chain each)", "speed-up"],
        rows,
        {
            "gc_tracked_objects": tracked,
            "one_tensor": {
                "cudamem_s": cm_one,
                "objgraph_s": og_one,
                "cudamem_median_s": cm1,
                "objgraph_median_s": og1,
                "ratio": og1 / cm1,
                "paths": result.paths,
            },
            "many_tensors": {
                "tensors": args.tensors,
                "cudamem_s": cm_many,
                "cudamem_median_s": cmn,
                "objgraph_per_chain_s": og_per_chain,
                "objgraph_sample": args.sample,
                "objgraph_extrapolated_s": og_many,
                "ratio": og_many / cmn,
                "cudamem_spread_s": spread(cm_many),
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
