"""``cudamem.plan``'s steps on the device: ``Runner.run`` runs one inside a quiet span with
its phases and records its peaks (or, where it ran out of memory, what it had reserved and
asked for, its frames cleared); ``Runner.settle`` frees what the last one left before the
next; ``frozen_heap`` keeps the heap the plan found out of the collector's sight."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ..allocator import backend_base as _backend_base
from ..ledger.oom import parse_oom_message
from ..ledger.oom_guard import caught_oom
from ..spans.span import close_quiet, open_quiet
from ._forwards import Phases
from ._steps import Size
from ._terms import HEADROOM
from .memory_plan import Probe

__all__ = ["INTERPRETER_FROZEN", "UNACCOUNTED_SHARE", "Runner", "frozen_heap"]


#: At most this many objects in the permanent generation are the interpreter's own, not a
#: ``gc.freeze()``: CPython 3.12 moves each immortal object a collection meets there (375 at
#: the start of 3.12.3, before any freeze), while a freeze moves every tracked object, over
#: 4,000 even in a bare interpreter (``python -I -S``).
INTERPRETER_FROZEN = 1000

#: Allocated bytes the plan's first full collection may skip: where the model's and the
#: optimizer's tensors account for all but this share of the card's capacity (at least
#: ``HEADROOM``), garbage could hold no more, and a batch named with it still allocated is
#: short by at most about that share. The collection walks the whole heap: 210-310 ms in a
#: process that imported transformers and lightning (half a million objects, H100 host).
UNACCOUNTED_SHARE = 0.005


@contextlib.contextmanager
def frozen_heap() -> Iterator[bool]:
    """The objects alive now moved out of the collector's sight (``gc.freeze()``) while
    inside, and back after (``gc.unfreeze()``): a full collection then walks what the
    steps made, not the heap the plan found (half a million objects in a process that
    imported transformers and lightning: 260-310 ms a collection on an H100 host). Call it
    right after a full collection: garbage frozen here is not collected until after.
    Left alone (yields ``False``) where someone froze their heap already (more than
    ``INTERPRETER_FROZEN`` objects frozen): unfreezing would hand theirs back too. The
    interpreter's own go back to the oldest generation with the rest, and its next full
    collection moves them to the permanent one again."""
    if gc.get_freeze_count() > INTERPRETER_FROZEN:
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


class Runner:
    """Runs ``step`` on ``device`` at the sizes the search asks for: ``run`` one step,
    ``settle`` between steps; ``probes``, every step run, in order."""

    def __init__(
        self,
        step: Callable[..., Any],
        backend: _backend_base.Backend,
        device: int,
        length_axis: bool,
    ) -> None:
        self.step = step
        self.backend = backend
        self.device = device
        self.length_axis = length_axis
        self.probes: list[Probe] = []
        #: Allocated bytes after the last full collection: the level a clean step returns to.
        self._level: int | None = None

    @staticmethod
    def _where(size: Size, role: str) -> str:
        at = f"batch {size.n}" + ("" if size.length is None else f", length {size.length}")
        hint = " (check= chooses the check step's size)" if role == "check" else ""
        return f"cudamem.plan: raised by the {role} step at {at}{hint}"

    def settle(self, held: int | None = None) -> None:
        """Free what the last step left behind, then give the cache back. The young
        generations are collected always (a step's cycles are young); a full collection,
        210-310 ms on the heap of a process that imported transformers and lightning, runs
        only where the allocated bytes stand above the level after the last one: the first
        step (its optimizer state), a failed step, a cycle that aged inside the step.

        Before the first step (no level yet) it runs unless ``held``, the bytes the model's
        and the optimizer's tensors hold on the device, accounts for all the allocated
        bytes but ``_unaccounted_limit()``: garbage that old could hold no more than that
        (``None``: the plan knows no model, and collects)."""
        gc.collect(1)
        backend, device = self.backend, self.device
        now = backend.read(device).allocated
        if self._level is None:
            full = held is None or now - held > self._unaccounted_limit()
        else:
            full = now > self._level
        if full:
            gc.collect()
            now = backend.read(device).allocated
        self._level = now
        backend.empty_cache()

    def _unaccounted_limit(self) -> int:
        """``UNACCOUNTED_SHARE`` of the card's capacity, at least ``HEADROOM``; ``-1`` (any
        byte is too many) where the capacity cannot be read."""
        info = self.backend.mem_get_info(self.device)
        if info is None:
            return -1
        return max(HEADROOM, round(UNACCOUNTED_SHARE * info[1]))

    def run(self, size: Size, role: str, profiler: Any = None) -> Probe:
        backend, device = self.backend, self.device
        self.settle()
        backend.reset_peak(device)
        before = backend.read(device)
        args = (size.n,) if not self.length_axis else (size.n, size.length)
        name = f"cudamem.plan {role} n={size.n}" + (
            "" if size.length is None else f" L={size.length}"
        )
        start = time.perf_counter()
        since = time.time()
        error: str | None = None
        oom = False
        at_oom = before
        # A quiet span: no history entry, no growth check, no OOM post-mortem for a probe
        # that is allowed to fail; its peak folds in every span the step opens.
        span = open_quiet(name, device)
        phases = Phases(device)
        phase_peaks: tuple[int, ...] = ()
        try:
            if profiler is None:
                self.step(*args)
            else:
                with profiler:
                    self.step(*args)
            backend.synchronize(device)
        except BaseException as exc:
            phases.finish(exc)
            close_quiet(span, exc)
            if not backend.is_oom(exc):
                _add_note(exc, self._where(size, role))
                raise
            oom = True
            at_oom = backend.read(device)  # the failed step's tensors still alive
            caught_oom(device, since)  # the plan's, not the user's: no verdict speaks of it
            text = str(exc)
            error = text.splitlines()[0][:200] if text else type(exc).__name__
            requested = parse_oom_message(text).requested
            # The frames of the failed step hold its tensors: clear them, drop the
            # exception (``except ... as`` unbinds it), and collect before the next step.
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        else:
            phase_peaks = phases.finish()
            close_quiet(span)
        seconds = time.perf_counter() - start
        after = backend.read(device)
        if oom:
            self.settle()
            probe = Probe(
                size.n,
                size.length,
                role,
                None,
                None,
                before.allocated,
                seconds,
                True,
                error,
                after.alloc_retries - before.alloc_retries,
                oom_allocated=at_oom.allocated,
                oom_reserved=at_oom.reserved,
                oom_requested=requested,
            )
        else:
            peak = span.peak_total if span.peak_total is not None else after.peak_allocated
            # Reserved never falls inside a step unless the allocator frees its cache to
            # retry a request: its level at the end is its peak even where a module
            # profile's spans reset the peak counters.
            reserved = max(after.reserved, after.peak_reserved)
            probe = Probe(
                size.n,
                size.length,
                role,
                peak,
                reserved,
                before.allocated,
                seconds,
                False,
                None,
                after.alloc_retries - before.alloc_retries,
                phase_peaks if len(phase_peaks) > 1 else (),
            )
        self.probes.append(probe)
        return probe


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11+)."""
    add = getattr(exc, "add_note", None)
    if callable(add):
        add(note)
