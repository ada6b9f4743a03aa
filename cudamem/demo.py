"""The seeds' experiments, reproduced through cudamem: collection only, no printing.

Each experiment returns a frozen ``Experiment`` (a table, a one-line explanation and
PASS/FAIL checks); ``python -m cudamem demo`` renders them. Experiments that need a GPU are
returned as skipped on a machine without one.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _backend
from .render.text import format_bytes
from .span import MemorySpan, track

__all__ = ["Check", "Experiment", "experiments", "run_demo"]

MiB = 1024**2


@dataclass(frozen=True, slots=True)
class Check:
    """One PASS/FAIL line of the demo."""

    name: str
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Experiment:
    """One reproduced experiment: what it shows, its table and its checks."""

    key: str
    title: str
    explanation: str
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    checks: tuple[Check, ...] = ()
    #: Why the experiment did not run (no GPU), or None when it ran.
    skipped: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        """True when it ran and every check passed."""
        return self.skipped is None and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "key": self.key,
            "title": self.title,
            "explanation": self.explanation,
            "headers": list(self.headers),
            "rows": [list(r) for r in self.rows],
            "checks": [c.to_dict() for c in self.checks],
            "skipped": self.skipped,
            "notes": list(self.notes),
        }


def _where(device: int | None) -> str:
    """Where the experiment's tensors live: the GPU, else the CPU."""
    return f"cuda:{device}" if device is not None else "cpu"


def _gpu() -> int | None:
    return 0 if _backend.get().device_count() > 0 else None


def _span_row(span: MemorySpan, device: int) -> tuple[str, ...]:
    d = span.device(device)
    return (
        span.name,
        format_bytes(d.allocated_delta, signed=True),
        format_bytes(d.reserved_delta, signed=True),
        format_bytes(d.after.allocated),
        format_bytes(d.after.reserved),
    )


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


def seed000_lifecycle() -> Experiment:
    """Seed 000: a 256 MiB tensor through create, del-while-listed, clear, empty_cache."""
    key, title = "seed000-256mib", "Seed 000: a 256 MiB tensor, del, list.clear() and empty_cache()"
    explanation = (
        "del removes a name, not the tensor: while a list holds it nothing is freed; "
        "clearing the list frees the allocation, and only empty_cache() returns the cache."
    )
    device = _gpu()
    if device is None:
        return Experiment(key, title, explanation, skipped="needs a CUDA GPU")
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
    expected = [
        (256 * MiB, 256 * MiB),
        (0, 0),
        (0, 0),
        (-256 * MiB, 0),
        (0, -256 * MiB),
    ]
    checks = tuple(
        _expect(sp.name, sp, device, a, r) for sp, (a, r) in zip(spans, expected, strict=True)
    )
    return Experiment(
        key,
        title,
        explanation,
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


def _census_bytes(device_type: str) -> int:
    from .census import live_storage_keys

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


def seed000_losses() -> Experiment:
    """Seed 000: what ten logged losses and outputs keep alive, and the fixes."""
    from .holders import who_holds
    from .host import to_host
    from .scalars import ScalarLogger

    key = "seed000-losses"
    title = "Seed 000: ten losses of sigmoid(x * 2).mean() kept as tensors, numbers, outputs"
    explanation = (
        "A loss tensor drags its autograd graph along (4 MiB of saved sigmoid output each); "
        "detach() keeps the output's storage on the device; numbers and host copies keep nothing."
    )
    device = _gpu()
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
        key,
        title,
        explanation,
        headers=("what is kept", f"bytes kept ({measured})"),
        rows=tuple(rows),
        checks=tuple(checks),
        notes=notes,
    )


def seed000_who_holds() -> Experiment:
    """Seed 000: ``del x`` while a list holds it; who_holds names the list."""
    from .holders import who_holds

    key = "seed000-who-holds"
    title = "Seed 000: del x, yet something still holds it"
    explanation = "who_holds() names every path that keeps the storage alive, aliases included."
    device = _gpu()
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
    return Experiment(key, title, explanation, ("path", "via", "root"), rows, checks)


_SEED001_SCRIPT = r"""
import gc, json, sys, torch, cudamem
from cudamem.ledger import machine_status
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
       "contexts_before": cudamem.explain().to_dict()["devices"]}
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


def seed001_context() -> Experiment:
    """Seed 001: a 4 MiB tensor makes nvidia-smi jump by ~0.6 GiB (the context)."""
    import json
    import subprocess
    import sys

    key = "seed001-context"
    title = "Seed 001: nvidia-smi +1.2 GB for a 4 MiB tensor; empty_cache frees only 20 MiB"
    explanation = (
        "The jump is the CUDA context (never freed before exit); the 4 MiB tensor sits in a "
        "20 MiB segment, which is all empty_cache() can return. Run in a fresh process."
    )
    device = _gpu()
    if device is None:
        return Experiment(key, title, explanation, skipped="needs a CUDA GPU")
    proc = subprocess.run(
        [sys.executable, "-c", _SEED001_SCRIPT, str(device)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return Experiment(
            key,
            title,
            explanation,
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
        Check(
            "the 4 MiB tensor reserves a 20 MiB segment",
            out["reserved"] == 20 * MiB,
            format_bytes(out["reserved"]),
        ),
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
        Check(
            "release() frees the 20 MiB segment",
            out["freed_reserved"] == 20 * MiB,
            format_bytes(out["freed_reserved"]),
        ),
        Check(
            "nvidia-smi drops by 20 MiB (±2 MiB)",
            out["nvml_freed"] is not None and abs(out["nvml_freed"] - 20 * MiB) <= 2 * MiB,
            format_bytes(out["nvml_freed"]),
        ),
        Check(
            "the 80 MiB tensor's segment is freed whole",
            out["freed_80"] == 80 * MiB,
            format_bytes(out["freed_80"]),
        ),
    )
    return Experiment(
        key,
        title,
        explanation,
        ("step", "bytes"),
        rows,
        checks,
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


def seed001_sequential() -> Experiment:
    """Seed 001: training twice in one process, with and without ``del optimizer``."""
    from .release import release

    key = "seed001-sequential"
    title = "Seed 001: sequential training runs, with and without `del optimizer`"
    explanation = (
        "After del model the optimizer still holds the parameters (param_groups) and Adam's "
        "state; release() names it. Deleting it too gives everything back."
    )
    device = _gpu()
    if device is None:
        return Experiment(key, title, explanation, skipped="needs a CUDA GPU")
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
                top = d.remaining[0].holders[0] if d.remaining and d.remaining[0].holders else ""
                rows.append(
                    (
                        f"{'with' if mode == 'del' else 'without'} del optimizer, run {k}",
                        format_bytes(d.still_allocated),
                        format_bytes(d.after.reserved),
                        top,
                    )
                )
                if mode == "keep":
                    remaining_paths = [h for r in d.remaining for h in r.holders]
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
        key,
        title,
        explanation,
        ("run", "still allocated", "reserved", "largest holder"),
        tuple(rows),
        checks,
    )


def census_now() -> Experiment:
    """The live-tensor census of this process (CPU and GPU)."""
    from .census import live_tensors

    key = "census"
    title = "The census: every live storage once, largest first"
    explanation = "live_tensors() counts storages (views and saved tensors share one), not tensors."
    device = _gpu()
    where = _where(device)
    base = torch.zeros(256, 1024, device=where)
    views = [base[i] for i in range(4)]
    census = live_tensors(where)
    mine = [s for s in census if s.data_ptr == base.untyped_storage().data_ptr()]
    checks = (
        Check(
            "a tensor and four views are one storage of 1 MiB",
            len(mine) == 1 and mine[0].nbytes == 1 * MiB and mine[0].tensors == 5,
            f"{len(mine)} storage(s), {mine[0].tensors if mine else 0} tensors",
        ),
    )
    rows = tuple(
        (s.device, format_bytes(s.nbytes), s.dtype, "×".join(map(str, s.shape)), str(s.tensors))
        for s in list(census)[:5]
    )
    del views, base
    return Experiment(
        key, title, explanation, ("device", "bytes", "dtype", "shape", "tensors"), rows, checks
    )


def experiments() -> Sequence[tuple[str, Callable[[], Experiment]]]:
    """Every experiment of the demo, in order: (key, function)."""
    return (
        ("seed000-256mib", seed000_lifecycle),
        ("seed000-who-holds", seed000_who_holds),
        ("seed000-losses", seed000_losses),
        ("seed001-context", seed001_context),
        ("seed001-sequential", seed001_sequential),
        ("census", census_now),
    )


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
