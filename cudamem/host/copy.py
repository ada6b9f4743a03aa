"""``to_host``: ``detach().cpu()`` for a tensor or a whole structure of them, in one call.

``output.detach()`` cuts the graph but keeps the device memory (seed 000: ten outputs kept
40 MiB on the GPU); ``to_host`` keeps neither. Structures are walked without recursion, so
deep nesting cannot exhaust the stack, and a structure that contains itself comes back
containing its copy, as with ``copy.deepcopy``: every object is converted once, so a
tensor that appears twice is copied once and both places share the copy.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Generator
from typing import Any, Generic, Literal, TypeVar, cast, overload

import torch

from ..allocator import backend as _backend
from ..base.args import check_bool

__all__ = ["HostCopy", "to_host"]

T = TypeVar("T")

_NOTHING: Any = object()


class HostCopy(Generic[T]):
    """A non-blocking copy to the host in flight: ``wait`` returns the result once the
    device has written it. Reading the pinned tensors earlier would show unwritten memory,
    so they are only reachable through ``wait``."""

    __slots__ = ("_events", "_result")

    def __init__(self, result: T, events: list[Any]) -> None:
        self._result = result
        self._events = events

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        backend = _backend.get()
        self._events = [e for e in self._events if not backend.event_done(e)]
        return not self._events

    def wait(self) -> T:
        """Block until the copy has finished and return the host tensors."""
        backend = _backend.get()
        for event in self._events:
            backend.wait_event(event)
        self._events = []
        return self._result

    def __repr__(self) -> str:
        return f"<HostCopy {'pending' if self._events else 'done'}>"


# --------------------------------------------------------------------------- the walk

# A container's conversion is a generator: it yields each child, receives the child's
# converted value, and returns the converted container. The loop in _walk drives them from
# an explicit stack instead of the C stack.
_Step = Generator[Any, Any, Any]


def _empty_like_dict(obj: dict[Any, Any]) -> dict[Any, Any]:
    kind = type(obj)
    if kind is dict:
        return {}
    if issubclass(kind, collections.defaultdict):
        factory = cast("collections.defaultdict[Any, Any]", obj).default_factory
        return collections.defaultdict(factory)
    if issubclass(kind, collections.OrderedDict):
        return collections.OrderedDict()
    try:
        made = kind()
    except Exception:  # a subclass whose constructor needs arguments
        return {}
    return made if isinstance(made, dict) and not made else {}


def _dict_step(obj: dict[Any, Any], memo: dict[int, Any]) -> _Step:
    out = _empty_like_dict(obj)
    memo[id(obj)] = out  # before the children: a cycle back to obj finds out
    for key, value in list(dict.items(obj)):
        out[key] = yield value
    return out


def _list_step(obj: list[Any], memo: dict[int, Any]) -> _Step:
    out: list[Any] = []
    if type(obj) is not list:
        try:
            made = type(obj)()
        except Exception:
            made = None
        if isinstance(made, list) and not made:
            out = made
    memo[id(obj)] = out
    for value in list.copy(obj):
        out.append((yield value))
    return out


def _tuple_step(obj: tuple[Any, ...], memo: dict[int, Any]) -> _Step:
    items = []
    for value in tuple.__iter__(obj):
        items.append((yield value))
    found = memo.get(id(obj), _NOTHING)
    if found is not _NOTHING:
        # A cycle through a list or dict inside this tuple converted the tuple already
        # (as copy.deepcopy does): use that one, so that both places are the same object.
        return found
    kind = type(obj)
    out: Any
    try:
        out = kind(*items) if hasattr(kind, "_fields") else kind(items)
    except Exception:
        out = tuple(items)
    memo[id(obj)] = out
    return out


def _step_for(obj: Any, memo: dict[int, Any]) -> _Step | None:
    kind = type(obj)  # never isinstance: a proxy's __class__ could lie
    if issubclass(kind, dict):
        return _dict_step(obj, memo)
    if issubclass(kind, list):
        return _list_step(obj, memo)
    if issubclass(kind, tuple):
        return _tuple_step(obj, memo)
    return None


def _walk(root: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """Convert ``root``: tensors through ``leaf``, lists/tuples/dicts rebuilt around their
    converted items, anything else returned as it is. Iterative and memoised."""
    memo: dict[int, Any] = {}
    keep: list[Any] = []  # the originals stay alive during the walk: their ids stay unique
    stack: list[_Step] = []
    todo: Any = root
    send: Any = None
    while True:
        if todo is not _NOTHING:
            obj, todo = todo, _NOTHING
            found = memo.get(id(obj), _NOTHING)
            if found is not _NOTHING:
                send = found
            elif issubclass(type(obj), torch.Tensor):
                keep.append(obj)
                send = memo[id(obj)] = leaf(obj)
            else:
                step = _step_for(obj, memo)
                if step is None:
                    send = obj
                else:
                    keep.append(obj)
                    stack.append(step)
                    send = None  # starts the generator
        if not stack:
            return send
        try:
            todo = stack[-1].send(send)
        except StopIteration as stop:
            stack.pop()
            send = stop.value


def _tensor_to_host(
    t: torch.Tensor, *, non_blocking: bool, pin: bool, devices: set[int]
) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda" and (pin or non_blocking):
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=non_blocking)
        if non_blocking:
            devices.add(t.device.index if t.device.index is not None else 0)
        return out
    return t.to("cpu")  # other devices: a blocking copy


@overload
def to_host(obj: T, *, non_blocking: Literal[False] = False, pin: bool | None = None) -> T: ...
@overload
def to_host(obj: T, *, non_blocking: Literal[True], pin: bool | None = None) -> HostCopy[T]: ...
def to_host(obj: Any, *, non_blocking: bool = False, pin: bool | None = None) -> Any:
    """``t.detach().cpu()`` in one call: a host copy that keeps neither the graph nor device
    memory (seed 000: ten outputs kept 40 MiB on the GPU with ``detach()``, 0 with this).

    ``obj`` may be a tensor or a ``list``/``tuple``/``dict`` (nested, namedtuples,
    ``OrderedDict`` and ``defaultdict`` included) of tensors; other leaves are returned as
    they are. CPU tensors come back detached but not copied (they share storage, as
    ``.cpu()`` does). Each object is converted once: a tensor that appears twice is copied
    once, and a structure that contains itself comes back containing its copy (the cycle is
    kept, as ``copy.deepcopy`` keeps it). Nesting depth is not limited by the
    interpreter's recursion limit.

    Args:
        non_blocking: copy CUDA tensors into pinned memory without waiting and return a
            ``HostCopy``; ``.wait()`` gives the result once the copies are done. The
            source may be deleted right away (the allocator is stream-ordered).
        pin: put the copies of CUDA tensors in pinned (page-locked) memory, which copies
            back to the GPU faster. Default: only when ``non_blocking``. ``pin=False`` with
            ``non_blocking=True`` is refused: a non-blocking copy needs pinned memory.

    Raises:
        TypeError: ``non_blocking`` or ``pin`` is not a bool (``pin`` may be ``None``).
        ValueError: ``non_blocking=True`` with ``pin=False``.
    """
    check_bool("non_blocking", non_blocking)
    if pin is not None and not isinstance(pin, bool):
        raise TypeError(f"pin must be a bool or None, not {type(pin).__name__}")
    if non_blocking and pin is False:
        raise ValueError("non_blocking=True copies into pinned memory; pin=False contradicts it")
    devices: set[int] = set()
    pinned = bool(pin) or non_blocking

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return _tensor_to_host(t, non_blocking=non_blocking, pin=pinned, devices=devices)

    result = _walk(obj, leaf)
    if not non_blocking:
        return result
    backend = _backend.get()
    return HostCopy(result, [backend.record_event(d) for d in sorted(devices)])
