"""What every span's open and close share and what features attach to: the hooks, the queue
of finished spans and its consumer, the registries of open peak spans, the stack, and
``SpanState``, the one object that holds what may be rebound (read by the Python path and,
through its slots, by the compiled core).

Process-wide state: the hot path reads the hook tuples (replaced, never mutated) and the
registry of open peak spans (atomic dict operations) without a lock; ``_lock`` serialises
only folds between threads and merges of the peak inbox.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

from ..base.warn import warn_once
from .raw import RawSpan

__all__ = [
    "FINISHED_AT",
    "MAX_CHILDREN",
    "STATE",
    "EntryHook",
    "ExitHook",
    "SpanState",
    "add_entry_hook",
    "add_exit_hook",
    "finished",
    "remove_entry_hook",
    "remove_exit_hook",
    "set_finished_sink",
]

#: Children kept per span; more are counted in ``SpanRecord.dropped_children``.
MAX_CHILDREN = 256
#: Folded peak values kept before they are merged into the process-wide maximum.
_PEAK_INBOX = 256

EntryHook = Callable[[RawSpan], None]
ExitHook = Callable[[RawSpan], None]

_lock = threading.Lock()
_hooks_lock = threading.Lock()
#: Open spans with ``peak=True`` -> ident of the thread that opened them.
_open_peak: dict[RawSpan, int] = {}
#: Process-wide maximum per device of every peak a reset discarded.
_process_peak: dict[int, int] = {}
#: ``(device, value)`` not yet merged into ``_process_peak`` (appends are atomic).
_peak_inbox: deque[tuple[int, int]] = deque()
_entry_registry: tuple[tuple[EntryHook, bool], ...] = ()
_exit_hooks: tuple[tuple[ExitHook, tuple[type[BaseException], ...]], ...] = ()
#: Exit hooks registered with ``errors_only=True``.
_errors_only: frozenset[ExitHook] = frozenset()
#: The innermost span opened in this thread or task (its ``parent`` chain is the stack).
_top: ContextVar[RawSpan | None] = ContextVar("cudamem_span", default=None)
#: Per-thread cache of the thread's name (looked up once per thread, not once per span;
#: a thread renamed after its first span keeps its first name in records).
_tls = threading.local()


#: Top-level spans closed with hooks, waiting for the consumer ``set_finished_sink`` names
#: (the span history). ``_close`` appends to it itself (atomic, no lock): the history is on
#: every span's path, where an exit hook would cost a Python call per span.
finished: deque[RawSpan] = deque()
#: Spans waiting before the closing thread calls the sink.
FINISHED_AT = 256


class _Keeper(Protocol):
    """What a close hands the hooks' per-span data to (a ``MemorySpan``)."""

    _extras: dict[str, Any] | None


class _OpenFn(Protocol):
    def __call__(
        self,
        name: str,
        device: int | None,
        sync: bool,
        peak: bool,
        leaks: bool,
        nest: bool = ...,
        push: bool = ...,
        *,
        hooks: bool = ...,
    ) -> RawSpan: ...


class _CloseFn(Protocol):
    def __call__(
        self,
        span: RawSpan,
        exc: BaseException | None,
        keeper: _Keeper | None = ...,
        *,
        hooks: bool = ...,
    ) -> None: ...


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the Python span path (cudamem.spans.python_path) is not loaded")


class SpanState:
    """What every open and close reads and what may be rebound meanwhile: the hooks to
    call, the finished spans' consumer, the limits, and the Python open and close that the
    compiled core hands the cases it does not take to. One object, read by the Python path
    as attributes and by the compiled span core through its slots (``_core_table`` hands
    it over once, at ``init``): no module namespace is the core's interface. Each copy of
    this machinery has its own (``STATE``)."""

    __slots__ = (
        "core_poll",
        "entry_hooks",
        "entry_hooks_leaks",
        "exit_calls",
        "exit_calls_ok",
        "finished_at",
        "finished_sink",
        "max_children",
        "peak_inbox_max",
        "py_close",
        "py_open",
    )

    #: The Python open and close: what the compiled core hands every call it does not take.
    py_open: _OpenFn
    py_close: _CloseFn
    #: What every span's open calls, and what a span opened with ``leaks=True`` calls:
    #: ``entry_hooks`` and the hooks registered with ``leaks_only=True`` (which every other
    #: span skips without a call).
    entry_hooks: tuple[EntryHook, ...]
    entry_hooks_leaks: tuple[EntryHook, ...]
    #: The exit hooks alone, what the close of a span whose block raised iterates, and those
    #: a span that did not raise needs (``errors_only`` left out); rebuilt on each
    #: registration.
    exit_calls: tuple[ExitHook, ...]
    exit_calls_ok: tuple[ExitHook, ...]
    #: Called whenever ``finished_at`` spans wait on ``finished`` (``set_finished_sink``).
    finished_sink: Callable[[], None] | None
    #: Children kept per span (``MAX_CHILDREN``).
    max_children: int
    #: One step of the compiled core's life (its build, then the switch to it), asked by a
    #: Python open that read a device until the core is settled (then ``None``).
    core_poll: Callable[[], None] | None
    #: Folded peak values kept before they are merged (``_PEAK_INBOX``).
    peak_inbox_max: int
    #: Spans waiting before the closing thread calls the sink (``FINISHED_AT``).
    finished_at: int

    def __init__(self) -> None:
        self.py_open = self.py_close = _unset
        self.core_poll = None
        self.entry_hooks = self.entry_hooks_leaks = ()
        self.exit_calls = self.exit_calls_ok = ()
        self.finished_sink = None
        self.max_children = MAX_CHILDREN
        self.peak_inbox_max = _PEAK_INBOX
        self.finished_at = FINISHED_AT


#: This machinery's span state: read by both paths (``python_path`` sets its Python open and
#: close when it loads, ``span`` its core poll).
STATE = SpanState()


def set_finished_sink(sink: Callable[[], None] | None) -> None:
    """Queue every top-level span closed with hooks on ``finished`` and call ``sink()``
    whenever ``FINISHED_AT`` wait; ``sink`` takes them off (``None``: stop queueing).
    Errors of ``sink`` are swallowed (a warning says so once)."""
    STATE.finished_sink = sink


def _reset_state() -> None:
    """Forget folded peaks and open spans (tests start each case from here)."""
    with _lock:
        _open_peak.clear()
        _process_peak.clear()
        _peak_inbox.clear()


# -- hooks ------------------------------------------------------------------------------


def add_entry_hook(hook: EntryHook, *, leaks_only: bool = False) -> None:
    """Call ``hook(raw_span)`` when every span opens, after its entry counters are read and
    before the block runs. Errors are swallowed (a warning says so once).

    With ``leaks_only``, only spans opened with ``leaks=True`` call it, and the others do not
    pay for the call. Adding a hook that is registered already changes only its mode (it
    keeps its place in the order).
    """
    global _entry_registry
    with _hooks_lock:
        if any(h is hook for h, _ in _entry_registry):
            _entry_registry = tuple(
                (h, leaks_only if h is hook else only) for h, only in _entry_registry
            )
        else:
            _entry_registry = (*_entry_registry, (hook, leaks_only))
        _rebuild_entry_calls()


def remove_entry_hook(hook: EntryHook) -> None:
    """Undo ``add_entry_hook``."""
    global _entry_registry
    with _hooks_lock:
        _entry_registry = tuple((h, o) for h, o in _entry_registry if h is not hook)
        _rebuild_entry_calls()


def _rebuild_entry_calls() -> None:
    """Derive what opens iterate from the registry; caller holds ``_hooks_lock``."""
    STATE.entry_hooks = tuple(h for h, only in _entry_registry if not only)
    STATE.entry_hooks_leaks = tuple(h for h, _ in _entry_registry)


def add_exit_hook(
    hook: ExitHook,
    *,
    propagate: tuple[type[BaseException], ...] = (),
    errors_only: bool = False,
) -> None:
    """Call ``hook(raw_span)`` after every span closes, in registration order.

    Errors are swallowed (a warning says so once), except instances of ``propagate``: a
    warning class that the user may turn into an error (``-W error``). After every hook has
    run, the first of those is raised from the span's exit, unless the block itself raised.
    With ``errors_only``, the hook runs only for spans whose block raised (``exception`` is
    set), and the spans that did not raise do not pay for calling it.
    """
    global _exit_hooks, _errors_only
    with _hooks_lock:
        if all(h is not hook for h, _ in _exit_hooks):
            _exit_hooks = (*_exit_hooks, (hook, tuple(propagate)))
            if errors_only:
                _errors_only = _errors_only | {hook}
            _rebuild_exit_calls()


def remove_exit_hook(hook: ExitHook) -> None:
    """Undo ``add_exit_hook``."""
    global _exit_hooks, _errors_only
    with _hooks_lock:
        _exit_hooks = tuple((h, p) for h, p in _exit_hooks if h is not hook)
        _errors_only = _errors_only - {hook}
        _rebuild_exit_calls()


def _rebuild_exit_calls() -> None:
    """Derive what closes iterate from the registry; caller holds ``_hooks_lock``."""
    calls = tuple(h for h, _ in _exit_hooks)
    STATE.exit_calls = calls
    STATE.exit_calls_ok = tuple(h for h in calls if h not in _errors_only)


def _exit_hook_failed(
    hook: ExitHook, err: Exception, exc: BaseException | None, pending: BaseException | None
) -> BaseException | None:
    """An exit hook raised: the error to raise from the span's exit (the first warning a
    hook may propagate, unless the block itself raised), or a once-only warning."""
    for h, propagate in _exit_hooks:
        if h is hook:
            if propagate and isinstance(err, propagate):
                return pending or (err if exc is None else None)
            break
    warn_once(f"span:exit-hook{id(hook)}", f"cudamem: span exit hook failed: {err!r}", stacklevel=3)
    return pending
