"""The arithmetic of ``cudamem.plan``: peaks as sums of terms in the batch size ``n`` and
the sequence length ``L``, fitted to probe steps; the largest ``n`` under a budget; the
peak with some modules' activations checkpointed. Plain numbers in, plain numbers out: no
torch, no allocator, so every rule here is tested exactly.

A step's peak is modelled as ``a + n * (b + c * L + d * L**2)``: a fixed part (parameters,
gradients, optimizer state, workspaces) and a part per sample that grows with the length
(linear layers and SDPA attention linearly, eager attention quadratically). Which terms
are fitted depends on how many lengths were probed (``terms_for``). The fit solves the
normal equations in exact rational arithmetic (``fractions.Fraction``): with as many probes
as terms that is the exact solve, with more it is least squares, and a singular system
(probes that cannot tell the terms apart) is refused rather than answered with noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple

from ..base.format import plural

__all__ = [
    "ALLOWANCE",
    "CONTAINERS",
    "HEADROOM",
    "TERMS",
    "UNCONFIRMED",
    "Line",
    "ModuleCost",
    "Point",
    "checkpoint_per_sample",
    "choose_checkpoint",
    "fit",
    "largest_under",
    "relative_error",
    "required",
    "terms_for",
]

#: Every term a peak may have, by name: its value at batch ``n`` and length ``L``.
TERMS: dict[str, Callable[[int, int], int]] = {
    "1": lambda n, length: 1,
    "n": lambda n, length: n,
    "n*L": lambda n, length: n * length,
    "n*L^2": lambda n, length: n * length * length,
}


class Point(NamedTuple):
    """One measured peak: ``value`` bytes at batch ``n`` and length ``length`` (1 when the
    plan has no length axis)."""

    n: int
    length: int
    value: int


def terms_for(lengths: int) -> tuple[str, ...]:
    """The terms ``lengths`` distinct probed lengths determine: one length (or none), a
    line in ``n``; two, ``n*L`` and ``n*L^2`` (a sample of length 0 costs nothing); three
    or more, all four."""
    if lengths <= 1:
        return ("1", "n")
    if lengths == 2:
        return ("1", "n*L", "n*L^2")
    return ("1", "n", "n*L", "n*L^2")


class Line(NamedTuple):
    """A fitted peak: ``coefs[i]`` bytes per unit of ``terms[i]``."""

    terms: tuple[str, ...]
    coefs: tuple[float, ...]

    def at(self, n: int, length: int = 1) -> float:
        """The peak at batch ``n`` and length ``length``, in bytes."""
        return sum(c * TERMS[t](n, length) for t, c in zip(self.terms, self.coefs, strict=True))

    @property
    def fixed(self) -> float:
        """The part that does not grow with ``n`` (bytes)."""
        return sum(c for t, c in zip(self.terms, self.coefs, strict=True) if t == "1")

    def per_sample(self, length: int = 1) -> float:
        """Bytes one more sample of length ``length`` adds to the peak."""
        return self.at(1, length) - self.fixed


def _solve(matrix: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """Gauss-Jordan elimination, exact; ``None`` when the system is singular."""
    size = len(rhs)
    rows = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(size):
        pivot = next((r for r in range(col, size) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        lead = rows[col][col]
        rows[col] = [v / lead for v in rows[col]]
        for r in range(size):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[r][size] for r in range(size)]


def fit(points: Sequence[Point], terms: Sequence[str]) -> Line:
    """The least-squares ``Line`` through ``points`` (exact when there are as many points
    as terms).

    Raises:
        ValueError: fewer points than terms, or points that do not determine the terms
            (two probes at the same size, lengths that cannot be told apart).
    """
    terms = tuple(terms)
    if len(points) < len(terms):
        raise ValueError(
            f"{plural(len(terms), 'term')} ({', '.join(terms)}) need at least "
            f"{plural(len(terms), 'probe')}, got {len(points)}"
        )
    design = [[Fraction(TERMS[t](p.n, p.length)) for t in terms] for p in points]
    values = [Fraction(p.value) for p in points]
    k = len(terms)
    normal = [
        [sum((row[i] * row[j] for row in design), Fraction(0)) for j in range(k)] for i in range(k)
    ]
    rhs = [
        sum((row[i] * v for row, v in zip(design, values, strict=True)), Fraction(0))
        for i in range(k)
    ]
    solution = _solve(normal, rhs)
    if solution is None:
        raise ValueError(
            "the probes do not determine the terms "
            f"({', '.join(terms)}): use distinct sizes (and lengths)"
        )
    return Line(terms, tuple(float(c) for c in solution))


def relative_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured`` (0 when both are 0)."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return abs(predicted - measured) / measured


#: The allowance near the limit, before a confirming step measured it: a share of the peak
#: allocated (stranded free space in segments that hold live blocks) ...
ALLOWANCE = 0.01
#: ... plus a fixed amount (the 2 MiB rounding of a large block, a 20 MiB segment for a
#: mid-sized request, kernels loaded on first use).
HEADROOM = 64 << 20
#: The share of a budget ``largest()`` keeps in reserve where no step confirmed it (a
#: smaller budget on this card, a larger card): the allocator's behaviour at another limit
#: is not the one measured. Under a 40 % cap on an H100 the true largest batch of the
#: zoo's models (``benchmarks/fit.py``) stood up to 1.0 % of the budget below what the
#: whole card's plan predicted (0.5 % let two of nine answers run out of memory) and moved
#: by about as much from run to run.
UNCONFIRMED = 0.0125


def required(allocated: float, allowance: float) -> float:
    """The memory a step of peak ``allocated`` needs when memory is short: the allocator
    frees its cached blocks and retries a failed ``cudaMalloc`` before it raises, so what it
    cannot give back is the free space beside live blocks (``allowance``, a share of the
    peak) and ``HEADROOM``."""
    return allocated * (1.0 + allowance) + HEADROOM


def largest_under(peak: Callable[[int], float], budget: float, *, limit: int = 1 << 40) -> int:
    """The largest ``n >= 1`` with ``peak(n) <= budget`` for a ``peak`` that never falls as
    ``n`` grows; 0 when not even ``n = 1`` fits; ``limit`` when everything up to it does."""
    if peak(1) > budget:
        return 0
    lo, hi = 1, 2
    while hi < limit and peak(hi) <= budget:
        lo, hi = hi, hi * 2
    if hi >= limit:
        if peak(limit) <= budget:
            return limit
        hi = limit
    while hi - lo > 1:  # peak(lo) fits, peak(hi) does not
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- checkpointing


class ModuleCost(NamedTuple):
    """What one module's forward kept on the profiled probe, per sample (bytes; floats).

    ``upto`` is allocated at its forward's exit minus at the model's forward entry: every
    activation alive when it returned, its own and those of every module before it.
    """

    name: str
    type_name: str
    depth: int
    #: Position of its first forward exit in the step (0 first).
    order: int
    kept: float
    output: float
    upto: float
    #: Highest allocated during its backward above the level at its start.
    backward_peak: float

    @property
    def saving(self) -> float:
        """What checkpointing it saves: its kept activations less its output."""
        return max(0.0, self.kept - self.output)


def checkpoint_per_sample(per_sample: float, chosen: Sequence[ModuleCost]) -> float:
    """The per-sample peak with ``chosen`` checkpointed, from the measured ``per_sample``.

    Two places may hold the peak then. Where it was (the end of the forward, the loss):
    lower by every chosen module's saving. Or inside the backward of a chosen module: the
    activations alive at its exit (``upto``) less what the chosen modules up to it saved,
    plus its recomputed activations and its backward's own rise, which restore the level
    that module had without checkpointing.
    """
    if not chosen:
        return per_sample
    ordered = sorted(chosen, key=lambda m: m.order)
    total = sum(m.saving for m in ordered)
    best = per_sample - total
    saved_before = 0.0
    for m in ordered:
        inside = m.upto - saved_before + m.backward_peak
        best = max(best, inside)
        saved_before += m.saving
    return best


#: Module types that only hold others: their rows are whole stages, not blocks to wrap.
CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})


def choose_checkpoint(
    costs: Sequence[ModuleCost], per_sample: float, target: float
) -> tuple[ModuleCost, ...]:
    """Modules to checkpoint so that the per-sample peak falls to ``target`` or as low as
    checkpointing can take it: the repeated blocks (the module type with the largest total
    saving among types that occur at least twice at one depth below the root; containers
    such as ``nn.Sequential`` are stages, not blocks, and left out), largest
    saving first, as few as needed. ``()`` when nothing repeats or nothing is saved."""
    groups: dict[tuple[str, int], list[ModuleCost]] = {}
    for m in costs:
        if m.depth >= 1 and m.saving > 0 and m.type_name not in CONTAINERS:
            groups.setdefault((m.type_name, m.depth), []).append(m)
    repeated = [g for g in groups.values() if len(g) >= 2]
    if not repeated:
        return ()
    group = max(repeated, key=lambda g: (sum(m.saving for m in g), -g[0].depth))
    ranked = sorted(group, key=lambda m: (-m.saving, m.order))
    chosen: list[ModuleCost] = []
    best: tuple[ModuleCost, ...] = ()
    best_peak = per_sample
    for m in ranked:
        chosen.append(m)
        peak = checkpoint_per_sample(per_sample, chosen)
        if peak < best_peak:
            best, best_peak = tuple(chosen), peak
        if peak <= target:
            return tuple(chosen)
    return best
