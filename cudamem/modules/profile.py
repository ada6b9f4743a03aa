"""The per-module memory profile as a frozen value, and the arithmetic that builds it.

``cudamem.modules`` collects one raw record per module per step (forward calls, bytes kept,
peaks, backward figures, times); ``build_profile`` turns those into ``ModuleStats`` rows:
mean and max per step, nested by depth, each sibling group sorted by the bytes its forward
kept (largest first), so the answer to "which layer?" reads from the top.

Every byte figure of a row covers its submodules too (a parent's forward contains its
children's), except ``self_kept``: the row's ``kept`` less its direct submodules' ``kept``
in the same calls, so ``kept`` of a module is exactly ``self_kept`` plus its children's
``kept`` (modules shared by several parents split that way per call).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ..base.args import check_int
from ..base.data import to_data
from ..base.present import Presented, PresentedHtml

__all__ = [
    "RANKINGS",
    "ModuleProfile",
    "ModuleStats",
    "RawModule",
    "Spread",
    "TopModules",
    "build_profile",
]


class Spread(NamedTuple):
    """One figure over the steps a module ran in: its mean and its largest value."""

    mean: float
    max: float


_ZERO = Spread(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class ModuleStats(Presented):
    """One module's row in a ``ModuleProfile``. Bytes are ints (``Spread`` values: mean and
    max per step); times are host seconds (the module's Python and kernel launches; the
    GPU's own time only where its work made the host wait)."""

    #: ``ClassName.path.in.model`` (``GPT2LMHeadModel.transformer.h.0``), as PyTorch's
    #: ``MemTracker`` names modules; the root is its class name.
    name: str
    #: The module's class (``GPT2Block``).
    type_name: str
    #: 0 for the root, 1 for its children, ... (in the profile's tree: see ``parent``).
    depth: int
    #: The nearest ancestor with a row of its own (``None`` for a root): a container that
    #: is never called itself (``nn.ModuleList``) has no row, and its children hang under
    #: its parent.
    parent: str | None
    #: Steps in which the module ran (a forward, a backward or a recomputation).
    steps: int
    #: Forward calls per step (outside backward; more than 1 for a shared layer).
    calls: Spread
    #: Bytes its forward allocated and still held at the forward's exit, summed over the
    #: step's calls: the activations it kept for the backward (its output included).
    kept: Spread
    #: ``kept`` less what its submodules' forwards kept: what its own code kept.
    self_kept: Spread
    #: Highest allocated during a forward call, above the level at that call's entry.
    forward_peak: Spread
    #: Seconds in its forward calls per step.
    forward_time: Spread
    #: Backward passes through the module per step.
    backward_calls: Spread
    #: Allocated at the end of its backward minus at the start (negative: it freed more
    #: activations than its gradients took), summed per step.
    backward_delta: Spread
    #: Highest allocated during its backward, above the level at its start.
    backward_peak: Spread
    #: Seconds in its backward per step (from its output's gradient to its input's).
    backward_time: Spread
    #: Forward calls re-run inside the backward (activation checkpointing) per step.
    recomputes: Spread
    #: Bytes those re-run forwards kept at their exit: memory checkpointing moved from the
    #: forward to the backward.
    recomputed: Spread
    #: Parameter, buffer, gradient and optimizer-state bytes of the module and its
    #: submodules (each storage once in the whole model; the largest value read).
    params: int
    buffers: int
    grads: int
    optimizer: int
    #: Forward calls that raised (all steps).
    raised: int = 0
    notes: tuple[str, ...] = ()
    #: Why the allocator's bytes (kept, peaks, recomputed) were not measured (``'no CUDA
    #: device'``: they are 0 here and mean nothing), or ``None``. Parameter, gradient and
    #: optimizer bytes and times are measured either way.
    unmeasured: str | None = None


#: The rankings that read the allocator's bytes (not measured without a CUDA device).
ALLOCATOR_RANKINGS = frozenset({"self_kept", "kept", "forward_peak", "backward_peak", "recomputed"})


class TopModules(tuple[ModuleStats, ...]):
    """``ModuleProfile.top``'s answer: the rows, largest first (a tuple), and ``reason``:
    why it is empty when nothing was measured to rank by (``None`` otherwise)."""

    reason: str | None

    def __new__(cls, rows: Sequence[ModuleStats] = (), reason: str | None = None) -> TopModules:
        self = super().__new__(cls, rows)
        self.reason = reason
        return self


#: What ``ModuleProfile.top(by=...)`` ranks by.
RANKINGS = (
    "self_kept",
    "kept",
    "forward_peak",
    "backward_peak",
    "recomputed",
    "params",
    "grads",
    "optimizer",
    "forward_time",
    "backward_time",
)


def _rank_value(row: ModuleStats, by: str) -> float:
    value = getattr(row, by)
    return float(value.mean) if isinstance(value, Spread) else float(value)


@dataclass(frozen=True, slots=True)
class ModuleProfile(PresentedHtml):
    """Where a model's memory went, per module: the result of ``cudamem.track_modules``.

    ``modules`` lists every module that ran, depth first, each group of siblings largest
    ``kept`` first; ``top(n)`` names the modules whose own code kept the most.
    """

    #: The rows, depth first (parents before their children).
    modules: tuple[ModuleStats, ...]
    #: Steps profiled (see ``cudamem.track_modules`` for what ends a step).
    steps: int
    #: Why no bytes were measured (``'no CUDA device'``), or ``None``.
    unmeasured: str | None = None
    notes: tuple[str, ...] = ()

    def top(self, n: int = 5, by: str = "self_kept") -> TopModules:
        """The ``n`` modules with the largest ``by`` (mean per step; one of ``RANKINGS``),
        largest first; rows whose figure is 0 are left out.

        Where the allocator's bytes were not measured (no CUDA device) and ``by`` is one of
        them (``kept``, ``self_kept``, peaks, ``recomputed``), the answer is empty and its
        ``reason`` says why, and a ``UserWarning`` at the caller's line says so too;
        ``by='params'`` (or grads, optimizer, times) still ranks."""
        check_int("n", n, minimum=0)
        if by not in RANKINGS:
            raise ValueError(f"by must be one of {', '.join(RANKINGS)}; got {by!r}")
        if self.unmeasured is not None and by in ALLOCATOR_RANKINGS:
            reason = f"{by} not measured ({self.unmeasured}): no module to rank"
            warnings.warn(f"profile.top(by={by!r}): {reason}", UserWarning, stacklevel=2)
            return TopModules((), reason)
        rows = [r for r in self.modules if _rank_value(r, by) > 0]
        rows.sort(key=lambda r: (-_rank_value(r, by), r.depth, r.name))
        return TopModules(rows[:n])

    def module(self, name: str) -> ModuleStats:
        """The row named ``name`` (``KeyError`` naming the closest rows when none is)."""
        for row in self.modules:
            if row.name == name:
                return row
        near = [r.name for r in self.modules if name in r.name or r.name.endswith(name)]
        hint = f"; did you mean {', '.join(near[:3])}" if near else ""
        raise KeyError(f"no module {name!r} in the profile{hint}")

    def __len__(self) -> int:
        return len(self.modules)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data (``cudamem.render.json.to_json`` writes it out)."""
        data: dict[str, Any] = to_data(self)
        return data


# --------------------------------------------------------------------------- analysis

#: The figures of one module in one step, in this order (bytes and nanoseconds, ints).
STEP_FIELDS = (
    "calls",
    "kept",
    "self_kept",
    "forward_peak",
    "forward_ns",
    "backward_calls",
    "backward_delta",
    "backward_peak",
    "backward_ns",
    "recomputes",
    "recomputed",
)


class RawModule(NamedTuple):
    """What collection hands to ``build_profile`` for one module."""

    name: str
    type_name: str
    depth: int
    parent: str | None
    #: One tuple of ``STEP_FIELDS`` per step in which the module ran.
    steps: tuple[tuple[int, ...], ...]
    raised: int = 0
    notes: tuple[str, ...] = ()


def _spread(values: Sequence[float], scale: float = 1.0) -> Spread:
    if not values:
        return _ZERO
    return Spread(sum(values) / len(values) * scale, max(values) * scale)


def _row(raw: RawModule, state: tuple[int, int, int, int]) -> ModuleStats:
    cols = list(zip(*raw.steps, strict=True)) if raw.steps else [()] * len(STEP_FIELDS)
    f = dict(zip(STEP_FIELDS, cols, strict=True))
    return ModuleStats(
        name=raw.name,
        type_name=raw.type_name,
        depth=raw.depth,
        parent=raw.parent,
        steps=len(raw.steps),
        calls=_spread(f["calls"]),
        kept=_spread(f["kept"]),
        self_kept=_spread(f["self_kept"]),
        forward_peak=_spread(f["forward_peak"]),
        forward_time=_spread(f["forward_ns"], 1e-9),
        backward_calls=_spread(f["backward_calls"]),
        backward_delta=_spread(f["backward_delta"]),
        backward_peak=_spread(f["backward_peak"]),
        backward_time=_spread(f["backward_ns"], 1e-9),
        recomputes=_spread(f["recomputes"]),
        recomputed=_spread(f["recomputed"]),
        params=state[0],
        buffers=state[1],
        grads=state[2],
        optimizer=state[3],
        raised=raw.raised,
        notes=raw.notes,
    )


def build_profile(
    raws: Sequence[RawModule],
    steps: int,
    state: Mapping[str, tuple[int, int, int, int]] | None = None,
    *,
    unmeasured: str | None = None,
    notes: Sequence[str] = (),
) -> ModuleProfile:
    """The profile of modules that ran (or carry a note), depth first, siblings by
    ``kept`` (mean, then peaks, then name)."""
    state = state or {}
    rows = {
        r.name: replace(
            _row(r, tuple(state.get(r.name, (0, 0, 0, 0)))),  # type: ignore[arg-type]
            unmeasured=unmeasured,
        )
        for r in raws
        if r.steps or r.notes or r.raised
    }
    # A row's parent is its nearest ancestor that ran: a container that is never called
    # itself (``nn.ModuleList``) passes its children up to its own parent.
    structural = {r.name: r.parent for r in raws}
    children: dict[str | None, list[ModuleStats]] = {}
    for row in rows.values():
        parent = row.parent
        while parent is not None and parent not in rows:
            parent = structural.get(parent)
        children.setdefault(parent, []).append(replace(row, parent=parent))

    def order(row: ModuleStats) -> tuple[float, float, float, str]:
        return (-row.kept.mean, -row.backward_peak.max, -row.forward_peak.max, row.name)

    out: list[ModuleStats] = []
    pending = [(row, 0) for row in sorted(children.get(None, []), key=order)[::-1]]
    while pending:
        row, depth = pending.pop()
        out.append(replace(row, depth=depth))
        kids = sorted(children.get(row.name, []), key=order)[::-1]
        pending.extend((kid, depth + 1) for kid in kids)
    return ModuleProfile(tuple(out), steps, unmeasured, tuple(notes))
