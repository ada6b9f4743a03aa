"""The per-module profile's bookkeeping below ``ModuleProfiler``: a module's node (``_Node``),
the record indices of a step and of a module call, the pre-hook of an autograd node that
opens and closes the backward spans of the module calls whose backward starts there
(``_Gate``), and the C++ reader's counter log (``_NativeLog``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..spans.raw import RawSpan
from ..spans.span import open_quiet

_task_id = torch._C._current_graph_task_id


_is_compiling = torch.compiler.is_compiling


_grad_enabled = torch.is_grad_enabled


_Tensor = torch.Tensor


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
        "slot",
        "steps",
        "type_name",
    )

    def __init__(
        self, name: str, module: torch.nn.Module, depth: int, parent: str | None, slot: int
    ) -> None:
        self.name = name
        #: Its index in the profile's nodes (the C++ log adds figures up by it).
        self.slot = slot
        self.type_name = type(module).__name__
        self.depth = depth
        self.parent = parent
        self.module = weakref.ref(module)
        self.notes: tuple[str, ...] = ()
        self.raised = 0
        self.steps: list[tuple[int, ...]] = []
        #: This step's figures (``None`` until the module runs in it).
        self.cur: list[int] | None = None


class _Owner(Protocol):
    """What the gates and the native log use of their ``ModuleProfiler``."""

    _active: bool
    _callback_task: int
    _open_backward: dict[int, list[Any]]
    _stack: list[list[Any]]

    def _backward_started(self, task: int) -> None: ...

    def _end_backward(self, call: list[Any], span: RawSpan) -> None: ...

    def _pre(self, node: _Node, module: torch.nn.Module, args: Any, kwargs: Any) -> None: ...

    def _post(self, node: _Node, module: torch.nn.Module, args: Any, output: Any) -> None: ...


#: Where a node keeps its gate (``grad_fn.metadata``, a dict of the node's own).
_GATE_KEY = "cudamem.modules.gate"


# Indices of a module call's record, a list made by the forward pre-hook and carried to the
# backward: the module's node, its open span (the forward's, then the backward's), whether it
# runs inside a backward (recomputation), bytes its submodules' forwards kept, its first
# grad-requiring input's ``grad_fn`` (where its backward ends; dropped at the forward's exit,
# once a gate holds the call: the record keeps no node alive), its backward's graph task, its
# number in the C++ log (-1: measured by spans), the record of the forward it runs in.
_N, _SPAN, _INBW, _CHILD, _SOURCE, _TASK, _IDX, _PARENT = range(8)


class _Gate:
    """The pre-hook of one autograd node: the module calls whose backward starts (its
    output's ``grad_fn``) or ends (its input's) at that node, run in registration order.

    One gate per node per step: a gate of an earlier step (or profiler) found on a node is
    left to its own calls, and a new one takes the new ones, so that every call's hook lives
    until the second step end after its forward, as it would with a hook of its own."""

    __slots__ = ("edges", "handle", "key", "owner")

    def __init__(self, owner: _Owner, key: object) -> None:
        self.owner = owner
        self.key = key
        #: ``(True, call)``: the call's backward starts here; ``(False, call)``: it ends.
        self.edges: list[tuple[bool, list[Any]]] = []
        self.handle: Any = None

    def fire(self, grad_outputs: Any) -> None:
        owner = self.owner
        for starts, call in self.edges:
            if starts:
                if call[_SPAN] is None and owner._active:
                    task = _task_id()
                    if owner._callback_task != task:
                        owner._backward_started(task)
                    call[_TASK] = task
                    owner._open_backward[id(call)] = call
                    call[_SPAN] = open_quiet(call[_N].name)
            else:
                span = call[_SPAN]
                if span is not None:
                    owner._end_backward(call, span)

    def remove(self) -> None:
        self.key = None  # found on its node later, it takes no more calls
        self.edges = []
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()


class _NativeLog:
    """The C++ log of one profiler (``native.fastread.GateLog``) on one device: its events
    replayed into the module calls' figures, added up per module there; ``fwd``, the
    forward hooks' fast path in C, numbers the calls and knows the step."""

    __slots__ = ("api", "base", "base_old", "device", "fwd", "owner")

    def __init__(self, api: Any, device: int, profiler: _Owner) -> None:
        self.api = api
        self.device = device
        self.owner: int = api.log_start()
        try:
            #: ``fwd.step``: the step the gates registered now belong to (their codes live
            #: two steps); ``fwd.next``: the next call's number.
            self.fwd = api.Forward(
                profiler._stack, profiler._pre, profiler._post, _grad_tensor, self.owner, device
            )
        except BaseException:
            api.log_stop(self.owner)
            raise
        #: The first call of this step and of the step before (calls numbered below it are
        #: gone: two steps old).
        self.base = self.base_old = 0

    def new_step(self) -> None:
        """Gates from here belong to a new step; calls two steps old are let go."""
        self.fwd.step += 1
        self.base_old, self.base = self.base, self.fwd.next

    def stop(self) -> None:
        self.fwd.owner = 0  # its calls go to Python, which sees no log
        self.api.log_stop(self.owner)


def _mark(api: Any, owner: int, device: int, code: int, grad_outputs: Any) -> None:
    """The Python pre-hook of a C++ gate that could not be put on its node."""
    api.mark(owner, device, code)


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
