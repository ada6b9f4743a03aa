"""``cudamem.plan``: the peak of a training step at any batch size, from a few probe steps.

Collection only: ``plan`` checks its arguments, runs the search of ``_steps.py`` with
``_runner.py``'s ``Runner`` (each step in a quiet span with its peak, after a collection
and ``empty_cache()``; a step that runs out of memory recorded, its frames cleared), the
largest fitted probe also under the per-module profile (``cudamem.track_modules``) and
``_forwards.py``'s forward order (what checkpointing advice is computed from), and hands the
peaks to ``cudamem.fit._terms`` (the arithmetic) and ``cudamem.fit.memory_plan`` (the frozen
``MemoryPlan``); ``render/plan.py`` draws it. Before the first step, a full collection
where the model's and the optimizer's tensors leave more than ``UNACCOUNTED_SHARE`` of the
card unexplained; then the heap the plan found is frozen (``frozen_heap``), so that later
full collections walk only the objects made since. ``restore=True`` copies the model's and
the optimizer's state to the host first (``_restore.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..allocator import backend as _backend
from ..allocator.device_arg import DeviceLike, resolve_device
from ..base.args import check_bool, check_int
from ..base.format import plural
from ..ledger.free_space import Fragmentation
from ..ledger.reading import fragmentation
from ..modules._tree_bytes import held_bytes
from ..modules.profile import ModuleProfile
from ..modules.profiler import track_modules
from ._forwards import ForwardOrder, fixed_parts, module_costs, module_shares
from ._restore import load_state, save_state
from ._runner import Runner, frozen_heap
from ._steps import Outcome, Size, search
from ._terms import ModuleCost, terms_for
from .memory_plan import MemoryPlan, ModuleShare, NotLinearError, Probe, RestoreCost, device_memory

__all__ = ["plan"]

#: The generic cause named when the check fails and nothing more specific was seen.
SHAPES_CAUSE = (
    "shapes that depend on n other than through the batch dimension (dynamic shapes, "
    "padding to the longest sample, a data-dependent branch)"
)


# --------------------------------------------------------------------------- arguments


def _sizes(name: str, value: Any, *, minimum_count: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of positive ints, not {type(value).__name__}")
    out = tuple(check_int(f"{name}[{i}]", v, minimum=1) for i, v in enumerate(value))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must be distinct, got {list(out)}")
    if len(out) < minimum_count:
        raise ValueError(f"{name} needs at least {plural(minimum_count, 'value')}, got {len(out)}")
    return tuple(sorted(out))


def _check_size(value: Any, sizes: tuple[int, ...], lengths: tuple[int, ...] | None) -> Size | None:
    """The check step's size: ``True`` twice the largest probe (on a length axis: the
    largest size at twice the largest length), ``False`` none, an int the size, a pair
    ``(n, length)``."""
    if value is True:
        if lengths is None:
            return Size(2 * sizes[-1], None)
        return Size(sizes[-1], 2 * lengths[-1])
    if value is False:
        return None
    if isinstance(value, tuple) and lengths is not None and len(value) == 2:
        return Size(
            check_int("check[0]", value[0], minimum=1), check_int("check[1]", value[1], minimum=1)
        )
    if lengths is not None:
        raise TypeError("check must be a bool or an (n, length) pair on a plan with lengths=")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"check must be a bool or a batch size (int), not {type(value).__name__}")
    return Size(check_int("check", value, minimum=1), None)


# --------------------------------------------------------------------------- causes


def _compiled_graphs() -> int | None:
    """Graphs torch.compile has compiled in this process (``None``: dynamo not loaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return None
    try:
        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


def _causes(probes: Sequence[Probe], graphs_before: int | None) -> tuple[str, ...]:
    causes = []
    if torch.backends.cudnn.benchmark:
        causes.append(
            "cuDNN benchmark mode chooses convolution algorithms, and their workspaces, by "
            "input shape (torch.backends.cudnn.benchmark=True)"
        )
    graphs = _compiled_graphs()
    if graphs is not None and graphs_before is not None and graphs > graphs_before:
        causes.append(
            f"torch.compile compiled {plural(graphs - graphs_before, 'new graph')} during the "
            "probes: "
            "it recompiles per batch size (mark the batch dimension dynamic)"
        )
    for p in probes:
        if p.retries:
            causes.append(
                f"the allocator freed its cache to serve a request at batch {p.n}: memory "
                "pressure, not the step's own peak"
            )
            break
    causes.append(SHAPES_CAUSE)
    return tuple(causes)


def _unmeasured_plan(reason: str) -> MemoryPlan:
    return MemoryPlan(0, (), None, None, 1.0, None, unmeasured=reason)


def plan(
    step: Callable[..., Any],
    sizes: Sequence[int] = (4, 8),
    *,
    lengths: Sequence[int] | None = None,
    check: bool | int | tuple[int, int] = True,
    confirm: bool = True,
    max_batch: int | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    restore: bool = False,
    modules: bool = True,
    device: DeviceLike | None = None,
) -> MemoryPlan:
    """Measure a training step at a few batch sizes and fit its peak as a line in ``n``.

    ``step(n)`` is your own function: one full training step at batch size ``n`` (data,
    forward, backward, optimizer step). cudamem runs it once at the smallest size as a
    warm-up (it creates the optimizer state and workspaces; not fitted), then at each of
    ``sizes`` (fitted), then once at the check size (twice the largest probe) to test the
    line, then once at the answer for the memory this process can use (the confirming
    step): five step executions where the probes resolve the per-sample bytes, ten at most.
    Every step runs in a span that records its peak, after a garbage collection (a full
    one only where the allocated bytes stand above where the last one left them) and
    ``empty_cache()``. Before the first, a full collection frees the garbage of before the
    plan, unless ``model`` and ``optimizer`` account for all the allocated bytes but half
    a percent of the card (garbage could hold no more): on the heap of a process that
    imported transformers and lightning it takes 210-310 ms.

    Where the per-sample bytes are under a tenth of the peak at the largest probe (the
    fixed part swamps them), the probes grow sixteen-fold until they are not, each within
    half the memory. A check off the line leads to larger probes and a second check before
    the plan refuses. A confirming step that runs out of memory is caught and recorded and
    the next aims lower; ``largest()`` on this card then never names a batch past the
    largest step that ran (``cudamem.fit._steps`` states the rules).

    With ``lengths=(L1, L2, ...)`` the step is ``step(n, length)`` and the peak is fitted
    as ``a + n*(b + c*L + d*L**2)``: two lengths fit the ``n*L`` and ``n*L**2`` terms (a
    sample of length 0 costs nothing), three or more all four. Probes: every size at the
    shortest length, then the smallest size at each other length; the check runs the
    largest size at twice the longest length. Eager attention is quadratic in ``L``; SDPA
    nearly linear.

    Args:
        step: ``step(n)`` (or ``step(n, length)``), one training step.
        sizes: the probe batch sizes, at least two distinct positive ints.
        lengths: probe sequence lengths (a second axis), or ``None``.
        check: the check step: ``True`` (the default size), ``False`` (none: the plan then
            cannot tell whether the step is linear), a batch size, or ``(n, length)``.
        confirm: run confirming steps at the answer (not on a length axis). ``False``:
            four steps, and ``largest()`` answers from the line past the steps that ran.
        max_batch: the largest batch the step can run (the dataset's length): no step runs
            past it and ``largest()`` never names more.
        model: the model the step trains; needed for ``restore``. It also names the
            modules of the per-module profile (without it, every module tree the step
            calls is profiled).
        optimizer: the optimizer the step steps; needed for ``restore``.
        restore: put the model's and the optimizer's state (and gradients) back as they
            were before the probes: their state is copied to host memory first (the
            copy's bytes and seconds are in ``MemoryPlan.restore``). RNG state is not
            restored. Without it the probes are real training steps.
        modules: profile the largest probe per module (what ``MemoryPlan.modules`` and
            ``checkpointing()`` read).
        device: the device to measure (default: the current one).

    A probe that runs out of memory is recorded (larger probes are then skipped); the
    failed step's frames are cleared before the next. After the plan, nothing of the
    probes stays allocated beyond what the step itself keeps (``kept_after``). Without a
    CUDA device nothing runs: the plan says so (``unmeasured``).

    Raises:
        TypeError, ValueError: a bad argument, named.
    """
    if not callable(step):
        raise TypeError(
            "step must be callable: a function step(n) that runs one training step at "
            f"batch size n, not {type(step).__name__}"
        )
    fitted = _sizes("sizes", sizes, minimum_count=2)
    probe_lengths = None if lengths is None else _sizes("lengths", lengths, minimum_count=1)
    check_size = _check_size(check, fitted, probe_lengths)
    check_bool("restore", restore)
    check_bool("modules", modules)
    check_bool("confirm", confirm)
    most = None if max_batch is None else check_int("max_batch", max_batch, minimum=fitted[-1])
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}"
        )
    if restore and (model is None or optimizer is None):
        raise ValueError(
            "restore=True needs model= and optimizer=: their state is copied to the host "
            "before the probes and loaded back after them"
        )
    backend = _backend.get()
    if backend.device_count() == 0:
        return _unmeasured_plan("no CUDA device")
    index = backend.current_device() if device is None else resolve_device(device)
    runner = Runner(step, backend, index, probe_lengths is not None)
    # the garbage of before the plan collected before the freeze, where there can be any
    held = None
    if model is not None or optimizer is not None:
        optimizers = () if optimizer is None else (optimizer,)
        held = held_bytes(model, optimizers, backend.storage_device_type(), index)
    runner.settle(held)
    start_allocated = backend.read(index).allocated
    with frozen_heap():
        return _collect(
            runner,
            start_allocated,
            fitted,
            probe_lengths,
            check_size,
            model,
            optimizer,
            restore,
            modules,
            confirm,
            most,
        )


def _schedule(sizes: tuple[int, ...], lengths: tuple[int, ...] | None) -> list[Size]:
    if lengths is None:
        return [Size(n, None) for n in sizes]
    first = [Size(n, lengths[0]) for n in sizes]
    return first + [Size(sizes[0], length) for length in lengths[1:]]


def _collect(
    runner: Runner,
    start_allocated: int,
    sizes: tuple[int, ...],
    lengths: tuple[int, ...] | None,
    check_size: Size | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    restore: bool,
    modules: bool,
    confirm: bool,
    max_batch: int | None,
) -> MemoryPlan:
    backend, device = runner.backend, runner.device
    length_axis = lengths is not None
    read: list[tuple[int | None, int | None, str | None]] = []

    def memory() -> int | None:
        # NVML's free plus this process's reserved: the same whether the cache is emptied
        # or not (no gc.collect() needed here)
        read.append(device_memory(device))
        return read[-1][0]

    saved = save_state(model, optimizer) if restore and model and optimizer else None
    frag: Fragmentation | None = None
    graphs_before = _compiled_graphs()
    profiled: list[tuple[ModuleProfile, ForwardOrder, tuple[int, int | None]]] = []

    def run(size: Size, role: str, profile: bool) -> Probe:
        if not (modules and profile):
            return runner.run(size, role)
        order = ForwardOrder(backend, device)
        profiler = track_modules(model, optimizer=optimizer)
        with order:
            probe = runner.run(size, role, profiler)
        if not probe.oom:
            profiled.append((profiler.profile, order, (size.n, size.length)))
        return probe

    try:
        outcome = search(
            run,
            _schedule(sizes, lengths),
            terms_for(len(lengths) if lengths is not None else 1),
            check_size,
            memory,
            adaptive=not length_axis,
            confirm=confirm,
            max_batch=max_batch,
        )
        # The cache as the largest step left it (its peaks still in the counters): what
        # fragmentation costs at that size, before the cache is emptied below.
        frag = _fragmentation_after(device, outcome.notes, runner.probes)
    finally:
        restored: RestoreCost | None = None
        if saved is not None and model is not None and optimizer is not None:
            seconds = load_state(model, optimizer, saved)
            restored = RestoreCost(saved.nbytes, saved.seconds + seconds)
            del saved
        runner.settle()
    kept_after = backend.read(device).allocated - start_allocated
    available, capacity, why = read[-1] if read else device_memory(device)
    if why is not None:
        outcome.notes.append(why)
    plan = _analyse(
        device,
        tuple(runner.probes),
        outcome,
        length_axis,
        profiled[-1] if profiled else None,
        restored,
        kept_after,
        graphs_before,
    )
    plan = replace(
        plan,
        confirm=confirm and not length_axis,
        capacity=capacity,
        max_batch=max_batch,
        available=available,
        fragmentation=frag,
    )
    largest_now = None
    if available is not None and plan.allocated_line is not None and not length_axis:
        try:
            largest_now = plan.largest(memory=available)
        except (NotLinearError, RuntimeError):
            largest_now = None
    return replace(plan, largest_now=largest_now)


def _fragmentation_after(
    device: int, notes: list[str], probes: Sequence[Probe]
) -> Fragmentation | None:
    """``cudamem.fragmentation`` of the device right after the last step, its peaks the
    last step's own (the phases' spans reset the counters' peaks inside the step); ``None``
    (and a note) where the allocator's snapshot cannot be read."""
    try:
        frag = fragmentation(device)
    except Exception as exc:  # a snapshot torch cannot take must not lose the plan
        notes.append(f"fragmentation not measured: {type(exc).__name__}: {exc}")
        return None
    last = probes[-1] if probes else None
    if last is None or last.oom or last.allocated is None:
        return frag
    return replace(frag, peak_allocated=last.allocated, peak_reserved=last.reserved)


def _analyse(
    device: int,
    probes: tuple[Probe, ...],
    outcome: Outcome,
    length_axis: bool,
    profiled: tuple[ModuleProfile, ForwardOrder, tuple[int, int | None]] | None,
    restored: RestoreCost | None,
    kept_after: int,
    graphs_before: int | None,
) -> MemoryPlan:
    notes = list(outcome.notes)
    lines = outcome.lines
    # the largest step with memory to spare: a confirming step ran at the limit
    measured = [p for p in probes if not p.oom and p.allocated and p.role != "confirm"]
    last = max(measured, key=lambda p: (p.n, p.length or 0), default=None)
    ratio = 1.0 if last is None else max(1.0, (last.reserved or 0) / (last.allocated or 1))
    check = outcome.check
    causes = _causes(probes, graphs_before) if check is not None and not check.linear else ()
    if outcome.recovered:
        sizes = ", ".join(str(n) for n in outcome.recovered)
        notes.append(
            f"the check at batch {sizes} landed off the line; the line was fitted again from "
            "larger steps (small batches are where cuDNN picks other algorithms and tensors "
            "live in the allocator's small pool)"
        )
    shares: tuple[ModuleShare, ...] = ()
    costs: tuple[ModuleCost, ...] = ()
    parts: tuple[tuple[str, int], ...] = ()
    at: tuple[int, int | None] | None = None
    if profiled is not None:
        profile, order, at = profiled
        shares = module_shares(profile, at[0])
        parts = fixed_parts(profile)
        costs = module_costs(order, profile, at[0])
        if profile.unmeasured:
            notes.append(f"module profile: {profile.unmeasured}")
    return MemoryPlan(
        device,
        probes,
        None if lines is None else lines.allocated,
        None if lines is None else lines.reserved,
        ratio,
        check,
        length_axis,
        causes,
        shares,
        parts,
        costs,
        at,
        restored,
        kept_after,
        notes=tuple(notes),
        phase_lines=() if lines is None else lines.phases,
        allowance=outcome.allowance,
        resolved=outcome.resolved if lines is not None else None,
        recovered=tuple(outcome.recovered),
        fitted=tuple((p.n, p.length) for p in outcome.fitted) if lines is not None else (),
    )
