"""The Python path of a span's open and close (``_py_open``, ``_py_close``) and the rules
both paths share: peaks folded between open spans and into the process-wide maximum, the
stack of open spans, the rare branches (a failed read, a failing hook, a closed parent).
The compiled core does the common case in C and calls these helpers for the rest, so each
rule keeps one home here."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..allocator import backend as _backend
from ..allocator import backend_base as _backend_base
from ..base.warn import warn_once
from . import state as _state
from .raw import _NOTHING, RawSpan
from .raw import now_ns as _now_ns
from .record import ExceptionInfo
from .state import STATE, EntryHook, _exit_hook_failed

__all__: list[str] = []

# The shared containers, bound here by assignment, not imported by name: CPython 3.11 compiles
# a method call on a name an import bound (``_open_peak.pop(...)``) without its method-call
# fast path, which costs the hot path about a tenth.
_lock = _state._lock
_open_peak = _state._open_peak
_peak_inbox = _state._peak_inbox
_process_peak = _state._process_peak
_tls = _state._tls
_top = _state._top
finished = _state.finished

_get_ident = threading.get_ident
_new_raw = object.__new__


def _fold_into(
    target: dict[int, int], devs: tuple[int, ...], vals: tuple[tuple[int, int, int], ...]
) -> None:
    for d, v in zip(devs, vals, strict=True):
        if v[2] > target.get(d, -1):
            target[d] = v[2]


def _only(me: int) -> bool:
    """Whether every open peak span belongs to thread ``me``."""
    owners = tuple(_open_peak.values())
    return owners.count(me) == len(owners)


def _enter_peak(span: RawSpan, backend: _backend_base.Backend, devs: tuple[int, ...]) -> None:
    """Read and reset the peak counters, folding the discarded peaks into the open spans
    (the general case; ``_open`` handles a lone span on one device itself).

    Spans of one thread fold into each other without a lock. When another thread has open
    peak spans, the reset happens under ``_lock``, after any lock-free reset already under
    way has finished, so every fold lands in exactly the spans it belongs to. The caller
    has registered ``span`` in ``_open_peak`` already: announce first, then look, and two
    threads cannot both miss each other.
    """
    me = span.owner
    if _only(me):
        vals = tuple([backend.counters_reset_peak(d) for d in devs])
        for other in tuple(_open_peak):
            if other is not span and other.owner == me:
                if other.fold is None:
                    other.fold = {}
                _fold_into(other.fold, devs, vals)
        span.armed = True
    else:
        span.solo = False
        with _lock:
            # A lock-free reset of a thread that had not seen us yet must finish first.
            while any(o.solo and not o.armed for o in tuple(_open_peak) if o is not span):
                time.sleep(0)
            vals = tuple([backend.counters_reset_peak(d) for d in devs])
            for other in tuple(_open_peak):
                if other is not span and other.armed:
                    if other.xfold is None:
                        other.xfold = {}
                    _fold_into(other.xfold, devs, vals)
            span.armed = True
    span.before = vals
    for d, v in zip(devs, vals, strict=True):
        _peak_inbox.append((d, v[2]))
    if len(_peak_inbox) > STATE.peak_inbox_max:
        _merge_peaks_soon()


def _merge_peaks_soon() -> None:
    """Merge the inbox unless another thread is doing it (it will take ours too)."""
    if _lock.acquire(blocking=False):
        try:
            _merge_peaks()
        finally:
            _lock.release()


def _merge_peaks() -> None:
    """Move the inbox into ``_process_peak``; caller holds ``_lock``."""
    for _ in range(len(_peak_inbox)):
        d, v = _peak_inbox.popleft()
        if v > _process_peak.get(d, -1):
            _process_peak[d] = v


def _tally(span: RawSpan) -> None:
    """The span's own peaks and its totals over devices, as plain ints (general case;
    ``_close`` handles one device seen at both edges itself)."""
    entry = dict(zip(span.devs, span.before, strict=True))
    fold, xfold = span.fold or {}, span.xfold or {}
    track_peak = span.peak
    level = alloc = res = peak_total = peakd = 0
    peaks = []
    for d, (a1, r1, p1) in zip(span.exit_devs, span.after, strict=True):
        a0, r0, _ = entry.get(d, _NOTHING)
        level += a1
        alloc += a1 - a0
        res += r1 - r0
        if track_peak:
            peak = max(p1, a0, fold.get(d, 0), xfold.get(d, 0))
            peaks.append(peak)
            peak_total += peak
            peakd += peak - a0
    span.level, span.alloc_delta, span.res_delta = level, alloc, res
    span.peaks = tuple(peaks) if track_peak else None
    if track_peak and span.after:
        span.peak_total, span.peak_delta = peak_total, peakd
    else:
        span.peak_total = span.peak_delta = None


def _py_open(
    name: str,
    device: int | None,
    sync: bool,
    peak: bool,
    leaks: bool,
    nest: bool = True,
    push: bool = True,
    *,
    hooks: bool = True,
) -> RawSpan:
    """Open a span: read the counters, join this thread's (or task's) stack, run the entry
    hooks (``hooks=False``: a measurement of cudamem's own, which no feature sees, e.g. the
    pytest plugin's per-test peak). Never raises. (``_open``: this, or the compiled span
    core's ``open`` once it is active, which hands every case but the common one here.)"""
    span = _new_raw(RawSpan)  # no __init__: the stores below are the constructor
    span.name = name
    span.device = device
    span.sync = sync
    span.peak = peak
    span.leaks = leaks
    span.parent = span.children = span.extras = span.fold = span.xfold = span._record = None
    span.closed = False
    try:
        backend = _backend._active
        devs: tuple[int, ...]
        if device is not None:
            devs = span.devs = (device,)
        else:
            devs = span.devs = backend.settled_devices or backend.initialized_devices()
        if sync:
            for d in devs:
                backend.synchronize(d)
        if peak:
            me = span.owner = _get_ident()
            span.solo = True
            span.armed = False
            _open_peak[span] = me  # announce (see _enter_peak)
            if len(devs) == 1:
                alone = len(_open_peak) == 1
                if alone or _only(me):  # one device, one thread
                    d = devs[0]
                    fast = backend.fast_reset  # the C++ reader, called without a frame
                    if fast is None:
                        values = backend.counters_reset_peak(d)
                    else:
                        try:
                            values = fast(d)
                        except Exception:  # the method's own fallback answers (or raises)
                            values = backend.counters_reset_peak(d)
                    span.before = (values,)
                    span.armed = True
                    discarded = values[2]
                    if not alone:  # fold into this thread's open spans
                        for other in tuple(_open_peak):
                            if other is not span and other.owner == me:
                                fold = other.fold
                                if fold is None:
                                    other.fold = {d: discarded}
                                elif discarded > fold.get(d, -1):
                                    fold[d] = discarded
                    if discarded > _process_peak.get(d, -1):  # else it cannot raise the max
                        _peak_inbox.append((d, discarded))
                        if len(_peak_inbox) > STATE.peak_inbox_max:
                            _merge_peaks_soon()
                else:
                    _enter_peak(span, backend, devs)
            else:
                _enter_peak(span, backend, devs)
        elif len(devs) == 1:
            span.before = (backend.counters(devs[0]),)
        else:
            span.before = tuple([backend.counters(d) for d in devs])
    except Exception as exc:  # cudamem's bookkeeping must never break the user's code
        _entry_failed(span, exc)
    if nest:
        parent = _top.get()
        if parent is not None:
            if parent.closed:
                parent = _live(parent)
            span.parent = parent
        if push:
            _top.set(span)
    if hooks:
        for hook in STATE.entry_hooks_leaks if leaks else STATE.entry_hooks:
            try:
                hook(span)
            except Exception as err:
                _entry_hook_failed(hook, err)
    span.start_ns = _now_ns()
    poll = STATE.core_poll
    if poll is not None and span.devs:  # a span with a device to read: the core can serve
        poll()
    return span


# The rare branches of an open and a close, one home for both paths (the compiled span
# core calls them too).


def _entry_failed(span: RawSpan, exc: Exception) -> None:
    """The entry measurement raised: the span is measured by nothing and says why."""
    _open_peak.pop(span, None)
    span.armed, span.before, span.devs = True, (), ()
    span.note(f"entry measurement failed: {type(exc).__name__}: {exc}")
    warn_once("span:enter", f"cudamem: span entry measurement failed: {exc!r}", stacklevel=3)


def _entry_hook_failed(hook: EntryHook, err: Exception) -> None:
    warn_once(
        f"span:entry-hook{id(hook)}", f"cudamem: span entry hook failed: {err!r}", stacklevel=3
    )


def _wait_folds() -> None:
    """Wait until a fold of another thread that may be writing into a span has finished."""
    with _lock:
        pass


def _exception_info(exc: BaseException, backend: _backend_base.Backend) -> ExceptionInfo:
    return ExceptionInfo.from_exception(exc, is_oom=backend.is_oom(exc))


def _thread_name() -> str:
    """This thread's name, looked up once per thread (``_tls`` keeps it)."""
    name: str = threading.current_thread().name
    _tls.name = name
    return name


def _drain_finished() -> None:
    """Hand the queue of finished spans to its consumer (errors: a warning, once)."""
    sink = STATE.finished_sink
    if sink is not None:
        try:
            sink()
        except Exception as err:
            warn_once("span:finished", f"cudamem: span history failed: {err!r}")


def _close_failed(span: RawSpan, err: Exception) -> None:
    """The last line of defence of a close: the span ends closed, with every field set."""
    span.closed = True
    _open_peak.pop(span, None)
    for field, empty in _EXIT_FIELDS:
        if not hasattr(span, field):
            setattr(span, field, empty)
    warn_once("span:exit-outer", f"cudamem: span bookkeeping failed: {err!r}", stacklevel=3)


def _py_close(
    span: RawSpan,
    exc: BaseException | None,
    keeper: Any = None,
    *,
    hooks: bool = True,
) -> None:
    """Close a span: read the counters, leave the stack, hand the span to its parent or
    to the exit hooks. The hooks' per-span data moves to ``keeper`` (or is dropped), so
    the history never keeps it. Raises only a warning an exit hook may propagate
    (``-W error``)."""
    if span.closed:
        return
    state = STATE
    pending: BaseException | None = None
    try:
        backend = _backend._active
        span.end_ns = _now_ns()
        after: tuple[tuple[int, int, int], ...]
        try:
            devs = span.devs
            device = span.device
            if device is None:
                if devs is not backend.settled_devices:
                    now = backend.initialized_devices()
                    if now is not devs and now != devs:
                        # A device appeared during the span (or none was in use at entry).
                        devs = tuple(sorted(set(now) | set(devs))) if devs else now
            elif not devs:  # the entry measurement failed
                devs = (device,)
            if span.sync:
                try:
                    for d in devs:
                        if span.device is not None or backend.has_context(d):
                            backend.synchronize(d)
                finally:
                    span.end_ns = _now_ns()
            span.exit_devs = devs
            if len(devs) == 1:
                fast = backend.fast_counters
                if fast is None:
                    after = span.after = (backend.counters(devs[0]),)
                else:
                    try:
                        after = span.after = (fast(devs[0]),)
                    except Exception:
                        after = span.after = (backend.counters(devs[0]),)
            elif devs:
                after = span.after = tuple([backend.counters(d) for d in devs])
            else:
                after = span.after = ()
                span.unmeasured = (
                    "no CUDA device" if backend.device_count() == 0 else "no CUDA device in use"
                )
        except Exception as err:
            span.exit_devs = after = span.after = ()
            span.unmeasured = "measurement failed"
            span.note(f"exit measurement failed: {type(err).__name__}: {err}")
            warn_once("span:exit", f"cudamem: span exit measurement failed: {err!r}", stacklevel=3)
        peak = span.peak
        if peak:
            _open_peak.pop(span, None)
            if _open_peak and not _only(_get_ident()):
                _wait_folds()  # a fold of another thread may still be writing into this span
        if len(after) == 1 and devs is span.devs:  # one device at both edges
            a0, r0, _ = span.before[0]
            a1, r1, p1 = after[0]
            span.level = a1
            span.alloc_delta = a1 - a0
            span.res_delta = r1 - r0
            if peak:
                top = p1 if p1 > a0 else a0
                if span.fold is not None or span.xfold is not None:
                    d = span.devs[0]
                    top = max(top, (span.fold or {}).get(d, 0), (span.xfold or {}).get(d, 0))
                    span.fold = span.xfold = None
                span.peak_total = top  # ``peaks`` is then ``(peak_total,)``, left unstored
                span.peak_delta = top - a0
            else:
                span.peak_total = span.peak_delta = None
        else:
            _tally(span)
            span.fold = span.xfold = None
        span.exception = None if exc is None else _exception_info(exc, backend)
        try:
            span.thread = _tls.name
        except AttributeError:
            span.thread = _thread_name()
        span.closed = True
        parent = span.parent
        if parent is not None and parent.closed:
            parent = _live(parent)
        if _top.get() is span:
            _top.set(parent)
        if parent is not None:
            span.top_level = False
            children = parent.children
            if children is None:
                parent.children = [span]
            elif len(children) < state.max_children:
                children.append(span)
            else:
                parent.dropped = getattr(parent, "dropped", 0) + 1
        else:
            span.top_level = True
            if span.parent is not None or span.children:
                _unlink(span)
            if hooks and state.finished_sink is not None:
                finished.append(span)
                if len(finished) >= state.finished_at:
                    _drain_finished()
        for hook in () if not hooks else state.exit_calls_ok if exc is None else state.exit_calls:
            try:
                hook(span)
            except Exception as err:
                pending = _exit_hook_failed(hook, err, exc, pending)
    except Exception as err:  # pragma: no cover - last line of defence
        _close_failed(span, err)
    extras = span.extras
    if extras is not None:
        if keeper is not None:
            keeper._extras = extras
        span.extras = None
    if pending is not None:
        raise pending


#: What a close sets, with the value a close that failed half-way leaves.
_EXIT_FIELDS: tuple[tuple[str, Any], ...] = (
    ("exit_devs", ()),
    ("after", ()),
    ("level", 0),
    ("alloc_delta", 0),
    ("res_delta", 0),
    ("peaks", None),
    ("peak_total", None),
    ("peak_delta", None),
    ("exception", None),
    ("thread", ""),
    ("top_level", False),
)


def _unlink(top: RawSpan) -> None:
    """Drop the parent pointers of a top-level span's subtree: every ancestor is closed for
    good, so no later walk can need them, and child <-> parent would otherwise be a
    reference cycle left for the garbage collector in every nested span."""
    top.parent = None
    pending = [top]
    while pending:
        children = pending.pop().children
        if children:
            for child in children:
                child.parent = None
                pending.append(child)


def _live(span: RawSpan | None) -> RawSpan | None:
    """``span`` or its nearest ancestor still open."""
    while span is not None and span.closed:
        span = span.parent
    return span


STATE.py_open, STATE.py_close = _py_open, _py_close
