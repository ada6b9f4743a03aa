"""Which steps ``cudamem.plan`` runs, and the line through them: plain numbers and rules, no
torch. ``search`` calls ``run(size, role, profile)`` for each step it wants and reads the
``Probe`` it returns; ``planner.py`` calls it, and ``_runner.py`` runs the steps on the
device.

The rules, each a constant below:

* **Resolved.** The line's per-sample part at the largest fitted step must be at least
  ``RESOLVED_SHARE`` (10 %) of that step's peak. Below it the probes are the fixed part
  (weights, gradients, optimizer state) plus noise: a 6-layer MLP's 16 KiB a sample at
  batch 16 was 0.01 % of its peak, and extrapolating it named a batch 36,000x the probes'
  that ran out of memory. Unresolved, the probes grow geometrically: ``GROWTH`` (16) times
  the largest, and never more than ``SAFE_SHARE`` (half) of the memory can be reached:
  for a line with a non-negative fixed part, the peak at ``k`` times the batch is at most
  ``k`` times the peak measured, whatever the slope.
* **The check.** A step at twice the largest probe tests the line (within
  ``LINEAR_TOLERANCE``). One that lands off it becomes the first point of a new line from
  larger steps (small batches are where cuDNN picks other algorithms and workspaces, where
  tensors live in the allocator's small pool); the plan refuses only when the check of
  that new line fails too.
* **Confirmed.** Before an answer past the largest step run, a step runs at that answer
  (``largest(margin=0)`` for the memory usable now) and the line is refitted through it:
  the answer then comes from a line that reaches it. While the refitted line says more than
  ``CONFIRM_CLOSE`` (1 %) more fits, another runs there. One that runs out of memory is
  recorded and the next runs ``STEP_DOWN`` (5 %) lower (or lower still where the line,
  with the allowance the failed step proved too small, says so); once one ran and one
  failed more than ``BRACKET`` (2.5 %) apart, the next runs halfway between.
* **Room for the request that failed.** A step that ran out of memory says how much: what
  it had reserved when it failed (the allocator had given back its cache) and the request
  that failed (the message's "Tried to allocate"). Their parts beyond the line's fixed part
  grown with the batch, the batch that leaves room for that request (``_room``) bounds the
  answer: the next step runs no higher than ``AIM_BELOW`` (1 %) under it, and a step that
  ran within ``BRACKET`` of it ends the search. After the first failure the next step
  aims there, even above the 5 % step down (ResNet-50's room, 0.5 % over its true
  largest, ends the search in one step where the step down took two); after a second
  failure the step down applies again. On the zoo the failed request was often
  one large tensor (an LM head's output, 16 to 23 GiB) with 18 GiB free, and that batch
  lay within 0.7 % of the true largest from eight of nine failures; the UNet's first
  failure (+6.3 %, a cache fragmented by many mid-sized tensors) is why a room is aimed
  at once only. Until one
  fails, each aims at the prior allowance: a step that ran bounds the allowance from
  above only, and aiming at that bound asks nothing new (a vision transformer stopped
  2.7 % short that way). ``MAX_CONFIRMS`` (6) at most, within ``MAX_STEPS``. The last
  one the limits allow, while every one before it ran out of memory, aims at the ceiling
  instead: what the largest probe or check reserved over what it allocated, with memory
  to spare (``_ceiling``). That bounds the allowance from above on all nine models of
  ``benchmarks/fit.py``'s zoo (ConvNeXt 32 % for the 0.4 % it needs, the LSTM 16 % for
  14 %), so the plan ends on a step that ran near the limit rather than on its probes.
* **Required, not reserved.** Near the limit the allocator frees its cached blocks and
  retries a failed ``cudaMalloc`` before it raises (``release_cached_blocks`` in
  ``c10/cuda/CUDACachingAllocator.cpp``): what limits the batch is the peak allocated plus
  the free space stranded in segments that still hold live blocks, plus the failing
  request, not the reserved peak of a step that had memory to spare (ResNet-50's 1.21x
  at batch 16 named 18 % too small a batch). The allowance (``_allowance``): ``ALLOWANCE``
  (1 %) of the peak allocated plus ``HEADROOM`` (64 MiB) until a confirming step ran;
  then the most the confirming steps that ran allow (each fit), never below what one that
  ran out of memory needed more than: the upper end, because another budget's answer
  (``largest_for``) must run there too, and the share it needs there is not the whole
  card's: on an H100 a decoder LM needs a tenth of a percent, a UNet with BatchNorm 8.7 %
  and an LSTM 12 % at the whole card and about the same at 40 % of it, but on an H200 the
  UNet needs 6.5 % at the whole card and 8.8 % at 40 %, and the checkpointed transformer
  5.0 % and 6.8 %.
* ``MAX_STEPS`` (10) step executions at most, the warm-up included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..base.format import plural
from ._terms import ALLOWANCE, HEADROOM, Line, Point, fit, largest_under, relative_error, required
from .memory_plan import LINEAR_TOLERANCE, LineCheck, Probe

__all__ = [
    "AIM_AT_ROOM",
    "AIM_BELOW",
    "BRACKET",
    "CONFIRM_CLOSE",
    "GROWTH",
    "MAX_CONFIRMS",
    "MAX_STEPS",
    "READ_ROOM",
    "RESOLVED_SHARE",
    "SAFE_SHARE",
    "STEP_DOWN",
    "Lines",
    "Outcome",
    "Size",
    "fit_lines",
    "search",
    "variable_share",
]

RESOLVED_SHARE = 0.10
GROWTH = 16
SAFE_SHARE = 0.5
MAX_STEPS = 10
MAX_CONFIRMS = 6
CONFIRM_CLOSE = 0.01
STEP_DOWN = 0.05
BRACKET = 0.025
AIM_BELOW = 0.01
#: Whether a failed step's request bounds the next (``_room``); off, the search before the
#: room was read (``benchmarks/fit_replay.py``'s "no room read" variant replays it).
READ_ROOM = True
#: Whether the step after the first failure aims under its room even above the 5 % step
#: down (``_after_failure``); off, the search of the 712b113 zoo record (the room only
#: lowered it).
AIM_AT_ROOM = True


class Size(NamedTuple):
    n: int
    length: int | None


class Lines(NamedTuple):
    """The fitted peaks: allocated, reserved, and one line per phase of the step (``()``
    when the steps' phases differ in number)."""

    allocated: Line
    reserved: Line
    phases: tuple[Line, ...]

    def at(self, n: int, length: int = 1) -> float:
        """The predicted peak allocated: the largest phase's where phases were fitted."""
        if self.phases:
            return max(p.at(n, length) for p in self.phases)
        return self.allocated.at(n, length)


def _points(steps: Sequence[Probe], reserved: bool) -> list[Point]:
    return [
        Point(p.n, p.length or 1, (p.reserved if reserved else p.allocated) or 0) for p in steps
    ]


def _phase_lines(steps: Sequence[Probe], terms: Sequence[str]) -> tuple[Line, ...]:
    counts = {len(p.phases) for p in steps}
    if len(counts) != 1 or counts == {0}:
        return ()
    (count,) = counts
    return tuple(
        fit([Point(p.n, p.length or 1, p.phases[k]) for p in steps], terms) for k in range(count)
    )


def fit_lines(steps: Sequence[Probe], terms: Sequence[str]) -> Lines:
    """Allocated, reserved and phase lines through ``steps``; the reserved line through the
    steps that had memory to spare (not the confirming steps, which ran at the limit).

    Raises:
        ValueError: too few steps, or steps that do not determine the terms.
    """
    spare = [p for p in steps if p.role != "confirm"]
    return Lines(
        fit(_points(steps, False), terms),
        fit(_points(spare if len(spare) >= len(terms) else steps, True), terms),
        _phase_lines(steps, terms),
    )


def variable_share(lines: Lines, step: Probe) -> float:
    """The per-sample part of the peak at ``step``'s size, as a share of it: the largest
    over the step's line and its phases' (a phase that grows is resolved even while a flat
    one, the optimizer's step, holds the peak); ``<= 0`` when none grows."""
    at = step.length or 1
    shares = []
    for line in (lines.allocated, *lines.phases):
        peak = line.at(step.n, at)
        shares.append((peak - line.at(0, at)) / peak if peak > 0 else 0.0)
    return max(shares)


@dataclass
class Outcome:
    """What the search ran and concluded (mutable while it runs; ``planner.py`` turns it into
    the frozen ``MemoryPlan``)."""

    #: The steps the line runs through.
    fitted: list[Probe] = field(default_factory=list)
    lines: Lines | None = None
    #: The last check's verdict, ``None`` when no check ran (or it ran out of memory).
    check: LineCheck | None = None
    #: Checks that landed off the line and led to larger probes (their batch sizes).
    recovered: list[int] = field(default_factory=list)
    #: Whether the per-sample part was resolved (``RESOLVED_SHARE``) at the largest step.
    resolved: bool = False
    allowance: float = ALLOWANCE
    notes: list[str] = field(default_factory=list)


Run = Callable[[Size, str, bool], "Probe | None"]


class _Steps:
    """``run`` with the step budget: ``None`` once ``MAX_STEPS`` steps ran."""

    def __init__(self, run: Run, limit: int) -> None:
        self._run = run
        self.limit = limit
        self.count = 0
        self.ran: list[Probe] = []

    def __call__(self, size: Size, role: str, profile: bool = False) -> Probe | None:
        if self.count >= self.limit:
            return None
        self.count += 1
        probe = self._run(size, role, profile)
        if probe is not None:
            self.ran.append(probe)
        return probe

    @property
    def largest_ran(self) -> int:
        return max((p.n for p in self.ran if not p.oom), default=0)

    @property
    def smallest_oom(self) -> int | None:
        return min((p.n for p in self.ran if p.oom), default=None)


def _grown(
    step: Probe, lines: Lines, available: int | None, factor: int, most: int | None
) -> int | None:
    """The next probe's size, ``factor`` times ``step``'s at most, its peak within
    ``SAFE_SHARE`` of ``available`` by the line and by the bound ``k x`` the peak measured,
    and at most ``most``; ``None`` when not even twice ``step``'s size stays within it."""
    k = factor
    if available is not None and step.allocated:
        k = min(k, math.floor(SAFE_SHARE * available / step.allocated))
    n = step.n * k
    if available is not None:
        cap = SAFE_SHARE * available
        by_line = largest_under(lambda m: lines.at(m, step.length or 1), cap)
        n = min(n, max(by_line, 0))
    if most is not None:
        n = min(n, most)
    return n if n >= 2 * step.n else None


def _line_check(lines: Lines, fitted: Sequence[Probe], c: Probe) -> LineCheck:
    at = c.length or 1
    predicted = lines.at(c.n, at)
    largest = max(fitted, key=lambda p: (p.n, p.length or 0))
    ratio = 1.0 + _kept_share(largest)
    predicted_reserved = max(predicted, min(predicted * ratio, lines.reserved.at(c.n, at)))
    error = relative_error(predicted, c.allocated or 0)
    return LineCheck(
        c.n,
        c.length,
        round(predicted),
        c.allocated or 0,
        error,
        round(predicted_reserved),
        c.reserved or 0,
        relative_error(predicted_reserved, c.reserved or 0),
        error <= LINEAR_TOLERANCE,
    )


def search(
    run: Run,
    schedule: Sequence[Size],
    terms: Sequence[str],
    check: Size | None,
    memory: Callable[[], int | None],
    *,
    adaptive: bool,
    confirm: bool,
    max_batch: int | None = None,
    max_steps: int = MAX_STEPS,
) -> Outcome:
    """Run the warm-up and the probes of ``schedule``, grow the probes until the per-sample
    part is resolved, check the line (``check``: the first check's size, ``None``: no
    check), recover from a check off the line with larger probes, and confirm the answer
    for the bytes ``memory()`` reads. ``adaptive=False`` (a plan with a length axis) runs the
    schedule and one check only; ``confirm=False`` skips the confirming steps. No step
    past the probes runs at a batch larger than ``max_batch``."""
    out = Outcome()
    steps = _Steps(run, max_steps)
    warm = steps(schedule[0], "warm-up")
    if warm is None or warm.oom:
        out.notes.append(f"the warm-up at batch {schedule[0].n} ran out of memory: nothing fitted")
        return out
    profiled = max(schedule, key=lambda s: (s.n, s.length or 0))
    for size in schedule:
        probe = steps(size, "probe", size == profiled)
        if probe is None:
            break
        if probe.oom:
            out.notes.append(f"batch {probe.n} ran out of memory: the larger probes were skipped")
            break
        out.fitted.append(probe)
    if len(out.fitted) < len(terms):
        out.notes.append(
            f"{plural(len(out.fitted), 'probe')} ran, {len(terms)} are needed to fit "
            f"{', '.join(terms)}"
        )
        return out
    try:
        out.lines = fit_lines(out.fitted, terms)
    except ValueError as exc:
        out.notes.append(str(exc))
        return out
    if steps.smallest_oom is not None:
        return out
    _resolve_and_check(out, steps, terms, check, memory(), adaptive, max_batch)
    # check=False (or a check that ran out of memory): the confirming steps test the line;
    # an unresolved line is not worth confirming (its answer is noise): largest() then
    # names only batches that ran
    tested = out.check is None or out.check.linear
    if confirm and adaptive and out.lines is not None and out.resolved and tested:
        available = memory()
        if available is not None:
            _confirm(out, steps, terms, available, max_batch)
    if steps.count >= steps.limit:
        out.notes.append(f"the plan stopped at {max_steps} step executions (its limit)")
    return out


def _resolve_and_check(
    out: Outcome,
    steps: _Steps,
    terms: Sequence[str],
    check: Size | None,
    available: int | None,
    adaptive: bool,
    most: int | None,
) -> None:
    checks_left = 2 if adaptive else 1
    while out.lines is not None:
        largest = out.fitted[-1]
        share = variable_share(out.lines, largest)
        out.resolved = share >= RESOLVED_SHARE
        if adaptive and not out.resolved:
            n = _grown(largest, out.lines, available, GROWTH, most)
            probe = None if n is None else steps(Size(n, None), "probe", True)
            if probe is None or probe.oom:
                what = (
                    "no larger probe stays within half the memory and max_batch"
                    if n is None
                    else f"batch {n} ran out of memory"
                    if probe is not None
                    else "the step limit was reached"
                )
                out.notes.append(
                    f"the per-sample bytes are {share:.2%} of the peak at batch {largest.n}, "
                    f"under the {RESOLVED_SHARE:.0%} that resolves them, and {what}: "
                    "answers past the steps run are not to be trusted"
                )
                return
            out.fitted = [largest, probe]
            out.lines = fit_lines(out.fitted, terms)
            check = Size(2 * probe.n, None) if check is not None else None
            continue
        if check is None or checks_left == 0:
            return
        if most is not None and adaptive:
            check = Size(min(check.n, most), check.length)
        if check.n <= largest.n and adaptive:
            out.notes.append(f"no check: max_batch={most} leaves no larger batch to test")
            return
        c = steps(check, "check")
        checks_left -= 1
        if c is None:
            return
        if c.oom:
            out.notes.append(f"the check at batch {c.n} ran out of memory: the line is not tested")
            return
        out.check = _line_check(out.lines, out.fitted, c)
        if out.check.linear:
            out.fitted.append(c)
            out.lines = fit_lines(out.fitted, terms)
            return
        if checks_left == 0:
            return
        # Off the line: larger probes, from the check on, before any refusal.
        n = _grown(c, out.lines, available, 2, most)
        probe = None if n is None else steps(Size(n, None), "probe", True)
        if probe is None or probe.oom:
            return
        out.recovered.append(c.n)
        out.fitted = [c, probe]
        out.lines = fit_lines(out.fitted, terms)
        check = Size(2 * probe.n, None)


def _required_by(lines: Lines, allowance: float) -> Callable[[int], float]:
    return lambda n: required(lines.at(n), allowance)


def _confirm(
    out: Outcome, steps: _Steps, terms: Sequence[str], available: int, most: int | None
) -> None:
    """Confirming steps: at the line's answer for the prior allowance (never more than the
    steps that ran allow); after one that ran out of memory, under its room or
    ``STEP_DOWN`` lower (``_after_failure``; the last
    one the limits allow, while none ran, at the ``_ceiling``); once one ran and one failed
    more than ``BRACKET`` apart, halfway between."""
    assert out.lines is not None
    for k in range(MAX_CONFIRMS):
        last = k == MAX_CONFIRMS - 1 or steps.count == steps.limit - 1
        oom = steps.smallest_oom
        ran = steps.largest_ran
        confirms = [p for p in steps.ran if p.role == "confirm"]
        bound = _bound(out.lines, steps.ran, available - HEADROOM)
        if oom is not None and any(not p.oom for p in confirms):
            # the smaller of the step that failed and the room its request needed
            top = oom if bound is None else min(oom, bound)
            if top - ran <= max(1, BRACKET * top):
                return
            target = (ran + top) // 2
            if top < oom:
                target = max(target, math.floor(top * (1 - AIM_BELOW)))
        else:
            # Steps that ran bound the allowance from above only: aim at the prior within
            # that bound, so that the next step tests more than the last one proved.
            aim = out.allowance if oom is not None else min(ALLOWANCE, out.allowance)
            if oom is not None and last:
                aim = max(aim, _ceiling(steps.ran))
            target = largest_under(_required_by(out.lines, aim), available)
            if oom is not None:
                target = min(target, _after_failure(out.lines, steps.ran, oom, available), oom - 1)
            if bound is not None:
                target = min(target, math.floor(bound * (1 - AIM_BELOW)))
            if most is not None:
                target = min(target, most)
            if target <= ran * (1 + CONFIRM_CLOSE):
                return
        c = steps(Size(target, None), "confirm")
        if c is None:
            return
        if not c.oom:
            out.fitted.append(c)
            out.lines = fit_lines(out.fitted, terms)
        out.allowance = _allowance(out.lines, steps.ran, available)


def _after_failure(lines: Lines, ran: Sequence[Probe], oom: int, available: int) -> int:
    """Where the next step aims after the step at batch ``oom`` ran out of memory while no
    confirming step ran: after the first failure, ``AIM_BELOW`` under the batch that
    leaves room for its request (``_room``) where the step says what it asked for and that
    batch is smaller; otherwise ``STEP_DOWN`` lower (a room that failed once is not aimed
    at again: the UNet's first was 6.3 % too high)."""
    failed = [p for p in ran if p.oom]
    last = next(p for p in failed if p.n == oom)
    room = _room(last, lines.allocated.fixed, available - HEADROOM) if READ_ROOM else None
    if AIM_AT_ROOM and len(failed) == 1 and room is not None and room < oom:
        return math.floor(room * (1 - AIM_BELOW))
    return math.floor(oom * (1 - STEP_DOWN))


def _room(step: Probe, fixed: float, usable: int) -> float | None:
    """The batch at which ``step``, a step that ran out of memory, would have had room for
    the request that failed: what it had reserved when it failed and that request, their
    parts beyond ``fixed`` grown in proportion to the batch, fill ``usable``. ``None``
    where the step did not fail or either is unknown."""
    if not step.oom or step.oom_reserved is None or not step.oom_requested:
        return None
    fixed = min(max(0.0, fixed), float(step.oom_reserved))
    if usable <= fixed:
        return None
    return step.n * (usable - fixed) / (step.oom_reserved + step.oom_requested - fixed)


def _bound(lines: Lines, ran: Sequence[Probe], usable: int) -> int | None:
    """The smallest ``_room`` of the confirming steps that ran out of memory (``None``
    where none says, or ``READ_ROOM`` is off): no larger batch is worth a step."""
    if not READ_ROOM:
        return None
    fixed = lines.allocated.fixed
    rooms = [_room(p, fixed, usable) for p in ran if p.role == "confirm"]
    known = [r for r in rooms if r is not None]
    return math.floor(min(known)) if known else None


def _kept_share(step: Probe) -> float:
    """What ``step`` reserved beyond what it allocated, a share of the latter (0 where it
    reserved no more, or either is unknown)."""
    if not step.reserved or not step.allocated:
        return 0.0
    return max(0.0, step.reserved / step.allocated - 1.0)


def _ceiling(ran: Sequence[Probe]) -> float:
    """What the largest probe or check that ran kept reserved beyond what it allocated
    (``_kept_share``; 0 when none ran): with memory to spare the allocator keeps cached what
    it could give back under pressure, so this bounds from above what it cannot. The
    largest, because at the smallest batches workspaces and the 2 MiB segments dominate what
    is reserved (ResNet-50 reserves 2.6x what it allocates at batch 4, 1.14x at 16)."""
    spare = [p for p in ran if p.role in ("probe", "check") and not p.oom]
    return _kept_share(max(spare, key=lambda p: p.n)) if spare else 0.0


def _allowance(lines: Lines, ran: Sequence[Probe], available: int) -> float:
    """The share of the peak the allocator could not give back at this card's limit, from
    the confirming steps: the most that lets every one that ran fit (in ``available``, and
    in what it reserved where the allocator never freed its cache), never less than what
    the one that ran out of memory needed more than; ``ALLOWANCE`` until a confirming step
    ran, at least what the failed ones needed. The upper end, not what fits a failed
    step's room: the share a budget of 40 % needs is not the whole card's (an H200's UNet
    6.5 % there, 8.8 % at 40 %), and the room's allowance named a batch that ran out of
    memory under that cap."""
    usable = available - HEADROOM
    confirms = [p for p in ran if p.role == "confirm"]
    above = [usable / lines.at(p.n) - 1.0 for p in confirms if not p.oom] + [
        p.reserved / p.allocated - 1.0
        for p in confirms
        if not p.oom and not p.retries and p.reserved and p.allocated and p.reserved >= p.allocated
    ]
    below = [usable / lines.at(p.n) - 1.0 for p in confirms if p.oom]
    low = max(below, default=None)
    if not above:
        return ALLOWANCE if low is None else max(ALLOWANCE, low)
    return max(0.0, min(above), low or 0.0)
