"""The heap operations on the heap of a real training process, against objgraph and plain
PyTorch, in one interleaved run (``benchmarks/holders.py --real`` runs this).

The heap: transformers and lightning imported, a 4-layer GPT-2 built from a config (no
download) and trained a few AdamW steps (on the GPU when there is one), and a kept history of
loss tensors (each holding its graph). Then, each ``--repeat`` times, alternating:

* ``who_holds(one parameter)``, with the compiled heap pass and with the Python pass, against
  objgraph's ``find_backref_chain(parameter, is_proper_module)`` (one chain);
* ``live_tensors(holders=True)`` (both passes), ``find_graph_holders()``, ``explain()``;
* naming culprits when growth is suspected: ``cudamem.leaks(since=span)`` after a
  ``track(leaks=True)`` step that appended its loss to the history;
* a ``track(leaks=True)`` training step against the same step plain;
* ``dump_snapshot()`` (GPU only) against ``torch.cuda.memory._dump_snapshot``;
* the pytest plugin: 60 tiny tests (a 512x512 matmul each) with ``--cudamem`` against plain
  ``pytest``, run as subprocesses, verdicts compared.

    PYTHONPATH=. python3 benchmarks/holders.py --real [--quick] [--out ...]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import objgraph
import torch
from _common import (  # type: ignore[import-not-found]
    emit,
    fmt_seconds,
    interleaved,
    machine,
    median,
)

import cudamem
from cudamem.native import heapscan as _heapscan

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

#: The goals of the real-heap issue, seconds (the plugin: a ratio to the plain run).
GOALS = {
    "who_holds": 0.1,
    "live_tensors": 0.2,
    "culprits": 0.3,
    "track_step": 0.3,
    "explain": 0.1,
    "dump_snapshot": 0.5,
    "plugin_ratio": 1.3,
}


def build_process() -> dict[str, Any]:
    """What a real training process holds: frameworks imported, a model, its optimizer."""
    import lightning  # noqa: F401  (its modules are part of the heap)
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=128)
    cfg.bos_token_id = cfg.eos_token_id = 0
    model = GPT2LMHeadModel(cfg).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state: dict[str, Any] = {"model": model, "opt": opt, "loss_history": []}

    def step() -> torch.Tensor:
        x = torch.randint(0, 8000, (4, 64), device=DEVICE)
        out = model(x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    state["step"] = step
    for _ in range(3):
        state["loss_history"].append(step())  # the classic leak: each keeps its graph
    if CUDA:
        torch.cuda.synchronize()
    return state


PLUGIN_TESTS = """
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("i", range(60))
def test_tiny_matmul(i):
    a = torch.randn(512, 512, device=DEVICE)
    assert (a @ a).shape == (512, 512)
"""


def plugin_case(repeat: int) -> dict[str, Any]:
    """60 tiny tests, plain and with --cudamem, as subprocesses (wall seconds each)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "test_tiny.py"
        path.write_text(textwrap.dedent(PLUGIN_TESTS))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # The plugin from this checkout: by its entry point when cudamem is installed,
        # else by name (pytest_cudamem.py lies on PYTHONPATH).
        installed = any(
            e.name == "cudamem" for e in importlib.metadata.entry_points(group="pytest11")
        )
        load = () if installed else ("-p", "pytest_cudamem")

        def run(*extra: str) -> tuple[float, str]:
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, str(path)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp,
                timeout=600,
                check=False,
            )
            last = (done.stdout.strip().splitlines() or [""])[-1]
            return time.perf_counter() - t0, last.split(" in ")[0]

        times: dict[str, list[float]] = {"plain": [], "cudamem": []}
        verdicts: dict[str, set[str]] = {"plain": set(), "cudamem": set()}
        for _ in range(repeat):
            for name, extra in (("plain", load), ("cudamem", (*load, "--cudamem"))):
                seconds, verdict = run(*extra)
                times[name].append(seconds)
                verdicts[name].add(verdict)
    return {
        "seconds": times,
        "verdicts": {k: sorted(v) for k, v in verdicts.items()},
        "same_verdicts": verdicts["plain"] == verdicts["cudamem"],
        "ratio": median(times["cudamem"]) / median(times["plain"]),
    }


def real_heap(args: argparse.Namespace) -> None:
    status = _heapscan.wait(120)
    state = build_process()
    gc.collect()
    objects = len(gc.get_objects())
    model, step, history = state["model"], state["step"], state["loss_history"]
    param = model.transformer.h[2].mlp.c_fc.weight
    rows: list[list[str]] = []
    data: dict[str, Any] = {
        "machine": machine(),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu",
        "gc_objects": objects,
        "heap_pass": {"state": status.state, "reason": status.reason},
        "goals_s": GOALS,
    }

    def python(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with _heapscan.python_pass():
                return fn()

        return run

    # Identical answers from both passes (after a first search: see test_heapscan).
    def paths(result: Any) -> list[str]:  # a frame's label carries its line: drop it
        return [h.path.split(": ", 1)[-1] for h in result]

    def search() -> list[str]:  # both passes from the same frames (they are holders too)
        return paths(cudamem.who_holds(param))

    search()
    fast_paths = search()
    with _heapscan.python_pass():
        slow_paths = search()
    data["same_paths"] = fast_paths == slow_paths
    data["paths"] = fast_paths
    data["paths_python_pass"] = slow_paths

    def leak_step() -> Any:
        with cudamem.track("bench-step", leaks=True) as span:
            history.append(step())
        return span

    span = leak_step()
    timed = interleaved(
        {
            "who_holds": lambda: cudamem.who_holds(param),
            "who_holds (Python pass)": python(lambda: cudamem.who_holds(param)),
            "objgraph.find_backref_chain": lambda: objgraph.find_backref_chain(
                param, objgraph.is_proper_module
            ),
            "gc.get_referrers(param)": lambda: gc.get_referrers(param),
            "live_tensors(holders=True)": lambda: cudamem.live_tensors(holders=True),
            "live_tensors (Python pass)": python(lambda: cudamem.live_tensors(holders=True)),
            "leaks(since=span) (culprits)": lambda: cudamem.leaks(since=span),
            "find_graph_holders()": lambda: cudamem.find_graph_holders(),
            "explain()": lambda: cudamem.explain(),
            "step plain": step,
            "step under track(leaks=True)": leak_step,
        },
        args.repeat,
    )
    if CUDA:
        with tempfile.TemporaryDirectory() as tmp:
            snap = interleaved(
                {
                    "dump_snapshot()": lambda: cudamem.dump_snapshot(f"{tmp}/a.pickle"),
                    "torch _dump_snapshot": lambda: torch.cuda.memory._dump_snapshot(
                        f"{tmp}/b.pickle"
                    ),
                },
                args.repeat,
            )
        timed.update(snap)
    del history[3:]
    data["seconds"] = timed
    peer = {
        "who_holds": "objgraph.find_backref_chain",
        "who_holds (Python pass)": "objgraph.find_backref_chain",
        "step under track(leaks=True)": "step plain",
        "dump_snapshot()": "torch _dump_snapshot",
    }
    for name, xs in timed.items():
        if name in peer.values():
            continue
        other = peer.get(name)
        ratio = f"{median(timed[other]) / median(xs):.1f}x faster" if other else "-"
        rows.append([name, fmt_seconds(xs), fmt_seconds(timed[other]) if other else "-", ratio])
    plugin = plugin_case(1 if args.quick else max(1, min(args.repeat, 3)))
    data["plugin"] = plugin
    rows.append(
        [
            "pytest --cudamem, 60 tiny tests (s)",
            fmt_seconds(plugin["seconds"]["cudamem"]),
            fmt_seconds(plugin["seconds"]["plain"]),
            f"{plugin['ratio']:.2f}x the plain run; same verdicts: {plugin['same_verdicts']}",
        ]
    )
    goals = {
        "who_holds": median(timed["who_holds"]),
        "live_tensors": median(timed["live_tensors(holders=True)"]),
        "culprits": median(timed["leaks(since=span) (culprits)"]),
        "track_step": median(timed["step under track(leaks=True)"]) - median(timed["step plain"]),
        "plugin_ratio": plugin["ratio"],
    }
    if CUDA:  # without a GPU, explain() says so in one line: no ledger, nothing to time
        goals["explain"] = median(timed["explain()"])
        goals["dump_snapshot"] = median(timed["dump_snapshot()"])
    data["goals"] = {
        k: {"value": v, "goal": GOALS[k], "met": v <= GOALS[k]} for k, v in goals.items()
    }
    title = (
        f"Heap operations on a real training heap ({objects:,} gc objects, {data['device']}, "
        f"heap pass: {status.state}) vs objgraph / plain torch (median, range)"
    )
    emit(title, ["operation", "cudamem", "peer", "ratio"], rows, data, args.out)
    for k, g in data["goals"].items():
        print(f"goal {k}: {g['value']:.3f} <= {g['goal']} -> {'met' if g['met'] else 'NOT met'}")
    print(f"same paths from both passes: {data['same_paths']}")
