"""The rules of ``cudamem.fit._steps`` in plain numbers: a ``run`` that returns the peaks
of a made-up step and runs out of memory past a made-up card, no torch, no allocator."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cudamem.fit import _steps
from cudamem.fit._steps import (
    AIM_BELOW,
    BRACKET,
    GROWTH,
    MAX_STEPS,
    RESOLVED_SHARE,
    STEP_DOWN,
    Size,
    fit_lines,
    search,
    variable_share,
)
from cudamem.fit._terms import ALLOWANCE, required, terms_for
from cudamem.fit.memory_plan import Probe

MiB = 1 << 20
GiB = 1 << 30
TERMS = terms_for(1)


def failed(
    n: int, role: str, error: str, retries: int, allocated: int, reserved: int, asked: int | None
) -> Probe:
    """A step at batch ``n`` that ran out of memory with ``allocated`` and ``reserved`` bytes,
    asking for ``asked`` more (``None``: its message does not say)."""
    return Probe(
        n,
        None,
        role,
        None,
        None,
        0,
        0.0,
        True,
        error,
        retries,
        oom_allocated=allocated,
        oom_reserved=reserved,
        oom_requested=asked,
    )


class Card:
    """Steps of peak ``peak(n)`` on a card of ``memory`` bytes that needs ``stranded`` more
    than it allocates at the limit."""

    def __init__(
        self, peak: Callable[[int], int], memory: int, stranded: float = 0.0, retries: int = 0
    ):
        self.peak, self.memory, self.stranded, self.retries = peak, memory, stranded, retries
        self.sizes: list[int] = []

    def __call__(self, size: Size, role: str, profile: bool) -> Probe:
        n = size.n
        self.sizes.append(n)
        peak = self.peak(n)
        if peak * (1 + self.stranded) > self.memory:
            reserved = round(GiB * (1 + self.stranded))
            return failed(n, role, "out of memory", self.retries, GiB, reserved, None)
        reserved = round(peak * (1 + self.stranded))
        return Probe(n, None, role, peak, reserved, 0, 0.0, False, None, self.retries)

    def largest(self) -> int:
        n = 1
        while self.peak(n + 1) * (1 + self.stranded) <= self.memory:
            n += 1
        return n


def run(card: Card, check: bool = True, confirm: bool = True) -> object:
    return search(
        card,
        [Size(4, None), Size(8, None)],
        TERMS,
        Size(16, None) if check else None,
        lambda: card.memory,
        adaptive=True,
        confirm=confirm,
    )


def test_a_resolved_line_is_checked_and_confirmed_in_five_steps() -> None:
    card = Card(lambda n: 2 * GiB + 100 * MiB * n, 80 * GiB)
    out = run(card)
    target = ((80 * GiB - 64 * MiB) / (1 + ALLOWANCE) - 2 * GiB) // (100 * MiB)
    # the first confirming step reserved what it allocated: the allowance falls to 0 and
    # the line through it says 1 % more fits: a second one runs there
    again = (80 * GiB - 64 * MiB - 2 * GiB) // (100 * MiB)
    assert card.sizes == [4, 4, 8, 16, int(target), int(again)]
    assert out.resolved and out.check is not None and out.check.linear
    assert out.allowance == 0.0  # the confirming step reserved what it allocated


def test_the_share_that_resolves_the_slope() -> None:
    probe = Probe(16, None, "probe", 2 * GiB, 2 * GiB, 0, 0.0)
    flat = fit_lines([Probe(8, None, "probe", 2 * GiB - 8 * MiB, 0, 0, 0.0), probe], TERMS)
    assert variable_share(flat, probe) < RESOLVED_SHARE  # 16 MiB of 2 GiB: 0.8 %
    steep = fit_lines([Probe(8, None, "probe", 3 * GiB // 2, 0, 0, 0.0), probe], TERMS)
    assert variable_share(steep, probe) == 0.5


def test_unresolved_probes_grow_sixteen_fold_within_half_the_memory() -> None:
    card = Card(lambda n: 4 * GiB + 64 * 1024 * n, 200 * GiB)
    run(card, confirm=False)
    assert card.sizes[:5] == [4, 4, 8, 8 * GROWTH, 8 * GROWTH**2]
    # a card where 16x would pass half the memory: the growth stops at what stays inside
    small = Card(lambda n: 30 * GiB + 64 * 1024 * n, 80 * GiB)
    out = run(small)
    # 2x would already pass 40 GiB by the bound; an unresolved line is not confirmed
    assert small.sizes == [4, 4, 8]
    assert not out.resolved
    assert "under the 10% that resolves them" in out.notes[0]


def test_the_step_limit_holds() -> None:
    card = Card(lambda n: GiB + 1024 * n, 10**15)  # never resolved within the limit
    run(card)
    assert len(card.sizes) <= MAX_STEPS


def test_a_confirming_step_out_of_memory_aims_lower() -> None:
    card = Card(lambda n: 2 * GiB + 100 * MiB * n, 80 * GiB, stranded=0.03)
    out = run(card)
    assert card.sizes[:4] == [4, 4, 8, 16] and len(card.sizes) <= MAX_STEPS
    assert 0.02 < out.allowance < 0.04  # between the step that failed and the one that ran
    ran = [n for n in card.sizes if card.peak(n) * 1.03 <= card.memory]
    assert max(ran) >= card.largest() * 0.97


def test_required_is_the_peak_plus_the_allowance() -> None:
    assert required(100 * GiB, 0.01) == 101 * GiB + 64 * MiB


def test_a_step_that_ran_does_not_stop_the_search_at_its_own_bound() -> None:
    """A line that overstates large steps (a vision transformer's on an H100): the first
    confirming step runs with memory to spare. Its bound on the allowance is large, and
    aiming at it would name that step again; the next aims at the prior 1 % instead and
    runs larger, until one fails or the line says less than 1 % more fits."""

    def peak(n: int) -> int:
        return round(2 * GiB + 100 * MiB * n * (1 - 0.03 * min(1.0, n / 700)))

    card = Card(peak, 80 * GiB, retries=1)  # the allocator freed its cache: no ratio bound
    out = run(card)
    confirms = card.sizes[4:]
    assert len(confirms) >= 2 and confirms[1] > confirms[0] * 1.01
    ran = [n for n in card.sizes if peak(n) <= card.memory]
    assert max(ran) >= card.largest() * 0.97
    assert len(card.sizes) <= MAX_STEPS
    # the most the steps that ran allow: the largest left this much unused
    assert out.lines is not None
    assert out.allowance == (card.memory - 64 * MiB) / out.lines.at(max(ran)) - 1


def test_a_step_that_fails_leads_to_one_at_least_5_percent_lower() -> None:
    """An LSTM-like step needs 15 % more than its line at the limit: each confirming step
    after a failure aims at least 5 % below the smallest that failed, then halfway."""
    card = Card(lambda n: 400 * MiB + 37 * MiB * n, 80 * GiB, stranded=0.15, retries=1)
    out = run(card)
    confirms = card.sizes[4:]
    fits = [card.peak(n) * 1.15 <= card.memory for n in confirms]
    assert fits[:2] == [False, False]
    assert confirms[1] <= int(confirms[0] * 0.95)
    ran = [n for n, ok in zip(confirms, fits, strict=True) if ok]
    assert ran and max(ran) >= card.largest() * 0.97
    assert len(card.sizes) <= MAX_STEPS
    assert 0.14 < out.allowance < 0.17  # the most the steps that ran allow


def test_the_last_confirming_step_aims_at_the_probes_ceiling() -> None:
    """A step that needs 32 % more than its line at the limit: five confirming steps, each
    5 % lower than the last, all run out of memory. The last one the limits allow aims at
    what the largest probe reserved over what it allocated (here exactly what it needs), so
    the plan ends on a batch that ran near the limit, not on its probe at 16."""
    card = Card(lambda n: 400 * MiB + 37 * MiB * n, 80 * GiB, stranded=0.32, retries=1)
    out = run(card)
    assert len(card.sizes) == MAX_STEPS
    confirms = card.sizes[4:]
    fits = [card.peak(n) * 1.32 <= card.memory for n in confirms]
    assert fits == [False] * 5 + [True], confirms
    assert confirms[-1] >= card.largest() * 0.99
    assert out.fitted[-1].n == confirms[-1]


def test_without_a_ceiling_the_last_step_keeps_stepping_down() -> None:
    """Probes that reserved no more than they allocated bound nothing: the last step is
    5 % below the one before, as every other, and nothing past the probes ran."""

    class Tight(Card):
        def __call__(self, size: Size, role: str, profile: bool) -> Probe:
            probe = super().__call__(size, role, profile)
            return probe if probe.oom else dataclasses.replace(probe, reserved=probe.allocated)

    def peak(n: int) -> int:
        return 400 * MiB + 37 * MiB * n

    card = Card(peak, 80 * GiB, stranded=0.32, retries=1)
    run(card)
    tight = Tight(peak, 80 * GiB, stranded=0.32, retries=1)
    out = run(tight)
    assert tight.sizes[:-1] == card.sizes[:-1]
    # the ceiling's step ran just under the limit; 5 % lower still failed
    assert card.sizes[-1] < card.largest() + 1 <= tight.sizes[-1] <= int(tight.sizes[-2] * 0.95)
    assert max(p.n for p in out.fitted) == 16


class HeadCard:
    """A step whose last request is one large tensor (an LM head's output, ``head`` bytes a
    sample) after ``fixed`` bytes and ``body`` a sample, of which the allocator strands
    ``stranded`` more: it fails when what it reserved plus that request passes ``memory``,
    and says so as PyTorch does (reserved when it failed, the request that failed)."""

    def __init__(self, fixed: int, body: int, head: int, stranded: float, memory: int):
        self.fixed, self.body, self.head = fixed, body, head
        self.stranded, self.memory = stranded, memory
        self.sizes: list[int] = []

    def reserved_before_head(self, n: int) -> int:
        return round((self.fixed + self.body * n) * (1 + self.stranded))

    def fits(self, n: int) -> bool:
        return self.reserved_before_head(n) + self.head * n <= self.memory

    def largest(self) -> int:
        n = 1
        while self.fits(n + 1):
            n += 1
        return n

    def __call__(self, size: Size, role: str, profile: bool) -> Probe:
        n = size.n
        self.sizes.append(n)
        peak = self.fixed + (self.body + self.head) * n
        if not self.fits(n):
            asked = self.head * n
            error = f"CUDA out of memory. Tried to allocate {asked / MiB:.2f} MiB."
            allocated = self.fixed + self.body * n
            return failed(n, role, error, 1, allocated, self.reserved_before_head(n), asked)
        reserved = self.reserved_before_head(n) + self.head * n
        return Probe(n, None, role, peak, reserved, 0, 0.0, False, None, 1)


def test_the_request_that_failed_bounds_the_next_step() -> None:
    """The checkpointed transformer of the zoo: its first confirming step fails on the LM
    head's output (22.9 GiB asked, 18.2 GiB left). Reserved plus that request, grown with
    the batch, say where the request fits: the next step aims 1 % under it (below the 5 %
    step down), runs, and ends the search within ``BRACKET`` of that bound."""
    card = HeadCard(2 * GiB, 40 * MiB, 16 * MiB, 0.2, 80 * GiB)
    out = run(card)
    confirms = card.sizes[4:]
    truth = card.largest()
    assert confirms[0] > truth and not card.fits(confirms[0])
    # the room: (usable - fixed) over (reserved + requested - fixed), scaled to the batch
    usable = 80 * GiB - 64 * MiB
    need = card.reserved_before_head(confirms[0]) + card.head * confirms[0] - 2 * GiB
    room = int(confirms[0] * (usable - 2 * GiB) / need)
    assert abs(room - truth) <= 0.005 * truth
    assert confirms[1] == int(room * (1 - AIM_BELOW)) < int(confirms[0] * (1 - STEP_DOWN))
    assert card.fits(confirms[1]) and len(confirms) == 2  # six steps in all
    assert truth * 0.97 <= max(p.n for p in out.fitted) <= truth
    # the allowance is the most the step that ran allows (the upper end: another budget's
    # answer must run there too), not what fits the room
    assert out.lines is not None
    assert out.allowance == usable / out.lines.at(confirms[1]) - 1
    assert out.allowance > usable / out.lines.at(room) - 1


def test_after_the_first_failure_the_next_step_aims_under_its_room() -> None:
    """A small request that failed on a nearly full card (ResNet-50's 372 MiB): the room
    lies above the 5 % step down, and the next step aims 1 % under it all the same, runs,
    and ends the search within ``BRACKET`` (six steps; the step down took seven)."""
    card = HeadCard(2 * GiB, 79 * MiB, 1 * MiB, 0.02, 80 * GiB)
    out = run(card)
    confirms = card.sizes[4:]
    assert not card.fits(confirms[0])
    assert confirms[1] > int(confirms[0] * (1 - STEP_DOWN))
    assert card.fits(confirms[1]) and len(confirms) == 2
    assert confirms[1] >= card.largest() * 0.985
    assert max(p.n for p in out.fitted) == confirms[1]


class EarlyCard(HeadCard):
    """A ``HeadCard`` whose steps fail early the first time (a UNet's cache, fragmented by
    many mid-sized tensors): the first failure says it had reserved ``early`` of what it
    needed, so its room lies past the true largest."""

    def __init__(
        self, early: float, fixed: int, body: int, head: int, stranded: float, memory: int
    ) -> None:
        super().__init__(fixed, body, head, stranded, memory)
        self.early = early
        self.failures = 0

    def __call__(self, size: Size, role: str, profile: bool) -> Probe:
        probe = super().__call__(size, role, profile)
        if not probe.oom:
            return probe
        self.failures += 1
        if self.failures > 1 or probe.oom_reserved is None:
            return probe
        return dataclasses.replace(probe, oom_reserved=round(probe.oom_reserved * self.early))


def test_a_second_failure_steps_down_5_percent_whatever_its_room() -> None:
    """The first failure's room is too high (the UNet's, +6.3 % on an H100): the step aimed
    under it fails too, and the next runs at least 5 % below that one (or under the second
    room, whichever is lower), never 1 % under a room again and again."""
    card = EarlyCard(0.93, 2 * GiB, 40 * MiB, 2 * MiB, 0.09, 80 * GiB)
    out = run(card)
    confirms = card.sizes[4:]
    truth = card.largest()
    assert not card.fits(confirms[0]) and not card.fits(confirms[1])
    assert confirms[1] < confirms[0]
    assert confirms[2] <= int(confirms[1] * (1 - STEP_DOWN))
    assert len(card.sizes) <= 8
    assert truth * 0.97 <= max(p.n for p in out.fitted) <= truth


def test_a_step_that_ran_within_the_bracket_under_the_rooms_ends_the_search() -> None:
    """The UNet on an H100: two failures, the first's room too high, then a step 5 % down
    ran 2.1 % under the second's room (1634 against 1670; the truth 1636). Within
    ``BRACKET`` (2.5 %) the search ends there, seven steps: the answer cannot be more than
    that short of a room, and a room has never been more than 0.1 % under the truth. At
    1.5 % the eighth step failed halfway up."""
    card = EarlyCard(0.96, 2 * GiB, 40 * MiB, 2 * MiB, 0.07, 80 * GiB)
    out = run(card)
    confirms = card.sizes[4:]
    truth = card.largest()
    assert [card.fits(n) for n in confirms] == [False, False, True]
    assert len(card.sizes) == 7
    answer = max(p.n for p in out.fitted)
    assert answer == confirms[-1] and truth * 0.975 <= answer <= truth
    assert BRACKET == 0.025
    saved = _steps.BRACKET
    _steps.BRACKET = 0.015
    try:
        narrow = EarlyCard(0.96, 2 * GiB, 40 * MiB, 2 * MiB, 0.07, 80 * GiB)
        run(narrow)
    finally:
        _steps.BRACKET = saved
    assert narrow.sizes[:7] == card.sizes and len(narrow.sizes) == 8


def test_without_reading_the_room_the_search_is_the_one_before() -> None:
    """``READ_ROOM`` off (the search the zoo record ran): the same failure leads to the 5 %
    step down and halving, more steps for the same card."""
    card = HeadCard(2 * GiB, 40 * MiB, 16 * MiB, 0.2, 80 * GiB)
    run(card)
    old = HeadCard(2 * GiB, 40 * MiB, 16 * MiB, 0.2, 80 * GiB)
    saved = _steps.READ_ROOM
    _steps.READ_ROOM = False
    try:
        run(old)
    finally:
        _steps.READ_ROOM = saved
    assert old.sizes[:5] == card.sizes[:5]
    assert old.sizes[5] == int(old.sizes[4] * (1 - STEP_DOWN)) != card.sizes[5]
    assert len(old.sizes) > len(card.sizes)
