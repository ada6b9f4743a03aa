"""``cudamem.modules`` as it was before issue 36 (tree of 3568a98), frozen for the before/after
comparison of ``benchmarks/module_cost.py``: per-module closures, two ``grad_fn`` pre-hooks and
a ``_Backward`` object registered per module call. Not imported by cudamem; do not edit."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cudamem.base.present import PresentedHtml
from cudamem.modules._tree_bytes import StateBytes, state_bytes
from cudamem.modules.profile import ModuleProfile, RawModule, build_profile
from cudamem.spans.raw import RawSpan
from cudamem.spans.span import close_quiet, open_quiet

__all__ = ["ModuleProfiler", "track_modules"]

_task_id = torch._C._current_graph_task_id
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor

COMPILED_NOTE = (
    "compiled (torch.compile): measured as one unit; its submodules run inside the "
    "compiled graph, where module hooks do not run"
)
#: State bytes are read at the end of the first backward pass and at the first step end
#: (after the first ``optimizer.step()``: its state exists), then at exit.
_STATE_READS = 2

# Indices of a step record (``module_profile.STEP_FIELDS``).
_CALLS, _KEPT, _SELF, _FPEAK, _FNS, _BCALLS, _BDELTA, _BPEAK, _BNS, _RECALLS, _REKEPT = range(11)


class _Node:
    """One module's bookkeeping: names and the figures of the step in progress."""

    __slots__ = (
        "cur",
        "depth",
        "module",
        "name",
        "notes",
        "parent",
        "raised",
        "steps",
        "type_name",
    )

    def __init__(self, name: str, module: torch.nn.Module, depth: int, parent: str | None) -> None:
        self.name = name
        self.type_name = type(module).__name__
        self.depth = depth
        self.parent = parent
        self.module = weakref.ref(module)
        self.notes: tuple[str, ...] = ()
        self.raised = 0
        self.steps: list[tuple[int, ...]] = []
        #: This step's figures (``None`` until the module runs in it).
        self.cur: list[int] | None = None


class _Backward:
    """One forward call's backward: the span between its output's gradient and its
    input's, opened and closed by autograd node pre-hooks."""

    __slots__ = ("__weakref__", "handles", "node", "owner", "span", "task")

    def __init__(self, owner: ModuleProfiler, node: _Node) -> None:
        self.owner = owner
        self.node = node
        self.span: RawSpan | None = None
        self.task = -1
        self.handles: list[Any] = []

    def start(self, grad_outputs: Any) -> None:
        owner = self.owner
        if self.span is None and owner._active:
            task = _task_id()
            owner._backward_started(task)
            self.task = task
            owner._open_backward[id(self)] = self
            self.span = open_quiet(self.node.name)

    def end(self, grad_inputs: Any) -> None:
        span = self.span
        if span is not None:
            close_quiet(span)
            self.span = None
            owner = self.owner
            owner._open_backward.pop(id(self), None)
            owner._record_backward(self.node, span)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _grad_tensor(value: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor, a tuple/list, a dict or a ``ModelOutput``)
    that requires grad, looking two levels deep."""
    if isinstance(value, _Tensor):
        return value if value.requires_grad else None
    if depth < 2:
        if isinstance(value, (tuple, list)):
            items: Any = value
        elif isinstance(value, Mapping):
            items = value.values()
        else:
            return None
        for item in items:
            found = _grad_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


class ModuleProfiler(PresentedHtml):
    """The live profile: a context manager (``with cudamem.track_modules(model) as prof``)
    or ``start()``/``stop()``; ``step()`` ends a step; ``profile`` is the result."""

    def __init__(self, model: torch.nn.Module | None, optimizers: Sequence[Any] = ()) -> None:
        self._model = model
        self._optimizers: list[weakref.ref[Any]] = [weakref.ref(o) for o in optimizers]
        self._nodes: dict[int, _Node] = {}
        self._order: list[tuple[str, weakref.ref[torch.nn.Module], str | None]] = []
        self._handles: list[Any] = []
        self._stack: list[list[Any]] = []
        self._open_backward: dict[int, _Backward] = {}
        self._pending: list[_Backward] = []
        self._pending_old: list[_Backward] = []
        self._touched: list[_Node] = []
        self._callback_task = -1
        self._backward_done = False
        self._auto_steps = True
        self._steps = 0
        self._state: dict[str, list[int]] = {}
        self._state_reads = 0
        self._backward_read = False
        self._notes: list[str] = []
        self._unmeasured: str | None = None
        self._active = False
        self._paused = False
        self._used = False
        self._profile: ModuleProfile | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> ModuleProfiler:
        """Install the hooks (``RuntimeError`` if this profiler ran already)."""
        if self._used:
            raise RuntimeError("a module profiler runs once; call cudamem.track_modules() again")
        self._used = self._active = True
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer))
            if self._model is not None:
                self._adopt(self._model)
            else:
                from torch.nn.modules.module import register_module_forward_pre_hook

                self._handles.append(register_module_forward_pre_hook(self._discover))
        except BaseException:
            self._remove_hooks()
            self._active = False
            raise
        return self

    def stop(self) -> ModuleProfile:
        """Remove every hook, end the step in progress and build the profile."""
        if self._profile is not None:
            return self._profile
        self._active = False
        self._remove_hooks()
        while self._stack:  # forwards left open (the profile closed inside one)
            close_quiet(self._stack.pop()[1])
        self._drop_backward()
        for call in (*self._pending_old, *self._pending):
            call.remove()
        self._pending_old, self._pending = [], []
        self._end_step()
        self._read_state()
        self._profile = self._build()
        return self._profile

    def __enter__(self) -> ModuleProfiler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def step(self) -> None:
        """End the step in progress. From the first call on, only ``step()`` ends steps."""
        self._auto_steps = False
        self._end_step()

    def pause(self) -> None:
        """Leave the module calls that follow out (a validation loop) until ``resume()``."""
        self._paused = True

    def resume(self) -> None:
        """Profile module calls again after ``pause()``."""
        self._paused = False

    @property
    def profile(self) -> ModuleProfile:
        """The result (``RuntimeError`` before the profiler has stopped)."""
        if self._profile is None:
            raise RuntimeError("the module profile exists once the profiler has stopped")
        return self._profile

    @property
    def hooks(self) -> int:
        """Hooks this profiler has installed now (0 once stopped)."""
        return len(self._handles) + sum(
            len(c.handles) for c in (*self._pending_old, *self._pending)
        )

    @property
    def running(self) -> bool:
        """Whether the hooks are installed (started, not stopped)."""
        return self._active

    @property
    def result(self) -> ModuleProfile | None:
        """The profile once stopped, else ``None`` (``profile`` raises instead)."""
        return self._profile

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the model's modules --------------------------------------------------------

    def _adopt(self, root: torch.nn.Module) -> None:
        """Name ``root``'s modules and hook them (not inside a compiled wrapper)."""
        base = type(root).__name__
        skip: list[str] = []
        for path, module in root.named_modules():
            if id(module) in self._nodes:
                continue
            if any(not s or path == s or path.startswith(s + ".") for s in skip):
                continue
            name = f"{base}.{path}" if path else base
            parent = None if not path else (f"{base}.{path.rpartition('.')[0]}".rstrip("."))
            depth = path.count(".") + 1 if path else 0
            node = _Node(name, module, depth, parent)
            self._nodes[id(module)] = node
            self._order.append((name, weakref.ref(module), parent))
            if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
                node.notes = (COMPILED_NOTE,)
                skip.append(path)
            elif getattr(module, "_compiled_call_impl", None) is not None:
                self._notes.append(
                    f"{name} was compiled in place (module.compile()): its calls run inside "
                    "compiled code, where module hooks do not run; profile "
                    "torch.compile(module) to see it as one unit"
                )
                skip.append(path)
                continue
            self._handles.append(
                module.register_forward_pre_hook(
                    functools.partial(self._pre, node), prepend=True, with_kwargs=True
                )
            )
            self._handles.append(
                module.register_forward_hook(functools.partial(self._post, node), always_call=True)
            )

    def _discover(self, module: torch.nn.Module, args: Any) -> None:
        """Without a model: a module called outside every profiled forward is a new root."""
        if _is_compiling() or self._stack or id(module) in self._nodes:
            return
        self._adopt(module)
        node = self._nodes.get(id(module))
        if node is not None and not node.notes:
            self._pre(node, module, args, {})  # its own pre-hook missed this call

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if all(ref() is not optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    # -- forward ------------------------------------------------------------------------

    def _pre(self, node: _Node, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if _is_compiling() or self._paused:  # tracing first: dynamo sees a constant
            return
        stack = self._stack
        in_backward = _task_id() != -1
        if not stack and not in_backward:
            if self._open_backward:  # a backward pass that raised never reached its end
                self._drop_backward()
            if self._auto_steps and self._backward_done:
                self._end_step()
        source = None
        if not in_backward and _grad_enabled():
            first = _grad_tensor(args)
            if first is None and kwargs:
                first = _grad_tensor(kwargs)
            if first is not None:
                source = first.grad_fn
        stack.append([node, open_quiet(node.name), in_backward, 0, source])

    def _post(self, node: _Node, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _is_compiling():
            return
        stack = self._stack
        if not stack:
            return
        if stack[-1][0] is not node and not self._unwind(node):
            return
        entry = stack.pop()
        exc = sys.exc_info()[1] if output is None else None
        span = entry[1]
        close_quiet(span, exc)
        cur = node.cur
        if cur is None:
            cur = node.cur = [0] * 11
            self._touched.append(node)
        kept = span.alloc_delta
        peak = span.peak_delta
        if peak is None:
            peak = 0
            self._unmeasured = getattr(span, "unmeasured", None) or "not measured"
        if entry[2]:  # re-run inside the backward (activation checkpointing)
            cur[_RECALLS] += 1
            cur[_REKEPT] += kept
        else:
            cur[_CALLS] += 1
            cur[_KEPT] += kept
            cur[_SELF] += kept - entry[3]
            if peak > cur[_FPEAK]:
                cur[_FPEAK] = peak
            cur[_FNS] += span.end_ns - span.start_ns
            if stack:
                stack[-1][3] += kept
        if exc is not None:
            node.raised += 1
        elif not entry[2] and output is not None:
            out = _grad_tensor(output)
            if out is not None and out.grad_fn is not None:
                self._watch(node, out.grad_fn, entry[4])

    def _unwind(self, node: _Node) -> bool:
        """The innermost open forward is not ``node``'s (an exception that skipped the
        hooks, such as ``KeyboardInterrupt``): close the forwards above ``node``'s; whether
        ``node`` has one open."""
        stack = self._stack
        if all(e[0] is not node for e in stack):
            return False
        while stack[-1][0] is not node:
            close_quiet(stack.pop()[1])
        return True

    # -- backward -----------------------------------------------------------------------

    def _watch(self, node: _Node, start: Any, end: Any) -> None:
        call = _Backward(self, node)
        call.handles.append(start.register_prehook(call.start))
        if end is not None:
            call.handles.append(end.register_prehook(call.end))
        self._pending.append(call)

    def _backward_started(self, task: int) -> None:
        if self._callback_task != task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._backward_ended, task)
            )

    def _backward_ended(self, task: int) -> None:
        """The engine's callback at the end of a backward pass: every backward span of that
        pass still open ends here."""
        for call in [c for c in self._open_backward.values() if c.task == task]:
            call.end(None)
        if self._callback_task == task:
            self._callback_task = -1
        self._backward_done = True
        if not self._backward_read:
            self._backward_read = True
            self._read_state()

    def _drop_backward(self) -> None:
        """Close, unrecorded, the backward spans a failed backward pass left open (else
        every later span would fold its peak into them)."""
        for call in list(self._open_backward.values()):
            if call.span is not None:
                close_quiet(call.span)
                call.span = None
        self._open_backward.clear()
        self._callback_task = -1

    def _record_backward(self, node: _Node, span: RawSpan) -> None:
        cur = node.cur
        if cur is None:
            cur = node.cur = [0] * 11
            self._touched.append(node)
        cur[_BCALLS] += 1
        cur[_BDELTA] += span.alloc_delta
        peak = span.peak_delta or 0
        if peak > cur[_BPEAK]:
            cur[_BPEAK] = peak
        cur[_BNS] += span.end_ns - span.start_ns

    # -- steps and state ------------------------------------------------------------------

    def _end_step(self) -> None:
        self._backward_done = False
        touched, self._touched = self._touched, []
        if touched:
            self._steps += 1
            for node in touched:
                if node.cur is not None:
                    node.steps.append(tuple(node.cur))
                    node.cur = None
            if self._state_reads < _STATE_READS:
                self._read_state()
        # Backward hooks of forwards two steps old will not fire any more: drop them.
        for call in self._pending_old:
            call.remove()
        self._pending_old, self._pending = self._pending, []

    def _read_state(self) -> None:
        self._state_reads += 1
        modules = [(n, m, p) for n, ref, p in self._order if (m := ref()) is not None]
        optimizers = [o for ref in self._optimizers if (o := ref()) is not None]
        try:
            found = state_bytes(modules, optimizers)
        except Exception as exc:  # bookkeeping never breaks the user's step
            self._notes.append(f"state bytes not read: {type(exc).__name__}: {exc}")
            return
        for name, values in found.items():
            best = self._state.setdefault(name, [0, 0, 0, 0])
            for i, v in enumerate(values):
                if v > best[i]:
                    best[i] = v

    def _build(self) -> ModuleProfile:
        raws = []
        for node in self._nodes.values():
            raws.append(
                RawModule(
                    node.name,
                    node.type_name,
                    node.depth,
                    node.parent,
                    tuple(node.steps),
                    node.raised,
                    node.notes,
                )
            )
        state = {name: StateBytes(*v) for name, v in self._state.items()}
        return build_profile(
            raws, self._steps, state, unmeasured=self._unmeasured, notes=self._notes
        )


def track_modules(
    model: torch.nn.Module | None = None,
    *,
    optimizer: Any = None,
) -> ModuleProfiler:
    """Profile a model's memory per module: ``with cudamem.track_modules(model) as prof:``
    around one or more training steps, then ``print(prof.profile)``.

    Args:
        model: the model whose modules are profiled (every submodule, named as PyTorch's
            ``MemTracker`` names them: ``GPT2LMHeadModel.transformer.h.0``). ``None``:
            every module tree the code calls from the top (what ``cudamem run --modules``
            does).
        optimizer: an optimizer, or a sequence of them, whose state is attributed to the
            modules owning its parameters (optimizers whose ``step()`` runs during the
            profile are found without it).

    Per module, per step (mean and max): forward calls, bytes its forward kept (activations
    saved for the backward, its output included), the same less its submodules', its peak
    above its entry level in forward and in backward, bytes re-run forwards kept during the
    backward (activation checkpointing), host time; and its parameter, buffer, gradient and
    optimizer-state bytes. Leaving the block removes every hook.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, not {type(model).__name__}")
    if optimizer is None:
        optimizers: tuple[Any, ...] = ()
    elif isinstance(optimizer, (list, tuple)):
        optimizers = tuple(optimizer)
    else:
        optimizers = (optimizer,)
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a sequence of them, "
                f"not {type(opt).__name__}"
            )
    return ModuleProfiler(model, optimizers)
