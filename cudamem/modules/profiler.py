"""``track_modules()``: where in the model the memory goes, one span per module call.

Collection only: the hooks below turn module calls into spans (``span.open_quiet``: a
detached span with a peak, seen by no feature) and add their figures up per module per
step; ``cudamem.modules.profile`` builds the frozen ``ModuleProfile``, ``render/modules.py``
draws it.

How a call is measured (learned from PyTorch's ``ModTracker``, at span cost instead of a
dispatch mode):

- **Forward.** A forward pre-hook (put first, so the user's own hooks are inside the
  measurement) opens a span; a forward hook registered with ``always_call=True`` closes it,
  also when the forward raised (the exception propagates unchanged). ``kept`` is allocated
  at the forward's exit minus at its entry: what it allocated and still holds, its output
  and the activations autograd saved. The forward's peak is the span's: PyTorch's peak
  counter is reset at each entry and what a reset discards folds into every open span, so
  a parent's peak covers its children's.
- **Backward.** When the forward returned a tensor that requires grad, the module call's
  backward span opens when its output's ``grad_fn`` is about to run (its output's gradient
  is ready) and closes when the ``grad_fn`` of its first input that requires grad is (the
  input's gradient is ready). A module whose inputs need no gradient (an embedding, the
  first convolution) ends with the backward pass itself (an autograd engine callback), as
  every span still open then does. Each autograd node that bounds a call gets one pre-hook
  (a ``_Gate``, kept in the node's ``metadata``), however many calls start or end there: a
  module's input node is its predecessor's output node, a parent's output node its last
  child's, so a step registers about one hook per leaf call instead of two per call; the
  gate runs its calls' edges in the order they were registered.
- **The C++ log.** Where the C++ counter reader serves one device, no span is opened per
  call: the forward hooks log the call's entry and exit (``mark``: a counter read, the peak
  reset) and a node's gate is a C++ pre-hook (``native/src/fastread/``) that logs the edges
  registered at it with no GIL and no Python (a Python hook costs the autograd engine the
  GIL and a tuple of the gradients, about 20 µs a node). Each event has the highest
  allocated since the event before it; the log is replayed at the end of the backward pass
  (one Python pre-hook per top-level call queues the engine callback), at the next
  top-level forward, at ``step()`` and at exit, into exactly the figures a span per call
  would give: the replay keeps the calls open at each event on a stack, as spans nest, and
  adds each ended call to its module's figures in C++ (the entry event carries the
  module's slot and the forward it runs in), which step end takes once (``log_figures``).
  The forward hooks themselves run in C there (``Forward`` in ``native/src/fastread/``): a module's
  hook is a two-line Python function (``is_compiling()`` first, so that dynamo traces it
  and drops it) that calls the C hook, which does what ``_pre`` and ``_post`` do for a call
  inside another one (the stack entry, a list, made and dropped in C; the first
  grad-requiring input's node held from C++, no Python ``grad_fn``; the two marks; the
  gates) and hands the rest to them: a top-level call (where steps begin and end), an
  exception, a forward's entry Python made, anything the C search does not read itself (a
  tensor subclass, a ``ModelOutput``: ``_grad_tensor`` looks). No per-call record is kept
  past the forward's exit.
  Elsewhere (the dict path, several devices, a fake allocator) the forward opens a span and
  the gates are Python hooks that open and close spans.
- **Recomputation.** A forward that runs inside the backward (activation checkpointing
  re-running it) is counted apart: ``recomputes`` and ``recomputed`` (bytes kept at its
  exit), inside the backward spans around it.
- **torch.compile.** Hooks do not run inside compiled code: a ``torch.compile(module)``
  wrapper is measured as one unit (its row says so) and its submodules get no hooks.
- **Steps.** A new step starts when a top-level forward of the model begins after a
  backward pass has finished; after the first ``profiler.step()`` call only ``step()``
  ends steps. Rows give mean and max per step over the steps a module ran in.
- **State bytes** (parameters, buffers, gradients, optimizer state) are read at the end of
  the first backward pass, at the first step end and at exit (largest value kept):
  they do not change from step to step in ordinary training, and reading them walks every
  parameter. Optimizers are those passed in and any whose ``step()`` runs meanwhile.

One thread: module calls of several threads at once (``DataParallel``) are not attributed.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..allocator import backend as _backend
from ..base.format import plural
from ..base.present import PresentedHtml
from ..spans.raw import RawSpan
from ..spans.span import close_quiet, open_quiet
from ._backward import (
    _BCALLS,
    _BDELTA,
    _BNS,
    _BPEAK,
    _CALLS,
    _CHILD,
    _FNS,
    _FPEAK,
    _GATE_KEY,
    _IDX,
    _INBW,
    _KEPT,
    _N,
    _PARENT,
    _RECALLS,
    _REKEPT,
    _SELF,
    _SOURCE,
    _SPAN,
    _STATE_READS,
    _TASK,
    _Gate,
    _grad_enabled,
    _grad_tensor,
    _is_compiling,
    _mark,
    _NativeLog,
    _Node,
    _task_id,
    _Tensor,
)
from ._tree_bytes import StateBytes, state_bytes
from .profile import ModuleProfile, RawModule, build_profile

__all__ = ["ModuleProfiler", "track_modules"]


COMPILED_NOTE = (
    "compiled (torch.compile): measured as one unit; its submodules run inside the "
    "compiled graph, where module hooks do not run"
)


class ModuleProfiler(PresentedHtml):
    """The live profile: a context manager (``with cudamem.track_modules(model) as prof``)
    or ``start()``/``stop()``; ``step()`` ends a step; ``profile`` is the result."""

    def __init__(self, model: torch.nn.Module | None, optimizers: Sequence[Any] = ()) -> None:
        self._model = model
        self._optimizers: list[weakref.ref[Any]] = [weakref.ref(o) for o in optimizers]
        self._nodes: dict[int, _Node] = {}
        #: The nodes by slot.
        self._slots: list[_Node] = []
        self._order: list[tuple[str, weakref.ref[torch.nn.Module], str | None]] = []
        self._handles: list[Any] = []
        self._stack: list[list[Any]] = []
        #: Module calls whose backward span is open, by ``id`` of the call's record.
        self._open_backward: dict[int, list[Any]] = {}
        #: Python gates (and hooks of C++ gates that fell back to Python) registered in this
        #: step and in the one before (removed a step later).
        self._pending: list[Any] = []
        self._pending_old: list[Any] = []
        #: Which gates take new calls: a new key per step (see ``_Gate``).
        self._gate_key = object()
        #: The C++ log (``None``: spans and Python gates), chosen at each step's start.
        self._native: _NativeLog | None = None
        self._touched: list[_Node] = []
        #: Events the C++ log dropped (it was full): the figures miss them.
        self._lost = 0
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
        #: What the module hooks call: the C fast path (``_NativeLog.fwd``) while the C++
        #: log serves, else these.
        self._fwd_pre: Any = self._pre
        self._fwd_post: Any = self._post

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
            self._choose_gates()
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
            self._drop_forward(self._stack.pop())
        self._drop_backward()
        native, self._native = self._native, None
        self._fwd_pre, self._fwd_post = self._pre, self._post
        if native is not None:
            self._replay(native, close=False)
            self._collect(native)
            native.stop()
        for gate in (*self._pending_old, *self._pending):
            gate.remove()
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
        if self._native is not None:
            self._replay(self._native, close=False)
        self._end_step()

    def pause(self) -> None:
        """Leave the module calls that follow out (a validation loop) until ``resume()``."""
        self._set_paused(True)

    def resume(self) -> None:
        """Profile module calls again after ``pause()``."""
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        if self._native is not None:
            self._native.fwd.paused = paused

    @property
    def profile(self) -> ModuleProfile:
        """The result (``RuntimeError`` before the profiler has stopped)."""
        if self._profile is None:
            raise RuntimeError("the module profile exists once the profiler has stopped")
        return self._profile

    @property
    def hooks(self) -> int:
        """Hooks this profiler has installed now (0 once stopped)."""
        return len(self._handles) + len(self._pending_old) + len(self._pending)

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
            node = _Node(name, module, depth, parent, len(self._slots))
            self._nodes[id(module)] = node
            self._slots.append(node)
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
            pre, post = self._hooks(node)
            self._handles.append(
                module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def _hooks(self, node: _Node) -> tuple[Any, Any]:
        """A module's forward pre- and post-hook: past ``is_compiling()`` (dynamo traces
        these and drops them), they call the C fast path while the C++ log serves, else
        ``_pre`` and ``_post``."""

        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if _is_compiling():
                return
            self._fwd_pre(node, module, args, kwargs)

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            if _is_compiling():
                return
            self._fwd_post(node, module, args, output)

        return pre, post

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
            if self._native is not None:  # the same for C++ gates (a pass whose end
                self._replay(self._native, close=False)  # queued no replay)
            if self._auto_steps and self._backward_done:
                self._end_step()
        source = None
        if not in_backward and _grad_enabled():
            first = args[0] if args else None  # the usual case: the first argument
            if first.__class__ is not _Tensor or not first.requires_grad:
                first = _grad_tensor(args)
                if first is None and kwargs:
                    first = _grad_tensor(kwargs)
            if first is not None:
                source = first.grad_fn
            if not self._active:  # the search ran Python (a Mapping's values()) that stopped us
                return
        parent = stack[-1] if stack else None
        native = self._native
        if native is None:
            stack.append([node, open_quiet(node.name), in_backward, 0, source, -1, -1, parent])
            return
        fwd = native.fwd
        idx = fwd.next
        fwd.next = idx + 1
        stack.append([node, None, in_backward, 0, source, -1, idx, parent])
        native.api.mark(  # its forward's entry, its module's slot, the forward it runs in
            native.owner,
            native.device,
            idx * 4,
            node.slot * 2 + in_backward,
            -1 if parent is None else parent[_IDX],
        )

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
        idx = entry[_IDX]
        native = self._native
        if idx < 0:
            span = entry[_SPAN]
            close_quiet(span, exc)
            entry[_SPAN] = None  # the record's span slot is its backward's from here
            kept = span.alloc_delta
            peak = span.peak_delta
            if peak is None:
                peak = 0
                self._unmeasured = getattr(span, "unmeasured", None) or "not measured"
            self._add_forward(entry, kept, peak, span.end_ns - span.start_ns)
        elif native is None:  # the profile stopped inside this forward
            return
        else:
            native.api.mark(native.owner, native.device, idx * 4 + 1)  # its exit
        if exc is not None:
            node.raised += 1
        elif not entry[_INBW] and output is not None:
            out = output if output.__class__ is _Tensor else _grad_tensor(output)
            if out is not None and out.requires_grad:
                start = out.grad_fn
                if start is not None:
                    end = entry[_SOURCE]
                    entry[_SOURCE] = None  # the record outlives the forward: no node in it
                    if idx < 0:
                        self._gate(start).edges.append((True, entry))
                        if end is not None:
                            self._gate(end).edges.append((False, entry))
                        return
                    assert native is not None
                    gate = native.api.gate
                    owner, step, device = native.owner, native.fwd.step, native.device
                    if not gate(start, idx * 4 + 2, owner, step, device):  # backward start
                        self._native_fallback(native, start, idx * 4 + 2)
                    if end is not None and not gate(end, idx * 4 + 3, owner, step, device):
                        self._native_fallback(native, end, idx * 4 + 3)  # its end
                    if not stack:  # a top-level call: its backward starts the pass
                        start.register_prehook(self._native_backward)

    def _add_forward(self, entry: list[Any], kept: int, peak: int, ns: int) -> None:
        """One call's forward figures added to its module's step."""
        node = entry[_N]
        cur = node.cur
        if cur is None:
            cur = node.cur = [0] * 11
            self._touched.append(node)
        if entry[_INBW]:  # re-run inside the backward (activation checkpointing)
            cur[_RECALLS] += 1
            cur[_REKEPT] += kept
            return
        cur[_CALLS] += 1
        cur[_KEPT] += kept
        cur[_SELF] += kept - entry[_CHILD]
        if peak > cur[_FPEAK]:
            cur[_FPEAK] = peak
        cur[_FNS] += ns
        parent = entry[_PARENT]
        if parent is not None:
            parent[_CHILD] += kept

    def _drop_forward(self, entry: list[Any]) -> None:
        """Forget a forward left open (an exception skipped its exit hook, or the profile
        ended inside it): its span closed unrecorded, or its call forgotten by the replay."""
        if entry[_IDX] < 0:
            close_quiet(entry[_SPAN])
        elif self._native is not None:
            self._native.api.log_drop(self._native.owner, entry[_IDX])

    def _unwind(self, node: _Node) -> bool:
        """The innermost open forward is not ``node``'s (an exception that skipped the
        hooks, such as ``KeyboardInterrupt``): close the forwards above ``node``'s; whether
        ``node`` has one open."""
        stack = self._stack
        if all(e[0] is not node for e in stack):
            return False
        while stack[-1][0] is not node:
            self._drop_forward(stack.pop())
        return True

    # -- backward -----------------------------------------------------------------------

    def _gate(self, fn: Any) -> _Gate:
        """The Python gate of autograd node ``fn`` for this step's calls, registered on first
        use (kept on the node: the profile holds no reference to a node, so a graph dies when
        the code drops it)."""
        try:
            meta = fn.metadata
        except Exception:  # a node without metadata: a gate of its own each time
            meta = None
        gate = None if meta is None else meta.get(_GATE_KEY)
        if gate is None or gate.key is not self._gate_key:
            gate = _Gate(self, self._gate_key)
            gate.handle = fn.register_prehook(gate.fire)
            if meta is not None:
                meta[_GATE_KEY] = gate
            self._pending.append(gate)
        return gate

    def _native_fallback(self, native: _NativeLog, fn: Any, code: int) -> None:
        """A node the C++ gates cannot reach: a Python pre-hook logs ``code`` instead
        (removed with the Python gates of its step)."""
        self._pending.append(
            fn.register_prehook(
                functools.partial(_mark, native.api, native.owner, native.device, code)
            )
        )

    def _choose_gates(self) -> None:
        """At a step's start: C++ gates where the C++ reader serves one device."""
        if self._native is not None or not self._active:
            return
        backend = _backend.get()
        api = getattr(backend, "gates", None)
        devices = backend.settled_devices
        if api is None or devices is None or len(devices) != 1:
            return
        try:
            native = _NativeLog(api, devices[0], self)
        except Exception as exc:  # bookkeeping never breaks the user's step
            self._notes.append(f"C++ gates not used: {type(exc).__name__}: {exc}")
            return
        native.fwd.paused = self._paused
        self._native = native
        self._fwd_pre, self._fwd_post = native.fwd.pre, native.fwd.post

    def _native_backward(self, grad_outputs: Any) -> None:
        """A top-level call's backward starts: the engine's callback at the pass's end
        replays the C++ log (one per pass)."""
        if self._native is None or not self._active:
            return
        task = _task_id()
        if self._callback_task != task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._native_ended)

    def _native_ended(self) -> None:
        native = self._native
        self._callback_task = -1
        if native is not None:
            native.api.mark(native.owner, native.device, -2)
            self._replay(native, close=True)
        self._backward_done = True
        if not self._backward_read:
            self._backward_read = True
            self._read_state()

    def _replay(self, native: _NativeLog, *, close: bool) -> None:
        """The C++ log's events since the last replay, into the figures spans would have
        measured, added up per module in C++ (``log_replay`` in ``native/src/fastread/`` keeps the
        calls open at each event on a stack, as spans nest; forwards still running stay open
        for the next replay). ``close``: the backward pass ended, backward calls still open
        end there; else they are dropped unrecorded, as spans a failed backward left open
        are."""
        try:
            lost = native.api.log_replay(
                native.owner, native.base_old, self._active, close, bool(self._stack)
            )
        except Exception as exc:
            self._notes.append(f"C++ gate log not read: {type(exc).__name__}: {exc}")
            return
        self._lost += lost

    def _collect(self, native: _NativeLog) -> None:
        """The figures the C++ log added up since the step began, into the modules' steps."""
        try:
            flat = native.api.log_figures(native.owner)
        except Exception as exc:
            self._notes.append(f"C++ gate log not read: {type(exc).__name__}: {exc}")
            return
        slots, touched = self._slots, self._touched
        for i in range(0, len(flat), 12):
            node = slots[flat[i]]
            cur = node.cur
            if cur is None:
                node.cur = list(flat[i + 1 : i + 12])
                touched.append(node)
                continue
            for field, value in enumerate(flat[i + 1 : i + 12]):
                if field in (_FPEAK, _BPEAK):
                    cur[field] = max(cur[field], value)
                else:
                    cur[field] += value

    def _backward_started(self, task: int) -> None:
        if self._callback_task != task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._backward_ended, task)
            )

    def _backward_ended(self, task: int) -> None:
        """The engine's callback at the end of a backward pass: every backward span of that
        pass still open ends here."""
        for call in [c for c in self._open_backward.values() if c[_TASK] == task]:
            self._end_backward(call, call[_SPAN])
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
            if call[_SPAN] is not None:
                close_quiet(call[_SPAN])
                call[_SPAN] = None
        self._open_backward.clear()
        self._callback_task = -1

    def _end_backward(self, call: list[Any], span: RawSpan) -> None:
        """Close a call's backward span and add it to its module's figures."""
        close_quiet(span)
        call[_SPAN] = None
        self._open_backward.pop(id(call), None)
        self._add_backward(
            call[_N], span.alloc_delta, span.peak_delta or 0, span.end_ns - span.start_ns
        )

    def _add_backward(self, node: _Node, delta: int, peak: int, ns: int) -> None:
        """One call's backward figures added to its module's step."""
        cur = node.cur
        if cur is None:
            cur = node.cur = [0] * 11
            self._touched.append(node)
        cur[_BCALLS] += 1
        cur[_BDELTA] += delta
        if peak > cur[_BPEAK]:
            cur[_BPEAK] = peak
        cur[_BNS] += ns

    # -- steps and state ------------------------------------------------------------------

    def _end_step(self) -> None:
        self._backward_done = False
        if self._native is not None:
            self._collect(self._native)
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
        for gate in self._pending_old:
            gate.remove()
        self._pending_old, self._pending = self._pending, []
        self._gate_key = object()
        if self._native is not None:
            self._native.new_step()
        self._choose_gates()

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
        if self._lost:
            self._notes.append(
                f"figures incomplete: the C++ log was full ({plural(self._lost, 'event')} dropped)"
            )
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
