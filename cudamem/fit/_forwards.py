"""What ``cudamem.plan`` sees of a step's module forwards, through global hooks: the order of
the modules' exits with the allocated level and output bytes at each (``ForwardOrder``:
what checkpointing advice reads, with the per-module profile, ``module_costs``), and the
step's peak split into phases (``Phases``: forward, loss and backward, optimizer)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..allocator import backend_base as _backend_base
from ..modules._tree_bytes import distinct_bytes
from ..modules.profile import ModuleProfile
from ..spans.span import close_quiet, open_quiet
from ._terms import ModuleCost
from .memory_plan import ModuleShare

__all__ = [
    "ForwardOrder",
    "Forwards",
    "Phases",
    "fixed_parts",
    "module_costs",
    "module_shares",
    "output_bytes",
]


def output_bytes(value: Any, seen: set[tuple[str, int]], depth: int = 0) -> int:
    """Bytes of the distinct storages of the tensors in ``value``, a module's output: a
    tensor, or dicts, lists and tuples of them nested five deep at most."""
    if isinstance(value, torch.Tensor):
        return distinct_bytes((value,), seen)
    if depth > 4:
        return 0
    if isinstance(value, dict):
        return sum(output_bytes(v, seen, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(output_bytes(v, seen, depth + 1) for v in value)
    return 0


class Forwards:
    """Two global forward hooks that follow how deep the step's module calls are nested,
    outside the backward (a recomputation inside it, under checkpointing, is no forward of
    the step). Subclasses act where a call enters (``_entered``: the depth before it) and
    where it exits (``_exited``: the depth after it)."""

    def __init__(self) -> None:
        self._depth = 0
        self._handles: list[Any] = []

    def _install(self, *more: Any) -> None:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
            *more,
        ]

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._entered(module)
        self._depth += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._depth = max(0, self._depth - 1)
        self._exited(module, output)

    def _entered(self, module: torch.nn.Module) -> None:
        pass

    def _exited(self, module: torch.nn.Module, output: Any) -> None:
        pass


class ForwardOrder(Forwards):
    """The order of the modules' forward exits in one step, the allocated level at each
    exit and the bytes of each output; the top-level modules (roots) that ran."""

    def __init__(self, backend: _backend_base.Backend, device: int) -> None:
        super().__init__()
        self._backend = backend
        self._device = device
        self.entry: int | None = None
        self.exits: dict[int, tuple[int, int, int]] = {}
        self.roots: list[weakref.ref[torch.nn.Module]] = []

    def _allocated(self) -> int:
        return self._backend.counters(self._device)[0]

    def _entered(self, module: torch.nn.Module) -> None:
        if self._depth == 0 and self.entry is None:
            self.entry = self._allocated()

    def _exited(self, module: torch.nn.Module, output: Any) -> None:
        if id(module) not in self.exits:
            out = output_bytes(output, set())
            self.exits[id(module)] = (len(self.exits), self._allocated(), out)
        if self._depth == 0 and all(r() is not module for r in self.roots):
            self.roots.append(weakref.ref(module))

    def __enter__(self) -> ForwardOrder:
        self._install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def named(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """Every module of the roots that ran, named as the module profile names them."""
        for ref in self.roots:
            root = ref()
            if root is None:
                continue
            base = type(root).__name__
            for path, module in root.named_modules():
                yield (f"{base}.{path}" if path else base), module


def module_costs(order: ForwardOrder, profile: ModuleProfile, n: int) -> tuple[ModuleCost, ...]:
    rows = {row.name: row for row in profile.modules}
    out = []
    entry = order.entry or 0
    for name, module in order.named():
        row = rows.get(name)
        exit_ = order.exits.get(id(module))
        if row is None or exit_ is None:
            continue
        position, allocated, output = exit_
        out.append(
            ModuleCost(
                name=name,
                type_name=row.type_name,
                depth=row.depth,
                order=position,
                kept=row.kept.mean / n,
                output=output / n,
                upto=(allocated - entry) / n,
                backward_peak=row.backward_peak.mean / n,
            )
        )
    out.sort(key=lambda m: m.order)
    return tuple(out)


def module_shares(profile: ModuleProfile, n: int) -> tuple[ModuleShare, ...]:
    return tuple(
        ModuleShare(row.name, row.type_name, row.depth, row.kept.mean / n, row.self_kept.mean / n)
        for row in profile.modules
        if row.kept.mean > 0
    )


def fixed_parts(profile: ModuleProfile) -> tuple[tuple[str, int], ...]:
    roots = [row for row in profile.modules if row.depth == 0]
    parts = (
        ("parameters", sum(r.params for r in roots)),
        ("buffers", sum(r.buffers for r in roots)),
        ("optimizer state", sum(r.optimizer for r in roots)),
        ("gradients", sum(r.grads for r in roots)),
    )
    return tuple(p for p in parts if p[1] > 0)


class Phases(Forwards):
    """A step's peak split where each outermost module forward returns and where an
    optimizer's ``step`` begins: a quiet span per phase (nested in the probe's), cut by the
    global forward hooks and a global optimizer step pre-hook while the step runs (forward,
    loss and backward, optimizer). Recomputation inside the backward (checkpointing) cuts
    nothing."""

    def __init__(self, device: int) -> None:
        super().__init__()
        self._device = device
        self.peaks: list[int] = []
        self._span = open_quiet("cudamem.plan phase", device)
        self._install(register_optimizer_step_pre_hook(self._optimizer))

    def _exited(self, module: torch.nn.Module, output: Any) -> None:
        if self._depth == 0:
            self._cut()

    def _optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._depth == 0:
            self._cut()

    def _cut(self) -> None:
        close_quiet(self._span)
        self.peaks.append(self._span.peak_total or 0)
        self._span = open_quiet("cudamem.plan phase", self._device)

    def finish(self, exc: BaseException | None = None) -> tuple[int, ...]:
        """Remove the hooks, close the last phase; the phases' peaks (``()`` when no module
        ran, or the step failed: one phase is the step's own peak)."""
        self._remove()
        close_quiet(self._span, exc)
        if exc is not None or not self.peaks:
            return ()
        self.peaks.append(self._span.peak_total or 0)
        return tuple(self.peaks)
