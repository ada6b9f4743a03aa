"""``cudamem.plan``: the peak of a training step at any batch size, from a few probe steps.

Collection only: it runs the user's step at a few sizes, each inside a span with its peak,
and hands the peaks to ``cudamem.fit._terms`` (the arithmetic) and ``cudamem.fit.memory_plan`` (the
frozen ``MemoryPlan``); ``render/plan.py`` draws it.

Each step runs after a collection (``_Runner.settle``: a full ``gc.collect()`` only where
the allocated bytes stand above the last level, and at the start only where the model's and
the optimizer's tensors leave more than ``UNACCOUNTED_SHARE`` of the card unexplained; then
the heap the plan found is frozen, ``_frozen_heap``, so that later full collections walk
only the objects made since)
and ``empty_cache()``, so that the reserved peak is
that size's own, with the allocator's peak counters reset, inside a quiet span
(``span.open_quiet``: its peak, and no history entry, growth check or OOM post-mortem). A
step that runs out of memory is recorded; the exception's frames (which hold the step's
tensors) are cleared and the exception dropped before the next step. The largest fitted
probe also runs under the per-module profile (``cudamem.track_modules``) and two forward
hooks of cudamem's own (the order of the modules' forwards, the allocated level at each exit,
the bytes of each output): what checkpointing advice is computed from.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..allocator import backend as _backend
from ..allocator import backend_base as _backend_base
from ..allocator.device_arg import DeviceLike, resolve_device
from ..base.args import check_bool, check_int
from ..base.format import plural
from ..ledger.free_space import Fragmentation
from ..ledger.oom import parse_oom_message
from ..ledger.oom_guard import caught_oom
from ..ledger.reading import fragmentation
from ..modules._tree_bytes import held_bytes
from ..modules.profile import ModuleProfile
from ..modules.profiler import track_modules
from ..spans.span import close_quiet, open_quiet
from ._steps import Outcome, Size, search
from ._terms import HEADROOM, ModuleCost, terms_for
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


# --------------------------------------------------------------------------- restore


def _to_host(value: Any, counter: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        counter[0] += value.numel() * value.element_size()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_host(v, counter)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_host(v, counter) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v, counter) for v in value)
    return copy.deepcopy(value)


class _Saved(NamedTuple):
    model: Any
    optimizer: Any
    grads: list[torch.Tensor | None]
    nbytes: int
    seconds: float


def _save(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> _Saved:
    start = time.perf_counter()
    counter = [0]
    model_state = _to_host(model.state_dict(), counter)
    opt_state = _to_host(optimizer.state_dict(), counter)
    grads = [None if p.grad is None else _to_host(p.grad, counter) for p in model.parameters()]
    return _Saved(model_state, opt_state, grads, counter[0], time.perf_counter() - start)


def _load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: _Saved) -> float:
    start = time.perf_counter()
    model.load_state_dict(saved.model)
    optimizer.load_state_dict(saved.optimizer)
    if not saved.optimizer.get("state"):
        optimizer.state.clear()  # state the probes created (AdamW's moments) goes too
    with torch.no_grad():
        for p, g in zip(model.parameters(), saved.grads, strict=True):
            p.grad = None if g is None else g.to(p.device)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- module order


def _output_bytes(value: Any, seen: set[int], depth: int = 0) -> int:
    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
            key = storage.data_ptr()
        except Exception:
            return 0
        if key in seen:
            return 0
        seen.add(key)
        return int(storage.nbytes())
    if depth > 4:
        return 0
    if isinstance(value, dict):
        return sum(_output_bytes(v, seen, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_output_bytes(v, seen, depth + 1) for v in value)
    return 0


class _Forwards:
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


class _ForwardOrder(_Forwards):
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
            out = _output_bytes(output, set())
            self.exits[id(module)] = (len(self.exits), self._allocated(), out)
        if self._depth == 0 and all(r() is not module for r in self.roots):
            self.roots.append(weakref.ref(module))

    def __enter__(self) -> _ForwardOrder:
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


def _module_costs(order: _ForwardOrder, profile: ModuleProfile, n: int) -> tuple[ModuleCost, ...]:
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


def _shares(profile: ModuleProfile, n: int) -> tuple[ModuleShare, ...]:
    return tuple(
        ModuleShare(row.name, row.type_name, row.depth, row.kept.mean / n, row.self_kept.mean / n)
        for row in profile.modules
        if row.kept.mean > 0
    )


def _fixed_parts(profile: ModuleProfile) -> tuple[tuple[str, int], ...]:
    roots = [row for row in profile.modules if row.depth == 0]
    parts = (
        ("parameters", sum(r.params for r in roots)),
        ("buffers", sum(r.buffers for r in roots)),
        ("optimizer state", sum(r.optimizer for r in roots)),
        ("gradients", sum(r.grads for r in roots)),
    )
    return tuple(p for p in parts if p[1] > 0)


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


# --------------------------------------------------------------------------- probes


class _Phases(_Forwards):
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
def _frozen_heap() -> Iterator[bool]:
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


class _Runner:
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
        phases = _Phases(device)
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
    runner = _Runner(step, backend, index, probe_lengths is not None)
    # the garbage of before the plan collected before the freeze, where there can be any
    held = None
    if model is not None or optimizer is not None:
        optimizers = () if optimizer is None else (optimizer,)
        held = held_bytes(model, optimizers, backend.storage_device_type(), index)
    runner.settle(held)
    start_allocated = backend.read(index).allocated
    with _frozen_heap():
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
    runner: _Runner,
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

    saved = _save(model, optimizer) if restore and model and optimizer else None
    frag: Fragmentation | None = None
    graphs_before = _compiled_graphs()
    profiled: list[tuple[ModuleProfile, _ForwardOrder, tuple[int, int | None]]] = []

    def run(size: Size, role: str, profile: bool) -> Probe:
        if not (modules and profile):
            return runner.run(size, role)
        order = _ForwardOrder(backend, device)
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
            seconds = _load(model, optimizer, saved)
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
    profiled: tuple[ModuleProfile, _ForwardOrder, tuple[int, int | None]] | None,
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
        shares = _shares(profile, at[0])
        parts = _fixed_parts(profile)
        costs = _module_costs(order, profile, at[0])
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
