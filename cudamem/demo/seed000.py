"""Seed 000's experiments: a span's life cycle, who holds a tensor, losses kept with their graphs,
the per-module profile.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..allocator import backend as _backend
from ..base.format import format_bytes, plural
from ..holders.census import live_storage_keys
from ..holders.finder import who_holds
from ..host.copy import to_host
from ..modules.profiler import track_modules
from ..scalars.logger import ScalarLogger
from ..spans.span import MemorySpan, track
from .registry import Check, Experiment, MiB, _cuda, _expect, _experiment, _span_row, _where


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
