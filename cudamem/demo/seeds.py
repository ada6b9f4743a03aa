"""The seeds' experiments, reproduced through cudamem: collection only, no printing.

Each experiment returns a frozen ``Experiment`` (a table, a one-line explanation and
PASS/FAIL checks); ``python -m cudamem demo`` renders them. Experiments that need a GPU are
returned as skipped on a machine without one.

``@_experiment(key, text, gpus=..., device=...)`` registers each, in the demo's order: its
key, its title and explanation (``text``), the GPUs it needs and where it runs are said once,
there; the function below it only runs the experiment and returns its table and checks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..allocator import backend as _backend
from ..base.format import format_bytes, plural
from ..holders.census import live_storage_keys, live_tensors
from ..holders.finder import who_holds
from ..host.copy import to_host
from ..ledger.reclaim import release
from ..modules.profiler import track_modules
from ..scalars.logger import ScalarLogger
from ..spans.span import MemorySpan, track

__all__ = ["Check", "Experiment", "experiments", "run_demo"]

MiB = 1024**2


@dataclass(frozen=True, slots=True)
class Check:
    """One PASS/FAIL line of the demo."""

    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Experiment:
    """One reproduced experiment: what it shows, its table and its checks.

    An experiment's function returns its table, notes and checks; its registration
    (``_experiment``) adds the key, title and explanation."""

    key: str = ""
    title: str = ""
    explanation: str = ""
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    checks: tuple[Check, ...] = ()
    #: Why the experiment did not run (no GPU), or None when it ran.
    skipped: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when it ran and every check passed."""
        return self.skipped is None and all(c.passed for c in self.checks)


#: Every experiment of the demo, in order: (key, function), as ``_experiment`` registers them.
_EXPERIMENTS: list[tuple[str, Callable[[], Experiment]]] = []


def _experiment(
    key: str, text: str, *, gpus: int = 0, device: int = 0
) -> Callable[[Callable[[int | None], Experiment]], Callable[[], Experiment]]:
    """Register the decorated run as the demo's next experiment, ``key``.

    ``text`` is its title, a blank line, and its explanation (``{device}`` is the device's
    index). The function registered runs it on ``cuda:device``, on the CPU where no GPU
    exists if ``gpus`` is 0, else skipped on a machine with fewer than ``gpus`` GPUs, and
    completes its result with the key, title and explanation.
    """
    title, _, explanation = inspect.cleandoc(text.replace("{device}", str(device))).partition(
        "\n\n"
    )
    explanation = " ".join(explanation.split())

    def register(run: Callable[[int | None], Experiment]) -> Callable[[], Experiment]:
        def experiment() -> Experiment:
            skip = _needs(gpus)
            if skip is not None:
                return Experiment(key, title, explanation, skipped=skip)
            out = run(device if gpus or _backend.get().device_count() > device else None)
            return replace(out, key=key, title=title, explanation=explanation)

        functools.update_wrapper(experiment, run, updated=())
        experiment.__doc__ = f"{title}\n\n{explanation}"
        _EXPERIMENTS.append((key, experiment))
        return experiment

    return register


def _needs(gpus: int) -> str | None:
    """Why an experiment cannot run here (too few GPUs), or None."""
    count = _backend.get().device_count() if gpus else 0
    if count >= gpus:
        return None
    if gpus == 1:
        return "needs a CUDA GPU"
    return f"needs two CUDA GPUs (this machine has {count}); the single-GPU variants run on cuda:0"


def _cuda(device: int | None) -> int:
    """The GPU of an experiment registered with ``gpus`` (it never runs without one)."""
    if device is None:
        raise RuntimeError("an experiment registered with gpus=0 asked for a GPU")
    return device


def _where(device: int | None) -> str:
    """Where the experiment's tensors live: the GPU, else the CPU."""
    return f"cuda:{device}" if device is not None else "cpu"


def _span_row(span: MemorySpan, device: int) -> tuple[str, ...]:
    d = span.device(device)
    return (
        span.name,
        format_bytes(d.allocated_delta, signed=True),
        format_bytes(d.reserved_delta, signed=True),
        format_bytes(d.after.allocated),
        format_bytes(d.after.reserved),
    )


def _bytes_check(name: str, measured: int | None, expected: int, *, within: int = 0) -> Check:
    """Passes when ``measured`` is known and ``expected`` give or take ``within`` bytes."""
    ok = measured is not None and abs(measured - expected) <= within
    return Check(name, ok, format_bytes(measured))


def _expect(name: str, span: MemorySpan, device: int, alloc: int, reserved: int) -> Check:
    d = span.device(device)
    ok = d.allocated_delta == alloc and d.reserved_delta == reserved
    detail = (
        f"allocated {format_bytes(d.allocated_delta, signed=True)} "
        f"(expected {format_bytes(alloc, signed=True)}), "
        f"reserved {format_bytes(d.reserved_delta, signed=True)} "
        f"(expected {format_bytes(reserved, signed=True)})"
    )
    return Check(name, ok, detail)


@_experiment(
    "seed000-256mib",
    """Seed 000: a 256 MiB tensor, del, list.clear() and empty_cache()

    del removes a name, not the tensor: while a list holds it nothing is freed; clearing the
    list frees the allocation, and only empty_cache() returns the cache.""",
    gpus=1,
)
def seed000_lifecycle(on: int | None) -> Experiment:
    device = _cuda(on)
    backend = _backend.get()
    gc.collect()
    backend.empty_cache()
    spans: list[MemorySpan] = []
    with track("create x = ones(8192, 8192)", device=device) as s:
        x = torch.ones((8192, 8192), device=f"cuda:{device}", dtype=torch.float32)
    spans.append(s)
    with track("empty_cache() while x is alive", device=device) as s:
        backend.empty_cache()
    spans.append(s)
    saved = [x]
    with track("del x (the list still holds it)", device=device) as s:
        del x
        gc.collect()
        backend.empty_cache()
    spans.append(s)
    with track("saved.clear()", device=device) as s:
        saved.clear()
        gc.collect()
    spans.append(s)
    with track("empty_cache()", device=device) as s:
        backend.empty_cache()
    spans.append(s)
    # The seed's figures; under expandable segments a reservation is whole 20 MiB pages.
    reserved = _backend.reserved_for(256 * MiB)
    expected = [
        (256 * MiB, reserved),
        (0, 0),
        (0, 0),
        (-256 * MiB, 0),
        (0, -reserved),
    ]
    checks = tuple(
        _expect(sp.name, sp, device, a, r) for sp, (a, r) in zip(spans, expected, strict=True)
    )
    return Experiment(
        headers=("step", "allocated Δ", "reserved Δ", "allocated", "reserved"),
        rows=tuple(_span_row(sp, device) for sp in spans),
        checks=checks,
    )


@contextlib.contextmanager
def _user_module(name: str) -> Iterator[dict[str, Any]]:
    """A module the experiment's "user code" lives in, registered in ``sys.modules``.

    cudamem hides its own frames from ``who_holds``; the demo's objects therefore live in
    this module's globals, where paths read like a user's script (``seed000.saved[0]``).
    """
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        yield module.__dict__
    finally:
        module.__dict__.clear()
        sys.modules.pop(name, None)


@_experiment(
    "seed000-who-holds",
    """Seed 000: del x, yet something still holds it

    who_holds() names every path that keeps the storage alive, aliases included.""",
)
def seed000_who_holds(device: int | None) -> Experiment:
    where = _where(device)
    with _user_module("seed000") as ns:
        x = torch.ones((1024, 1024), device=where)
        ns["saved"] = [x]
        ns["view"] = {"first row": x[0]}
        del x
        holders = who_holds(ns["saved"][0])
    paths = holders.paths
    rows = tuple((h.path, h.via, h.root_kind) for h in holders)
    checks = (
        Check("the list is named", "seed000.saved[0]" in paths, "; ".join(paths[:3])),
        Check(
            "the view in a dict is named as an alias",
            any(h.path == "seed000.view['first row']" and h.is_alias for h in holders),
            "; ".join(paths),
        ),
    )
    return Experiment(headers=("path", "via", "root"), rows=rows, checks=checks)


def _census_bytes(device_type: str) -> int:

    return sum(live_storage_keys(device_type).values())


class _Meter:
    """Bytes kept alive by a block: allocator deltas on a GPU, census deltas on the CPU."""

    def __init__(self, device: int | None) -> None:
        self.device = device

    def measure(self, name: str, block: Callable[[], object]) -> tuple[int, object]:
        gc.collect()
        if self.device is not None:
            with track(name, device=self.device) as span:
                kept = block()
            gc.collect()
            return span.allocated_delta, kept
        before = _census_bytes("cpu")
        kept = block()
        gc.collect()
        return _census_bytes("cpu") - before, kept


@_experiment(
    "seed000-losses",
    """Seed 000: ten losses of sigmoid(x * 2).mean() kept as tensors, numbers, outputs

    A loss tensor drags its autograd graph along (4 MiB of saved sigmoid output each);
    detach() keeps the output's storage on the device; numbers and host copies keep
    nothing.""",
)
def seed000_losses(device: int | None) -> Experiment:
    where = _where(device)
    meter = _Meter(device)
    x = torch.randn(1024, 1024, device=where, requires_grad=True)

    def losses_as_tensors() -> object:
        history = []
        for _ in range(10):
            history.append(torch.sigmoid(x * 2).mean())
        return history

    def losses_item() -> object:
        return [torch.sigmoid(x * 2).mean().item() for _ in range(10)]

    def losses_logger() -> object:
        logger = ScalarLogger()
        for _ in range(10):
            logger.append(torch.sigmoid(x * 2).mean())
        logger.close()
        return logger

    def outputs_detached() -> object:
        return [torch.sigmoid(x * 2).detach() for _ in range(10)]

    def outputs_to_host() -> object:
        return [to_host(torch.sigmoid(x * 2)) for _ in range(10)]

    def outputs_no_grad() -> object:
        with torch.no_grad():
            return [torch.sigmoid(x * 2).cpu() for _ in range(10)]

    cases: list[tuple[str, Callable[[], object], int, int]] = [
        ("loss_history.append(loss)", losses_as_tensors, 40 * MiB, 64 * 1024),
        ("loss_history.append(loss.item())", losses_item, 0, 1024),
        ("cudamem.ScalarLogger().append(loss)", losses_logger, 0, 1024),
        ("outputs.append(output.detach())", outputs_detached, 40 * MiB, 64 * 1024),
    ]
    if device is not None:
        # On the CPU a host copy *is* the output: these two only mean something on a GPU.
        cases += [
            ("outputs.append(cudamem.to_host(output))", outputs_to_host, 0, 1024),
            ("no_grad(): outputs.append(output.cpu())", outputs_no_grad, 0, 1024),
        ]
    rows, checks = [], []
    holder_line = None
    for name, block, expected, tolerance in cases:
        kept_bytes, kept = meter.measure(name, block)
        rows.append((name, format_bytes(kept_bytes, signed=True)))
        ok = abs(kept_bytes - expected) <= tolerance
        checks.append(
            Check(
                f"{name} keeps {format_bytes(expected)}",
                ok,
                f"measured {format_bytes(kept_bytes, signed=True)}",
            )
        )
        if name == "loss_history.append(loss)" and isinstance(kept, list):
            with _user_module("seed000") as ns:
                ns["loss_history"] = kept
                node = kept[3].grad_fn.next_functions[0][0]
                holders = who_holds(node._saved_result)
                del node
            paths = holders.paths
            holder_line = paths[0] if paths else "(no holder found)"
            checks.append(
                Check(
                    "who_holds(saved sigmoid output) names loss_history through autograd",
                    any(p.startswith("seed000.loss_history[3] → grad_fn") for p in paths),
                    holder_line,
                )
            )
        del kept
    measured = "allocator delta (track)" if device is not None else "census delta (CPU)"
    notes: tuple[str, ...] = ()
    if holder_line is not None:
        notes = (f"who_holds(loss_history[3]'s saved sigmoid output): {holder_line}",)
    return Experiment(
        headers=("what is kept", f"bytes kept ({measured})"),
        rows=tuple(rows),
        checks=tuple(checks),
        notes=notes,
    )


class SigmoidOfDouble(torch.nn.Module):
    """Seed 000's activation, ``torch.sigmoid(x * 2)``, as a module the profile can name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * 2)


class Seed000(torch.nn.Module):
    """Seed 000's loss, ``sigmoid(x * 2).mean()``, with its activation as a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.activation = SigmoidOfDouble()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.activation(x)
        return out.mean()


@_experiment(
    "seed000-modules",
    """Seed 000: which module keeps the ten losses' memory (cudamem.track_modules)

    sigmoid(x * 2) as a module: each call keeps its 4 MiB sigmoid output for the
    backward (x * 2 is freed at once), so ten losses kept as tensors are 40 MiB kept by
    Seed000.activation, the profile's top module.""",
)
def seed000_modules(device: int | None) -> Experiment:
    x = torch.randn(1024, 1024, device=_where(device), requires_grad=True)
    model = Seed000()
    gc.collect()
    with contextlib.ExitStack() as stack:
        if device is None:  # the CPU: live CPU storages as the allocator's counters
            from ..integrations._cpu import CpuStorageBackend

            stack.enter_context(_backend.use(CpuStorageBackend()))
        with track_modules(model) as prof:
            loss_history = [model(x) for _ in range(10)]
    profile = prof.profile
    del loss_history
    top = profile.top(1)
    act = profile.module("Seed000.activation")
    per_call = act.kept.max / max(act.calls.max, 1)
    rows = tuple(
        (
            r.name,
            f"{r.calls.max:g}",
            format_bytes(round(r.kept.max)),
            format_bytes(round(r.self_kept.max)),
            "n/a (CPU)" if device is None else format_bytes(round(r.forward_peak.max)),
        )
        for r in profile.modules
    )
    checks = [
        Check(
            "the profile names Seed000.activation as the top module",
            bool(top) and top[0].name == "Seed000.activation",
            top[0].name if top else "no module kept memory",
        ),
        Check(
            "each call of the activation keeps its 4 MiB sigmoid output",
            act.calls.max == 10 and abs(per_call - 4 * MiB) <= 4 * 1024,
            f"{plural(round(act.calls.max), 'call')}, "
            f"{format_bytes(round(per_call))} kept per call",
        ),
    ]
    if device is not None:  # the CPU has no peak counter
        checks.append(
            Check(
                "its forward peaks 8 MiB above its entry (x * 2 and the output)",
                abs(act.forward_peak.max - 8 * MiB) <= 64 * 1024,
                f"peak +{format_bytes(round(act.forward_peak.max))}",
            )
        )
    return Experiment(
        headers=("module", "calls", "kept", "self", "forward peak"),
        rows=rows,
        checks=tuple(checks),
    )


_SEED001_SCRIPT = r"""
import gc, json, sys, torch, cudamem
from cudamem.ledger.device import machine_status
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


# --------------------------------------------------------------------------- seed 001, GPUs
# The seed's open question: with torch.device(f"cuda:{rank}") memory grew by about one run
# per loop. Each candidate cause runs in a fresh process (cudamem.demo.seed001_runs), so that
# contexts, cuBLAS handles and stream pools start empty; the checks read what cudamem said.


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
    on a new stream each run adds that run's workspaces (the forward thread's and autograd's,
    65 MiB on an H200) to allocated, for good — one run's worth per loop."""

_THREAD_PER_RUN = """Seed 001: a new thread per run on cuda:{device}

    Each new thread asks cuBLAS for a handle; handles are pooled and handed to the next thread
    once one ends, so a thread per run adds a workspace (32 MiB on an H200) once, then the
    level stays flat: not a leak, and no LeakWarning."""

seed001_stream_per_run = _experiment("seed001-stream-per-run", _STREAM_PER_RUN, gpus=1)(
    _runs("stream", _judge_stream)
)
seed001_thread_per_run = _experiment("seed001-thread-per-run", _THREAD_PER_RUN, gpus=1)(
    _runs("thread", _judge_thread)
)
seed001_gpu1_stream_per_run = _experiment(
    "seed001-gpu1-stream-per-run", _STREAM_PER_RUN, gpus=2, device=1
)(_runs("stream", _judge_stream))


@_experiment(
    "seed001-gpu1-context-on-gpu0",
    """Seed 001: work on cuda:1 from a thread whose current device is cuda:0

    Every thread starts on cuda:0. Leaving `with torch.cuda.stream(s)` for a stream on
    cuda:1 restores cuda:0's stream and makes cuda:0 current again, and CUDA creates a
    context there (~0.5 GiB) that only the process exiting frees.
    torch.cuda.set_device(1) first avoids it.""",
    gpus=2,
    device=1,
)
def seed001_gpu1_context_on_gpu0(on: int | None) -> Experiment:
    device = _cuda(on)
    bad, good = _run("stream", device), _run("stream-set-device", device)
    context = next(iter(_lines(bad, 0, "context")), None)
    zero = bad["ledgers"].get("0", {})
    never = _ledger_says(
        bad, 0, r"never used|never allocated|did not use|never touched|untouched|unused device"
    )
    rows = []
    for label, out in (("no set_device (current: cuda:0)", bad), ("set_device(1) first", good)):
        ctx = next(iter(_lines(out, 0, "context")), None)
        rows.append(
            (
                label,
                ", ".join(f"cuda:{d}" for d in out["contexts"]),
                format_bytes(None if ctx is None else ctx["nbytes"]),
                format_bytes(out["nvml_process"].get("0")),
            )
        )
    checks = (
        Check(
            "without set_device, a CUDA context appears on cuda:0",
            0 in bad["contexts"]
            and context is not None
            and context["nbytes"] is not None
            and 256 * MiB <= context["nbytes"] <= 1536 * MiB,
            "no context line" if context is None else _line_text(context),
        ),
        Check(
            "nothing of PyTorch's is on cuda:0 (allocated and reserved 0)",
            zero.get("allocated") == 0 and zero.get("reserved") == 0,
            f"allocated {format_bytes(zero.get('allocated'))}, "
            f"reserved {format_bytes(zero.get('reserved'))}",
        ),
        Check(
            "explain() says this process never used cuda:0",
            never is not None,
            never or "no line of cuda:0's ledger says so",
        ),
        Check(
            "nvidia-smi lists this process on GPU 0",
            bad["nvml_process"].get("0") is not None,
            format_bytes(bad["nvml_process"].get("0")),
        ),
        Check(
            "the ledger says only exiting frees it (release() cannot)",
            context is not None and "exit" in context["frees"],
            "" if context is None else context["frees"],
        ),
        Check(
            "torch.cuda.set_device(1) first: no context on cuda:0",
            0 not in good["contexts"],
            ", ".join(f"cuda:{d}" for d in good["contexts"]),
        ),
    )
    notes = tuple(zero.get("text", "").splitlines())
    return Experiment(
        headers=("run", "contexts", "cuda:0 context (explain)", "NVML on GPU 0"),
        rows=tuple(rows),
        checks=checks,
        notes=notes,
    )


seed001_gpu1_thread_per_run = _experiment(
    "seed001-gpu1-thread-per-run", _THREAD_PER_RUN, gpus=2, device=1
)(_runs("thread", _judge_thread))


seed001_gpu1_plain_loop = _experiment(
    "seed001-gpu1-plain-loop",
    """Seed 001: the plain loop on torch.device('cuda:1')

    The same stream and thread every run: the workspaces of the first run are reused, so
    allocated stays flat.""",
    gpus=2,
    device=1,
)(_runs("plain", _judge_plain))
seed001_gpu1_pin_memory = _experiment(
    "seed001-gpu1-pin-memory",
    """Seed 001: a pin-memory DataLoader feeding cuda:1

    Pinned host buffers live in host memory (the CUDA host allocator caches them), not in the
    device's allocator: allocated on cuda:1 stays flat.""",
    gpus=2,
    device=1,
)(_runs("pin-memory", _judge_flat))


@_experiment(
    "census",
    """The census: every live storage once, largest first

    live_tensors() counts storages (views and saved tensors share one), not tensors.""",
)
def census_now(device: int | None) -> Experiment:
    where = _where(device)
    base = torch.zeros(256, 1024, device=where)
    views = [base[i] for i in range(4)]
    census = live_tensors(where)
    mine = [s for s in census if s.data_ptr == base.untyped_storage().data_ptr()]
    checks = (
        Check(
            "a tensor and four views are one storage of 1 MiB",
            len(mine) == 1 and mine[0].nbytes == 1 * MiB and mine[0].tensors == 5,
            f"{plural(len(mine), 'storage')}, {plural(mine[0].tensors if mine else 0, 'tensor')}",
        ),
    )
    rows = tuple(
        (s.device, format_bytes(s.nbytes), s.dtype, "×".join(map(str, s.shape)), str(s.tensors))
        for s in list(census)[:5]
    )
    del views, base
    return Experiment(
        headers=("device", "bytes", "dtype", "shape", "tensors"), rows=rows, checks=checks
    )


def experiments() -> Sequence[tuple[str, Callable[[], Experiment]]]:
    """Every experiment of the demo, in order: (key, function)."""
    return tuple(_EXPERIMENTS)


def run_demo(
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Experiment]:
    """Run the experiments (or ``only`` those keys) and return their results.

    An experiment that fails with an exception becomes a failed check, not a crash.
    Raises ValueError naming an unknown key in ``only`` (and the valid ones).
    """
    keys = [key for key, _ in experiments()]
    if only is not None:
        if isinstance(only, str):
            raise TypeError("only must be a sequence of experiment keys, not a str")
        unknown = [k for k in only if k not in keys]
        if unknown:
            raise ValueError(
                f"only: unknown experiment key {unknown[0]!r}; valid keys: {', '.join(keys)}"
            )
    results = []
    for key, func in experiments():
        if only and key not in only:
            continue
        if progress is not None:
            progress(key)
        try:
            results.append(func())
        except Exception as exc:
            results.append(
                Experiment(
                    key,
                    key,
                    "the experiment raised",
                    checks=(Check("ran without error", False, f"{type(exc).__name__}: {exc}"),),
                )
            )
    return results
