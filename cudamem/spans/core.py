"""The compiled span core's interface: the one table ``init`` takes (``core_table``, in the
order of ``native/src/spancore/core.h``'s enums) and the check a state passes before it
serves (``core_check``: a span through it has the fields a span through Python has)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..allocator import backend as _backend
from .python_path import (
    _close_failed,
    _drain_finished,
    _enter_peak,
    _entry_failed,
    _entry_hook_failed,
    _exception_info,
    _live,
    _merge_peaks_soon,
    _py_close,
    _py_open,
    _thread_name,
    _unlink,
    _wait_folds,
)
from .raw import RawSpan
from .raw import now_ns as _now_ns
from .state import (
    STATE,
    SpanState,
    _CloseFn,
    _exit_hook_failed,
    _open_peak,
    _OpenFn,
    _peak_inbox,
    _process_peak,
    _tls,
    _top,
    finished,
)

__all__ = ["core_check", "core_table"]

_MISSING = object()
#: The fields a span's open and close set, compared between the two paths by the check.
_CHECKED = (
    "name",
    "device",
    "sync",
    "peak",
    "leaks",
    "parent",
    "children",
    "closed",
    "devs",
    "exit_devs",
    "top_level",
    "exception",
    "thread",
    "peak_total",
    "peak_delta",
    "extras",
)


class _Core(Protocol):
    """The compiled core's state for one span module (``init``'s answer): its functions
    read that module's table (``_core_table``) and make its types' spans."""

    open: _OpenFn
    close: _CloseFn
    make: Callable[[str | None, bool, bool, bool], Any]
    columns: Callable[[list[RawSpan]], tuple[int, ...] | None]
    #: ``MemorySpan.__enter__``/``__exit__`` through the core (method descriptors).
    enter: Any
    exit: Any


#: The fields the compiled core reads and stores by slot, in the order of its ``core.h``
#: enums (``F_``, ``M_``, ``ST_``); ``init`` checks each descriptor's name and type.
_RAW_FIELDS = (
    "name",
    "device",
    "sync",
    "peak",
    "leaks",
    "parent",
    "children",
    "extras",
    "fold",
    "xfold",
    "_record",
    "closed",
    "devs",
    "owner",
    "solo",
    "armed",
    "before",
    "start_ns",
    "end_ns",
    "exit_devs",
    "after",
    "level",
    "alloc_delta",
    "res_delta",
    "peak_total",
    "peak_delta",
    "exception",
    "thread",
    "top_level",
    "dropped",
)
_SPAN_FIELDS = ("_detached", "_device", "_extras", "_leaks", "_name", "_peak", "_raw", "_sync")
_STATE_FIELDS = (
    "py_open",
    "py_close",
    "entry_hooks",
    "entry_hooks_leaks",
    "exit_calls",
    "exit_calls_ok",
    "finished_sink",
    "max_children",
    "peak_inbox_max",
    "finished_at",
)


def _slots(cls: type, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(cls.__dict__[name] for name in names)


def core_table(
    span_type: type, py_enter: Callable[..., Any], py_exit: Callable[..., Any]
) -> tuple[Any, ...]:
    """What the compiled core's ``init`` takes, once: the one interface between it and this
    module, in the order of ``core.h``'s ``T_`` enum (its types, its state, where the
    active backend is held, the slots it reads, the Python helpers it calls, the containers
    it mutates in place, and whether ``_now_ns`` is ``time.perf_counter_ns``). ``span_type``
    is its ``MemorySpan``, ``py_enter``/``py_exit`` that type's Python ``with`` methods."""
    return (
        RawSpan,
        span_type,
        STATE,
        _slots(RawSpan, _RAW_FIELDS),
        _slots(span_type, _SPAN_FIELDS),
        _slots(SpanState, _STATE_FIELDS),
        vars(_backend),
        "_active",
        # the helpers (``FN_``)
        py_enter,
        py_exit,
        _merge_peaks_soon,
        _enter_peak,
        _entry_failed,
        _entry_hook_failed,
        _exit_hook_failed,
        _close_failed,
        _live,
        _wait_folds,
        _exception_info,
        _thread_name,
        _unlink,
        _drain_finished,
        _now_ns,
        # the containers
        _open_peak,
        _process_peak,
        _peak_inbox,
        finished,
        _top,
        _tls,
        _now_ns is time.perf_counter_ns,
    )


def core_check(module: Any, table: tuple[Any, ...]) -> _Core | str:
    """The compiled core's state for this module, or why it cannot serve: ``module.init``
    takes ``table`` (``core_table``'s), and a quiet span (no peak, no stack, no hooks)
    through the state has the fields and arithmetic a span through the Python path has."""
    try:
        core: _Core = module.init(table)
        backend = _backend._active
        device = 0 if backend.device_count() > 0 else None
        spans = []
        for opener, closer in ((_py_open, _py_close), (core.open, core.close)):
            raw = opener("cudamem-check", device, False, False, False, False, False, hooks=False)
            closer(raw, None, hooks=False)
            spans.append(raw)
        for field in _CHECKED:
            ours, theirs = (getattr(raw, field, _MISSING) for raw in spans)
            if ours != theirs:
                return f"the compiled span core's {field} differs ({theirs!r}, not {ours!r})"
        for raw in spans:
            if raw.after and raw.alloc_delta != raw.after[0][0] - raw.before[0][0]:
                return "the compiled span core's allocated delta is not after - before"
        return core
    except Exception as exc:
        return f"the compiled span core failed its check: {type(exc).__name__}: {exc}"
