"""Seed 001's experiments: the CUDA context nvidia-smi counts, sequential training, a new stream
or thread per run.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..base.format import format_bytes
from ..ledger.reclaim import release
from .registry import Check, Experiment, MiB, _bytes_check, _cuda, _experiment
from .seed000 import _user_module

_SEED001_SCRIPT = r"""
import gc, json, sys, torch, cudamem
from cudamem import machine_status
from cudamem.base.data import to_data
dev = int(sys.argv[1])
def used():
    for d in machine_status().devices:
        if d.index == dev and d.memory is not None:
            return d.memory.used
    return None
def outside():
    st = machine_status()
    for d in st.devices:
        if d.index == dev:
            return st.lines(d)[-1][1]
    return None
out = {"before": used(), "outside_before": outside(),
       "contexts_before": to_data(cudamem.explain())["devices"]}
x_ = torch.zeros(1024, 1024)
x = x_.to(f"cuda:{dev}")
torch.cuda.synchronize(dev)
out["after"] = used()
ledger = cudamem.explain(dev)[0]
out["ledger"] = str(ledger)
out["context"] = ledger.line("context").nbytes
out["outside_after"] = ledger.unattributed
out["reserved"] = torch.cuda.memory_reserved(dev)
del x
gc.collect()
rel = cudamem.release(dev)
out["freed_reserved"] = rel[dev].freed_reserved
out["nvml_freed"] = rel[dev].nvml_freed
out["after_release"] = used()
y = torch.zeros(1024, 1024 * 20).to(f"cuda:{dev}")
del y
out["freed_80"] = cudamem.release(dev)[dev].freed_reserved
print(json.dumps(out))
"""


@_experiment(
    "seed001-context",
    """Seed 001: nvidia-smi +1.2 GB for a 4 MiB tensor; empty_cache frees only 20 MiB

    The jump is the CUDA context (never freed before exit); the 4 MiB tensor sits in a
    20 MiB segment, which is all empty_cache() can return. Run in a fresh process.""",
    gpus=1,
)
def seed001_context(on: int | None) -> Experiment:
    import json
    import subprocess
    import sys

    device = _cuda(on)
    proc = subprocess.run(
        [sys.executable, "-c", _SEED001_SCRIPT, str(device)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return Experiment(
            checks=(Check("fresh process ran", False, proc.stderr.strip()[-500:]),),
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    jump = None if out["before"] is None or out["after"] is None else out["after"] - out["before"]
    context = out["context"]
    rows = (
        ("NVML used before any CUDA call", format_bytes(out["before"])),
        ("after x = zeros(1024, 1024).to(cuda)", format_bytes(out["after"])),
        ("  jump", format_bytes(jump, signed=True)),
        ("  of which: CUDA context (explain)", format_bytes(context)),
        ("  of which: allocator reserved (20 MiB segment)", format_bytes(out["reserved"])),
        (
            "  of which: driver memory outside every process",
            f"{format_bytes(out['outside_before'])} → {format_bytes(out['outside_after'])}",
        ),
        ("del x; cudamem.release(): allocator freed", format_bytes(out["freed_reserved"])),
        ("  NVML used dropped by", format_bytes(out["nvml_freed"])),
        ("80 MiB tensor (1024 × 20480): release() freed", format_bytes(out["freed_80"])),
    )
    checks = (
        Check("no context before the first CUDA call", out["contexts_before"] == [], ""),
        _bytes_check("the 4 MiB tensor reserves a 20 MiB segment", out["reserved"], 20 * MiB),
        Check(
            "the context is 256 MiB–1.5 GiB of the jump",
            context is not None and 256 * MiB <= context <= 1536 * MiB,
            format_bytes(context),
        ),
        Check(
            "the jump minus the 20 MiB segment is context-sized (256 MiB–1.5 GiB)",
            jump is not None and 256 * MiB <= jump - 20 * MiB <= 1536 * MiB,
            f"jump {format_bytes(jump)}",
        ),
        _bytes_check("release() frees the 20 MiB segment", out["freed_reserved"], 20 * MiB),
        _bytes_check(
            "nvidia-smi drops by 20 MiB (±2 MiB)", out["nvml_freed"], 20 * MiB, within=2 * MiB
        ),
        _bytes_check("the 80 MiB tensor's segment is freed whole", out["freed_80"], 80 * MiB),
    )
    return Experiment(
        headers=("step", "bytes"),
        rows=rows,
        checks=checks,
        notes=tuple(out["ledger"].splitlines()),
    )


class NaiveN(torch.nn.Module):
    """Seed 001's model (its forward uses lin2 on x, as the seed's does)."""

    def __init__(self, nx: int) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(nx, nx)
        self.lin2 = torch.nn.Linear(nx, 1)
        self.act = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.act(self.lin1(x))
        out: torch.Tensor = self.act(self.lin2(x))
        return out


@_experiment(
    "seed001-sequential",
    """Seed 001: sequential training runs, with and without `del optimizer`

    After del model the optimizer still holds the parameters (param_groups) and Adam's
    state; release() names it. Deleting it too gives everything back.""",
    gpus=1,
)
def seed001_sequential(on: int | None) -> Experiment:
    device = _cuda(on)
    where = f"cuda:{device}"
    release(device)
    rows = []
    remaining_paths: list[str] = []
    results: dict[str, list[int]] = {"del": [], "keep": []}
    with _user_module("seed001") as ns:  # the seed's script globals
        for mode in ("del", "keep"):
            for k in range(2):
                ns["model"] = NaiveN(1024)
                ns["optimizer"] = torch.optim.Adam(ns["model"].parameters(), lr=1e-3)
                x = torch.ones(1024, 1024).to(where)
                y = torch.ones(1024, 1).to(where)
                ns["model"].to(where)
                ns["optimizer"].zero_grad()
                loss = torch.nn.functional.mse_loss(ns["model"](x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                ns["optimizer"].step()
                del loss, x, y, ns["model"]
                if mode == "del":
                    del ns["optimizer"]
                d = release(device)[device]
                results[mode].append(d.still_allocated)
                top = d.remaining[0].paths[0] if d.remaining and d.remaining[0].paths else ""
                rows.append(
                    (
                        f"{'with' if mode == 'del' else 'without'} del optimizer, run {k}",
                        format_bytes(d.still_allocated),
                        format_bytes(d.after.reserved),
                        top,
                    )
                )
                if mode == "keep":
                    # The paths release() prints: five per storage.
                    remaining_paths = [p for r in d.remaining for p in r.paths[:5]]
    checks = (
        Check(
            "with del optimizer: nothing stays allocated after release()",
            results["del"] == [0, 0],
            str(results["del"]),
        ),
        Check(
            "without it: the model's parameters stay allocated after del model",
            all(n >= 4 * MiB for n in results["keep"]),
            str(results["keep"]),
        ),
        Check(
            "release() names the optimizer as the holder",
            any(p.startswith("seed001.optimizer.") for p in remaining_paths),
            "; ".join(remaining_paths[:3]),
        ),
    )
    release(device)
    return Experiment(
        headers=("run", "still allocated", "reserved", "largest holder"),
        rows=tuple(rows),
        checks=checks,
    )


@functools.lru_cache(maxsize=16)
def _fresh_run(case: str, device: int) -> str:
    """The JSON that ``python -m cudamem.demo.seed001_runs CASE DEVICE`` printed (cached: two
    experiments read the same run)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "cudamem.demo.seed001_runs", case, str(device)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {case} run failed: {proc.stderr.strip()[-800:]}")
    return lines[-1]


def _run(case: str, device: int) -> dict[str, Any]:
    import json

    out: dict[str, Any] = json.loads(_fresh_run(case, device))
    return out


def _levels(out: dict[str, Any]) -> list[int]:
    return [int(r["allocated"]) for r in out["runs"]]


def _run_rows(out: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    rows = []
    previous = None
    for k, r in enumerate(out["runs"]):
        delta = "" if previous is None else format_bytes(r["allocated"] - previous, signed=True)
        rows.append((f"run {k}", format_bytes(r["allocated"]), delta, format_bytes(r["reserved"])))
        previous = r["allocated"]
    return tuple(rows)


_RUN_HEADERS = ("run", "allocated after", "allocated Δ", "reserved after")


def _lines(out: dict[str, Any], device: int, word: str) -> list[dict[str, Any]]:
    """The ledger lines of ``device`` whose key or label contains ``word`` (any case)."""
    ledger = out["ledgers"].get(str(device), {"lines": []})
    w = word.lower()
    return [ln for ln in ledger["lines"] if w in ln["key"].lower() or w in ln["label"].lower()]


def _line_text(line: dict[str, Any]) -> str:
    return f"{line['label']}: {format_bytes(line['nbytes'])} ({line['note'] or line['frees']})"


def _ledger_says(out: dict[str, Any], device: int, pattern: str, word: str = "") -> str | None:
    """The first ledger text of ``device`` (lines with ``word``, or every line and note)
    matching the regular expression ``pattern``, ignoring case."""
    import re

    ledger = out["ledgers"].get(str(device))
    if ledger is None:
        return None
    texts = [
        f"{ln['label']} {ln['note']} {ln['frees']}"
        for ln in (_lines(out, device, word) if word else ledger["lines"])
    ]
    if not word:
        texts += ledger["notes"]
    for text in texts:
        if re.search(pattern, text, re.IGNORECASE):
            return text
    return None


def _flat(levels: Sequence[int], start: int = 0) -> bool:
    tail = levels[start:]
    return bool(tail) and max(tail) - min(tail) <= MiB


def _first_lines(texts: Sequence[str]) -> str:
    return "; ".join(t.splitlines()[0] for t in texts) or "none"


def _no_leak_warning(out: dict[str, Any], name: str) -> Check:
    return Check(name, not out["leak_warnings"], _first_lines(out["leak_warnings"]))


_Judge = Callable[[dict[str, Any], int], tuple[list[Check], list[str]]]


def _runs(case: str, judge: _Judge) -> Callable[[int | None], Experiment]:
    """The run of an experiment over one fresh-process run of ``case``: the table of levels
    per run, and the checks and notes ``judge`` reads off its output on the device."""

    def run(on: int | None) -> Experiment:
        device = _cuda(on)
        out = _run(case, device)
        checks, notes = judge(out, device)
        return Experiment(
            headers=_RUN_HEADERS, rows=_run_rows(out), checks=tuple(checks), notes=tuple(notes)
        )

    return run


def _workspace_checks(out: dict[str, Any], device: int) -> list[Check]:
    """explain() puts the level in the cuBLAS workspace line; release() frees it."""
    levels = _levels(out)
    cublas = _lines(out, device, "cublas")
    held = sum(int(ln["nbytes"] or 0) for ln in cublas)
    rel = out["release"]
    return [
        Check(
            "explain(): what stays allocated after the runs is cuBLAS workspaces",
            bool(cublas) and abs(held - levels[-1]) <= MiB,
            "; ".join(_line_text(ln) for ln in cublas) or "no cuBLAS line",
        ),
        Check(
            "release(clear_cublas=True) frees them: nothing stays allocated",
            rel["still_allocated"] == 0 and rel["freed_allocated"] >= levels[-1] - MiB,
            f"freed {format_bytes(rel['freed_allocated'])}, still allocated "
            f"{format_bytes(rel['still_allocated'])}",
        ),
    ]


def _judge_stream(out: dict[str, Any], device: int) -> tuple[list[Check], list[str]]:
    levels = _levels(out)
    rises = [levels[i + 1] - levels[i] for i in range(len(levels) - 1)]
    per_stream = _ledger_says(out, device, r"per[^.;]{0,24}stream", "cublas")
    checks = [
        Check(
            "allocated rises by the same amount every run",
            bool(rises) and min(rises) >= MiB and max(rises) - min(rises) <= MiB,
            ", ".join(format_bytes(r, signed=True) for r in rises),
        ),
        *_workspace_checks(out, device),
        Check(
            "explain() says the workspaces are kept per stream",
            per_stream is not None,
            per_stream or "no cuBLAS line mentions streams",
        ),
        Check(
            "a LeakWarning names the cuBLAS workspaces",
            any("cublas workspace" in w.lower() for w in out["leak_warnings"]),
            _first_lines(out["leak_warnings"]),
        ),
    ]
    notes = [_line_text(ln) for ln in _lines(out, device, "cublas")]
    notes += [_line_text(ln) for ln in _lines(out, device, "strand")]
    notes += [f"LeakWarning: {w}" for w in out["leak_warnings"][:1]]
    return checks, notes


def _judge_thread(out: dict[str, Any], device: int) -> tuple[list[Check], list[str]]:
    levels = _levels(out)
    checks = [
        Check(
            "the level stops rising: the last three runs are equal (±1 MiB)",
            _flat(levels, len(levels) - 3),
            ", ".join(format_bytes(v) for v in levels),
        ),
        _no_leak_warning(out, "no LeakWarning: growth that stops is not a leak"),
        *_workspace_checks(out, device),
    ]
    return checks, [_line_text(ln) for ln in _lines(out, device, "cublas")]


def _judge_flat(out: dict[str, Any], device: int) -> tuple[list[Check], list[str]]:
    levels = _levels(out)
    rel = out["release"]
    checks = [
        Check(
            "allocated is the same after every run (±1 MiB)",
            _flat(levels),
            ", ".join(format_bytes(v) for v in levels),
        ),
        _no_leak_warning(out, "no LeakWarning"),
        Check(
            "release(clear_cublas=True) leaves nothing allocated",
            rel["still_allocated"] == 0,
            f"freed {format_bytes(rel['freed_allocated'])}",
        ),
    ]
    notes = [f"contexts: {', '.join(f'cuda:{d}' for d in out['contexts'])}"]
    notes += [_line_text(ln) for ln in _lines(out, device, "cublas")]
    return checks, notes


def _judge_plain(out: dict[str, Any], device: int) -> tuple[list[Check], list[str]]:
    """The flat loop's checks, and that naming the device made no context on cuda:0."""
    checks, notes = _judge_flat(out, device)
    checks.append(
        Check(
            "naming cuda:1 creates no context on cuda:0",
            0 not in out["contexts"],
            ", ".join(f"cuda:{d}" for d in out["contexts"]),
        )
    )
    return checks, notes


_STREAM_PER_RUN = """Seed 001: a new torch.cuda.Stream per run on cuda:{device}

    cuBLAS keeps a workspace per handle and stream, and empty_cache() never frees it: training
    on a new stream each run adds that run's workspaces (the forward thread's and autograd's;
    the first check below prints what they add on this card) to allocated, for good — one
    run's worth per loop."""


_THREAD_PER_RUN = """Seed 001: a new thread per run on cuda:{device}

    Each new thread asks cuBLAS for a handle; handles are pooled and handed to the next thread
    once one ends, so a thread per run adds a workspace once (the first check below prints
    the levels on this card), then the level stays flat: not a leak, and no LeakWarning."""


seed001_stream_per_run = _experiment("seed001-stream-per-run", _STREAM_PER_RUN, gpus=1)(
    _runs("stream", _judge_stream)
)


seed001_thread_per_run = _experiment("seed001-thread-per-run", _THREAD_PER_RUN, gpus=1)(
    _runs("thread", _judge_thread)
)


seed001_gpu1_stream_per_run = _experiment(
    "seed001-gpu1-stream-per-run", _STREAM_PER_RUN, gpus=2, device=1
)(_runs("stream", _judge_stream))
