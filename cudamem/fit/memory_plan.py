"""``MemoryPlan``: the peak of a training step at any batch size, as ``cudamem.plan``
measured it, and the questions it answers (``predict``, ``largest``, ``checkpointing``).

A frozen value: the probes' peaks, the fitted lines (``cudamem.fit._terms``), the check of the
line at a size beyond the probes, the per-module shares of the per-sample bytes. Only
``largest()`` and ``checkpointing()`` read the device again, for the memory free now (NVML's
free memory plus this process's reserved bytes), unless ``memory=`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, ClassVar

from ..allocator import backend as _backend
from ..base.args import check_int
from ..base.format import format_bytes, plural
from ..base.present import Presented, PresentedHtml
from ..ledger import nvml as _nvml
from ..ledger.free_space import Fragmentation
from ._terms import (
    ALLOWANCE,
    HEADROOM,
    UNCONFIRMED,
    Line,
    ModuleCost,
    checkpoint_per_sample,
    choose_checkpoint,
    largest_under,
    required,
)

__all__ = [
    "LINEAR_TOLERANCE",
    "SAME_MEMORY",
    "CheckpointAdvice",
    "LargestBatch",
    "LineCheck",
    "MemoryPlan",
    "ModuleShare",
    "NotLinearError",
    "Prediction",
    "Probe",
    "RestoreCost",
    "available_memory",
    "device_memory",
]

#: The check point may lie this far (relative, allocated) from the line before the plan
#: calls the step not linear in ``n`` and refuses to extrapolate.
LINEAR_TOLERANCE = 0.02


#: ``largest()`` treats a budget within this share of the memory the plan ran with as that
#: memory: the steps that ran answer for it, not the line.
SAME_MEMORY = 0.005


class NotLinearError(RuntimeError):
    """The plan refuses to answer past what it measured: its line failed the check."""


@dataclass(frozen=True, slots=True)
class Probe:
    """One step the plan ran: its size, its role and the peaks it reached (bytes).

    ``allocated`` and ``reserved`` are the device's peaks during the step, absolute (the
    model, its gradients and optimizer state included), ``None`` when it ran out of memory.
    """

    n: int
    #: The sequence length it ran at, ``None`` without a length axis.
    length: int | None
    #: ``'warm-up'`` (not fitted: it creates optimizer state and workspaces), ``'probe'``
    #: (fitted) or ``'check'`` (tests the line).
    role: str
    allocated: int | None
    reserved: int | None
    #: Allocated when the step started.
    baseline: int
    seconds: float
    oom: bool = False
    #: The out-of-memory message's first line.
    error: str | None = None
    #: Times the allocator freed its cache and retried a request during the step.
    retries: int = 0
    #: The step's peak allocated split where each outermost module forward returned
    #: (``(forward, the rest)`` for a model whose forward computes the loss); ``()`` when
    #: no module ran or the step ran out of memory.
    phases: tuple[int, ...] = ()
    #: Allocated and reserved when it ran out of memory (the allocator had freed its cache
    #: and retried: reserved over allocated is what it could not give back), or ``None``.
    oom_allocated: int | None = None
    oom_reserved: int | None = None
    #: The request that failed (the out-of-memory message's "Tried to allocate"), or ``None``.
    oom_requested: int | None = None


@dataclass(frozen=True, slots=True)
class Prediction(Presented):
    """The predicted peak of one step at batch ``n`` (and ``length``): bytes."""

    n: int
    length: int | None
    allocated: int
    reserved: int
    #: Whether ``n`` lies within the sizes the plan ran (an interpolation).
    measured_range: bool = True
    #: The memory the step needs when memory is short: peak allocated plus the allowance
    #: for what the allocator cannot give back (``MemoryPlan.allowance``); what
    #: ``largest()`` holds against the memory. ``reserved`` is the peak of a step with
    #: memory to spare (cached blocks it could have returned included).
    required: int = 0


@dataclass(frozen=True, slots=True)
class LineCheck:
    """The line tested at a size beyond the probes: predicted against measured peaks."""

    n: int
    length: int | None
    predicted: int
    measured: int
    #: ``|predicted - measured| / measured`` of allocated.
    error: float
    predicted_reserved: int
    measured_reserved: int
    reserved_error: float
    #: ``error <= LINEAR_TOLERANCE``.
    linear: bool


@dataclass(frozen=True, slots=True)
class ModuleShare:
    """One module's share of the per-sample bytes: what its forward kept, per sample, on
    the profiled probe (``self_kept``: less its submodules')."""

    name: str
    type_name: str
    depth: int
    kept: float
    self_kept: float


@dataclass(frozen=True, slots=True)
class RestoreCost:
    """What ``restore=True`` cost: the model's and optimizer's state copied to the host
    before the probes and loaded back after them."""

    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CheckpointAdvice(Presented):
    """Which modules' activations to checkpoint (``torch.utils.checkpoint``) for batch
    ``n`` to fit, and the predicted peak with them checkpointed."""

    n: int
    length: int | None
    #: The modules to checkpoint, in forward order (``ClassName.path``, as the module
    #: profile names them); empty when the batch fits as it is or nothing repeats.
    modules: tuple[str, ...]
    predicted: Prediction
    #: The peak without checkpointing.
    without: Prediction
    #: Bytes the peak must stay under (the memory free, less the margin), ``None`` if not
    #: known.
    budget: int | None
    fits: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LargestBatch(Presented):
    """``MemoryPlan.largest_for``: the largest batch for a given memory, and what the answer
    assumed about the card."""

    n: int
    length: int | None
    #: Bytes the allocator may use (for ``card=True``: the card's capacity less what this
    #: card holds outside the allocator).
    memory: int
    margin: float
    #: ``memory`` less the margin: what the required bytes are held against.
    budget: int
    #: The memory batch ``n`` needs (``Prediction.required``).
    required: int
    #: ``'ran'`` (a step at ``n`` or larger ran on this card), ``'interpolated'`` (between
    #: steps that ran) or ``'extrapolated'`` (past every step: the line's word alone).
    territory: str
    #: What the plan measured on this card that another card may not share: ``(what,
    #: bytes)``.
    card_parts: tuple[tuple[str, int], ...]
    assumptions: tuple[str, ...]
    #: The card's capacity when ``card=True`` was asked, else ``None``.
    capacity: int | None = None


def available_memory(device: int) -> tuple[int | None, str | None]:
    """Bytes this process could use on ``device`` now: NVML's free memory (CUDA's where
    NVML does not answer) plus what its allocator holds reserved; or ``None`` and why."""
    available, _, why = device_memory(device)
    return available, why


def device_memory(device: int) -> tuple[int | None, int | None, str | None]:
    """``(available, capacity, why)``: ``available_memory``'s bytes, the device's capacity,
    and why the first is unknown (``None`` when known)."""
    backend = _backend.get()
    reserved = backend.read(device).reserved
    info = _nvml.query_device(device, backend.device_uuid(device))
    if isinstance(info, _nvml.NvmlDevice) and info.memory is not None:
        return info.memory.free + reserved, info.memory.total, None
    why = info.reason if isinstance(info, _nvml.NvmlStatus) else info.memory_reason
    cuda = backend.mem_get_info(device)
    if cuda is not None:
        return cuda[0] + reserved, cuda[1], None
    return None, None, f"the free memory is unknown (NVML: {why}; CUDA has no context)"


def _check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, Real):
        raise TypeError(f"margin must be a number, not {type(margin).__name__}")
    value = float(margin)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"margin must be >= 0 and < 1 (a fraction of the memory), got {margin!r}")
    return value


@dataclass(frozen=True, slots=True)
class MemoryPlan(PresentedHtml):
    """The peak of a training step as a function of the batch size (and sequence length):
    the result of ``cudamem.plan``.

    ``predict(n)`` gives the peak at any size, ``largest()`` the largest batch that fits the
    memory free now, ``checkpointing(n)`` which modules to checkpoint for a batch that does
    not. ``fixed`` and ``per_sample`` split the peak into what every step holds (parameters,
    gradients, optimizer state, workspaces) and what one sample adds; ``modules`` names the
    modules whose activations make up the per-sample bytes.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("linear", "largest_measured", "smallest_oom")

    #: The device measured.
    device: int
    #: Every step run, in order (warm-up, probes, check).
    probes: tuple[Probe, ...]
    #: Peak allocated and peak reserved as fitted, ``None`` when the probes gave no fit.
    allocated_line: Line | None
    reserved_line: Line | None
    #: Reserved over allocated at the largest step measured (at least 1): one of the two
    #: guides to the reserved peak, with ``reserved_line`` (see ``predict``).
    ratio: float
    check: LineCheck | None
    #: Whether the plan has a sequence-length axis (``lengths=``).
    length_axis: bool = False
    #: Likely causes of a failed check (cuDNN benchmark, torch.compile recompiling, ...).
    causes: tuple[str, ...] = ()
    #: The per-module shares of the per-sample bytes, largest first (top-level modules of
    #: each depth; see ``ModuleShare``).
    modules: tuple[ModuleShare, ...] = ()
    #: What the fixed part holds, as the module profile read it: ``(what, bytes)`` for the
    #: parameters, buffers, optimizer state and gradients of the models that ran.
    fixed_parts: tuple[tuple[str, int], ...] = ()
    #: The figures checkpointing advice is computed from (one per module, forward order).
    module_costs: tuple[ModuleCost, ...] = ()
    #: ``(n, length)`` of the profiled probe.
    profiled: tuple[int, int | None] | None = None
    restore: RestoreCost | None = None
    #: Allocated after the plan minus before it: what the user's step keeps (optimizer
    #: state created by the warm-up), nothing of the probes.
    kept_after: int = 0
    #: Memory this process could use when the plan finished (``available_memory``).
    available: int | None = None
    #: ``largest()`` with the default margin, when the plan finished (``None``: refused
    #: or unknown).
    largest_now: int | None = None
    notes: tuple[str, ...] = ()
    #: The cache right after the largest step (``cudamem.fragmentation``): the bytes
    #: stranded at that size's peak, the largest free block, the last OOM judged.
    fragmentation: Fragmentation | None = None
    #: Why nothing was measured (``'no CUDA device'``), or ``None``.
    unmeasured: str | None = None
    #: One line per phase of the step (``Probe.phases``) where every fitted step had the
    #: same phases: the predicted peak is the largest of them (the peak moves from the end
    #: of the forward to the backward as samples grow longer); ``()``: the one line.
    phase_lines: tuple[Line, ...] = ()
    #: What the allocator cannot give back near the limit, as a share of the peak
    #: allocated (plus ``HEADROOM``): ``Prediction.required``. Measured by the confirming
    #: steps where they ran, else the prior ``ALLOWANCE``.
    allowance: float = ALLOWANCE
    #: Whether the per-sample part was at least ``RESOLVED_SHARE`` of the peak at the
    #: largest step fitted (``None``: no line).
    resolved: bool | None = None
    #: Batch sizes of checks that landed off the line and led to larger probes.
    recovered: tuple[int, ...] = ()
    #: The steps the line runs through: ``(n, length)`` each.
    fitted: tuple[tuple[int, int | None], ...] = ()
    #: Whether the plan confirmed its answer with steps (``plan(confirm=True)``): then
    #: ``largest()`` on this card never names a batch past the largest step that ran.
    confirm: bool = False
    #: The device's capacity (bytes), ``None`` when unknown.
    capacity: int | None = None
    #: The largest batch the step can run (``plan(max_batch=)``: a dataset's length);
    #: ``largest()`` never names more.
    max_batch: int | None = None

    # -- derived ------------------------------------------------------------------------

    @property
    def linear(self) -> bool | None:
        """Whether the check point lay on the line (``None``: no check ran)."""
        return None if self.check is None else self.check.linear

    @property
    def largest_measured(self) -> int:
        """The largest batch size a step ran at without running out of memory."""
        return max((p.n for p in self.probes if not p.oom), default=0)

    def _measured(self, n: int, length: int | None, *, spare: bool = False) -> bool:
        """Whether batch ``n`` (at ``length``) lies within what the steps measured: no
        larger batch, and on a length axis no longer length, than a step ran at; with
        ``spare``, only the steps that had memory to spare (not the confirming steps: the
        reserved line and the ratio come from the others)."""
        ran = [p for p in self.probes if not p.oom and not (spare and p.role == "confirm")]
        if n > max((p.n for p in ran), default=0):
            return False
        if length is None:
            return True
        return length <= max((p.length or 0 for p in ran), default=0)

    @property
    def smallest_oom(self) -> int | None:
        """The smallest batch size whose step ran out of memory, ``None`` if none did."""
        return min((p.n for p in self.probes if p.oom), default=None)

    @property
    def fixed(self) -> int:
        """Peak allocated bytes that do not grow with the batch (the line's intercept)."""
        return round(self._line().fixed)

    def per_sample(self, length: int | None = None) -> int:
        """Peak allocated bytes one more sample adds (at ``length`` on a length axis)."""
        return round(self._line().per_sample(self._length(length)))

    # -- questions ----------------------------------------------------------------------

    def predict(self, n: int, length: int | None = None) -> Prediction:
        """The predicted peak ``.allocated`` and ``.reserved`` bytes of a step at batch
        ``n`` (and ``length``, on a plan with a length axis).

        Raises:
            NotLinearError: ``n`` lies past the measured sizes and the line failed its check.
            RuntimeError: nothing was measured, or the probes gave no fit.
        """
        check_int("n", n, minimum=1)
        line = self._line()
        at = self._length(length)
        inside = self._measured(n, length)
        if not inside and self.linear is False:
            raise NotLinearError(self._refusal(f"predict({n})"))
        allocated = self._allocated_at(line, n, at)
        return Prediction(
            n,
            length,
            round(allocated),
            round(self._reserved_at(n, at)),
            inside,
            round(required(allocated, self.allowance)),
        )

    def largest(
        self, margin: float = 0.05, *, length: int | None = None, memory: int | None = None
    ) -> int:
        """The largest batch whose required memory (``Prediction.required``: peak allocated
        plus what the allocator cannot give back) fits ``memory`` less ``margin`` (a
        fraction of it): by default the memory this process can use now, NVML's free
        memory plus its own reserved bytes. 0 when not even one sample fits.

        On this card (``memory`` at most what the plan ran with) it never names a batch at
        or past one that ran out of memory, and, where the plan confirmed its answer
        (``plan(confirm=True)``, the default), never one past the largest step that ran;
        within ``SAME_MEMORY`` of that memory it names that step. A larger ``memory`` (a
        larger card) is answered from the line alone: ``largest_for`` says what that
        assumes.

        Raises:
            NotLinearError: the line failed its check (the plan does not extrapolate).
            RuntimeError: nothing was measured, or the free memory is unknown.
        """
        budget = self._budget(margin, memory)
        return self._largest(budget, self._length(length))

    def largest_for(
        self,
        memory: int,
        *,
        margin: float = 0.05,
        length: int | None = None,
        card: bool = False,
    ) -> LargestBatch:
        """``largest()`` for ``memory`` bytes, with what the answer assumed: for a budget on
        this card or for a card you do not have.

        ``memory`` is what the allocator may use (``torch.cuda.set_per_process_memory_
        fraction(f)`` caps it at ``f`` times the capacity); with ``card=True`` it is a
        card's capacity (141 GB), and what this card holds outside the allocator (the
        CUDA context, the driver, other processes) is taken off it, assumed the same there.

        Raises:
            NotLinearError, RuntimeError: as ``largest()``.
        """
        check_int("memory", memory, minimum=0)
        at = self._length(length)
        assumptions: list[str] = []
        parts = self._card_parts()
        usable = memory
        if card:
            outside = dict(parts).get("outside the allocator")
            if outside is None:
                raise RuntimeError(
                    "card=True needs this card's capacity and free memory, which the plan "
                    "could not read: pass the allocator's bytes instead (card=False)"
                )
            usable = max(0, memory - outside)
            assumptions.append(
                f"{format_bytes(outside)} of the card outside the allocator, as here (the "
                "CUDA context and the driver: their size depends on the card and driver)"
            )
        budget = self._budget(margin, usable)
        n = self._largest(budget, at)
        line = self._line()
        allocated = self._allocated_at(line, max(n, 1), at)
        ran = self.largest_measured
        territory = "ran" if 0 < n <= ran else "extrapolated" if n > ran else "interpolated"
        if territory == "ran" and all(p.n != n for p in self.probes if not p.oom):
            territory = "interpolated"
        workspaces = dict(parts).get("other fixed bytes")
        if workspaces is not None:
            assumptions.append(
                f"{format_bytes(workspaces)} of fixed bytes beyond the model's state, as here "
                "(cuBLAS and cuDNN workspaces: their size depends on the architecture)"
            )
        assumptions.append(
            f"the allocator cannot give back {self.allowance:.2%} of the peak plus "
            f"{format_bytes(HEADROOM)}, as measured here"
            + (" at a confirming step" if self.confirm and self._confirmed else "")
        )
        here = self.available
        if self.confirm and not (here and abs(budget - here) <= here * SAME_MEMORY):
            assumptions.append(
                f"{UNCONFIRMED:.1%} of the budget kept in reserve: no step ran at this limit"
            )
        assumptions.append("the same torch, dtypes and kernels: the per-sample bytes as here")
        return LargestBatch(
            n,
            length,
            usable,
            float(margin),
            round(budget),
            round(required(allocated, self.allowance)) if n else 0,
            territory,
            parts,
            tuple(assumptions),
            memory if card else None,
        )

    def _largest(self, budget: float, at: int) -> int:
        self._line()
        if self.linear is False:
            raise NotLinearError(self._refusal("largest()"))
        oom = self.smallest_oom
        if self.length_axis or self.available is None:
            best = largest_under(lambda k: self._required_at(k, at), budget)
            return best if oom is None else min(best, oom - 1)
        same = abs(budget - self.available) <= self.available * SAME_MEMORY
        if self.confirm and not same:
            budget *= 1 - UNCONFIRMED  # no step ran at this limit: a reserve
        best = largest_under(lambda k: self._required_at(k, at), budget)
        if self.max_batch is not None:
            best = min(best, self.max_batch)
        if budget > self.available * (1 + SAME_MEMORY):
            return best  # a larger card: the line's answer (largest_for says so)
        ran = self.largest_measured
        if oom is not None:
            best = min(best, oom - 1)
        if self.confirm:
            best = min(best, ran)
            if same:
                best = max(best, ran)
        return best

    @property
    def _confirmed(self) -> bool:
        return any(p.role == "confirm" and not p.oom for p in self.probes)

    def _card_parts(self) -> tuple[tuple[str, int], ...]:
        parts: list[tuple[str, int]] = []
        if self.capacity is not None and self.available is not None:
            parts.append(("outside the allocator", max(0, self.capacity - self.available)))
        if self.fixed_parts and self.allocated_line is not None:
            state = sum(nbytes for _, nbytes in self.fixed_parts)
            parts.append(("other fixed bytes", max(0, self.fixed - state)))
        return tuple(parts)

    def checkpointing(
        self,
        n: int,
        *,
        length: int | None = None,
        margin: float = 0.05,
        memory: int | None = None,
    ) -> CheckpointAdvice:
        """Which modules to checkpoint for batch ``n`` to fit (``memory`` less ``margin``,
        as in ``largest``), from the profiled probe's kept bytes per module, and the
        predicted peak with them checkpointed.

        Raises:
            RuntimeError: no module profile (the profiled probe saw no module), or
                ``length`` differs from the profiled probe's.
        """
        check_int("n", n, minimum=1)
        budget = self._budget(margin, memory)
        line = self._line()
        at = self._length(length)
        if not self.module_costs or self.profiled is None:
            raise RuntimeError("the plan has no module profile: run the step through modules")
        if self.length_axis and length != self.profiled[1]:
            raise RuntimeError(
                f"checkpointing advice is for the profiled length {self.profiled[1]}, not {length}"
            )
        without = self.predict(n, length)
        fixed = line.fixed
        per_sample = line.per_sample(at)
        if without.required <= budget:
            return CheckpointAdvice(n, length, (), without, without, round(budget), True)
        target = ((budget - HEADROOM) / (1.0 + self.allowance) - fixed) / n
        chosen = choose_checkpoint(self.module_costs, per_sample, target)
        notes: list[str] = []
        if not chosen:
            notes.append("no repeated block saves memory when checkpointed")
        predicted = self._checkpointed(n, length, chosen)
        fits = predicted.required <= budget
        if chosen and not fits:
            notes.append(
                f"checkpointing all {plural(len(chosen), 'block')} is not enough: "
                f"{format_bytes(predicted.required)} needed, {format_bytes(round(budget))} free"
            )
        names = tuple(m.name for m in sorted(chosen, key=lambda m: m.order))
        return CheckpointAdvice(
            n, length, names, predicted, without, round(budget), fits, tuple(notes)
        )

    def predict_checkpointed(
        self, n: int, modules: Sequence[str], length: int | None = None
    ) -> Prediction:
        """The predicted peak at batch ``n`` with ``modules`` (names as in
        ``module_costs``) checkpointed.

        Raises:
            KeyError: a name the profile does not know.
        """
        check_int("n", n, minimum=1)
        known = {m.name: m for m in self.module_costs}
        missing = [name for name in modules if name not in known]
        if missing:
            raise KeyError(f"modules not in the profile: {', '.join(missing)}")
        return self._checkpointed(n, length, [known[name] for name in modules])

    # -- helpers ------------------------------------------------------------------------

    def _checkpointed(self, n: int, length: int | None, chosen: Sequence[ModuleCost]) -> Prediction:
        line = self._line()
        at = self._length(length)
        per_sample = checkpoint_per_sample(line.per_sample(at), chosen)
        allocated = line.fixed + n * per_sample
        return Prediction(
            n,
            length,
            round(allocated),
            round(allocated * self.ratio),
            self._measured(n, length),
            round(required(allocated, self.allowance)),
        )

    def _allocated_at(self, line: Line, n: int, length: int) -> float:
        """The predicted peak allocated: the largest phase's where phases were fitted."""
        if self.phase_lines:
            return max(p.at(n, length) for p in self.phase_lines)
        return line.at(n, length)

    def _reserved_at(self, n: int, length: int) -> float:
        """The predicted reserved peak: within the measured sizes the larger of the reserved
        line and predicted allocated times the largest step's reserved-over-allocated ratio;
        past them the smaller of the two, never below predicted allocated.

        Past the probes each guide errs one way: where the cache's overhead is a share of
        each block (rounding, segments cut to size: ResNet-50's many small blocks) that
        share shrinks as blocks grow, and the line through small steps' reserved peaks
        grows too fast (+4.5 % at 16x the largest probe on an H200, where the ratio said
        -0.4 %); where it is a fixed amount the ratio overstates it instead."""
        line = self._line()
        allocated = self._allocated_at(line, n, length)
        reserved = allocated * self.ratio
        if self.reserved_line is not None:
            by_line = self.reserved_line.at(n, length)
            inside = self._measured(n, length if self.length_axis else None, spare=True)
            reserved = max(reserved, by_line) if inside else min(reserved, by_line)
        return max(allocated, reserved)

    def _required_at(self, n: int, length: int) -> float:
        return required(self._allocated_at(self._line(), n, length), self.allowance)

    def _budget(self, margin: Any, memory: Any) -> float:
        fraction = _check_margin(margin)
        if self.unmeasured is not None:
            raise RuntimeError(f"cudamem.plan measured nothing: {self.unmeasured}")
        if memory is None:
            memory, why = available_memory(self.device)
            if memory is None:
                raise RuntimeError(f"{why}: pass memory= (bytes)")
        else:
            check_int("memory", memory, minimum=0)
        return float(memory) * (1.0 - fraction)

    def _line(self) -> Line:
        if self.unmeasured is not None:
            raise RuntimeError(f"cudamem.plan measured nothing: {self.unmeasured}")
        if self.allocated_line is None:
            why = "; ".join(self.notes) or "too few probes ran"
            raise RuntimeError(f"the probes gave no fit: {why}")
        return self.allocated_line

    def _length(self, length: int | None) -> int:
        if not self.length_axis:
            if length is not None:
                raise ValueError("length is only for a plan with lengths= (this one has none)")
            return 1
        if length is None:
            raise ValueError("length is required: this plan was fitted over lengths")
        return check_int("length", length, minimum=1)

    def _refusal(self, what: str) -> str:
        check = self.check
        assert check is not None
        where = f"batch {check.n}" + ("" if check.length is None else f", length {check.length}")
        causes = f" Likely: {'; '.join(self.causes)}." if self.causes else ""
        return (
            f"{what}: the step is not linear in n: at {where} the peak was "
            f"{format_bytes(check.measured)}, {check.error:.1%} from the line's "
            f"{format_bytes(check.predicted)}; cudamem does not extrapolate past batch "
            f"{self.largest_measured}, the largest it measured.{causes}"
        )
