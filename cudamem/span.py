"""Allocator spans: ``track()`` and ``MemorySpan``.

A span reads the allocator's counters of every device involved when it opens and when it
closes, and freezes the difference into immutable results. While open it collects into a
private ``_OpenSpan``; the public :class:`MemorySpan` exposes only the frozen results.

Peaks: PyTorch keeps one peak counter per device for the whole process. A span with
``peak=True`` resets it on entry (``torch.cuda.reset_peak_memory_stats``) after folding the
value it held into every open span (all threads) and into cudamem's process-wide maximum,
so nested spans never hide each other's peaks; :func:`max_allocated` gives the true
process-wide peak.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from typing_extensions import ParamSpec

from . import _backend
from ._device_arg import DeviceLike, resolve_device
from .stats import AllocatorStats, device_name

if TYPE_CHECKING:  # -- leaks (issue 6) --
    from .leaks import LeakReport

__all__ = [
    "DeviceSpan",
    "ExceptionInfo",
    "MemorySpan",
    "SpanRecord",
    "add_exit_hook",
    "max_allocated",
    "remove_exit_hook",
    "track",
]

P = ParamSpec("P")
R = TypeVar("R")

#: Children kept per span; more are counted in ``SpanRecord.dropped_children``.
MAX_CHILDREN = 256


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    """What one span did on one device. Bytes are ints."""

    device: int
    before: AllocatorStats
    after: AllocatorStats
    #: Highest ``allocated`` during the span, or ``None`` when the span ran with ``peak=False``.
    peak: int | None

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry."""
        return self.after.allocated - self.before.allocated

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry."""
        return self.after.reserved - self.before.reserved

    @property
    def peak_delta(self) -> int | None:
        """Peak during the span minus allocated at entry."""
        return None if self.peak is None else self.peak - self.before.allocated

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "device": device_name(self.device),
            "allocated_delta": self.allocated_delta,
            "reserved_delta": self.reserved_delta,
            "peak": self.peak,
            "peak_delta": self.peak_delta,
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }

    def __str__(self) -> str:
        from .render.text import format_bytes

        text = (
            f"allocated {format_bytes(self.allocated_delta, signed=True)}, "
            f"reserved {format_bytes(self.reserved_delta, signed=True)}"
        )
        if self.peak is not None:
            text += (
                f", peak {format_bytes(self.peak)} ({format_bytes(self.peak_delta, signed=True)})"
            )
        return f"{text} on {device_name(self.device)}"


@dataclass(frozen=True, slots=True)
class ExceptionInfo:
    """An exception that left a span: its type and message, not the object.

    The exception itself is not kept: its traceback references the frames, and through them
    the tensors, that the user is trying to free.
    """

    type_name: str
    message: str
    is_oom: bool

    @classmethod
    def from_exception(cls, exc: BaseException, *, is_oom: bool) -> ExceptionInfo:
        """Describe ``exc`` without keeping it."""
        tp = type(exc)
        try:
            message = str(exc)
        except Exception:
            message = "<message unavailable>"
        return cls(f"{tp.__module__}.{tp.__qualname__}", message[:2000], is_oom)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {"type": self.type_name, "message": self.message, "is_oom": self.is_oom}

    def __str__(self) -> str:
        kind = "out of memory: " if self.is_oom else ""
        short = self.type_name.rsplit(".", 1)[-1]
        first = self.message.splitlines()[0] if self.message else ""
        return f"{short} ({kind}{first[:120]})" if first or kind else short


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """The frozen result of one finished span.

    ``allocated_delta``, ``reserved_delta``, ``peak`` and ``peak_delta`` sum over devices
    (``peak`` is then the sum of per-device peaks; see ``devices`` for each one). ``peak``
    and ``peak_delta`` are ``None`` for spans run with ``peak=False``.
    """

    name: str
    devices: tuple[DeviceSpan, ...]
    #: Wall-clock seconds between entry and exit (cudamem's own reads excluded).
    duration: float
    #: ``time.time()`` at entry.
    started_at: float
    exception: ExceptionInfo | None
    children: tuple[SpanRecord, ...]
    thread: str
    synced: bool
    peak_tracked: bool
    allocated_delta: int
    reserved_delta: int
    peak: int | None
    peak_delta: int | None
    dropped_children: int = 0
    #: Problems of cudamem's own bookkeeping (never raised into the user's code).
    notes: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        name: str,
        devices: tuple[DeviceSpan, ...],
        *,
        duration: float,
        started_at: float = 0.0,
        exception: ExceptionInfo | None = None,
        children: tuple[SpanRecord, ...] = (),
        thread: str = "MainThread",
        synced: bool = True,
        peak_tracked: bool = True,
        dropped_children: int = 0,
        notes: tuple[str, ...] = (),
    ) -> SpanRecord:
        """A record whose totals are computed from ``devices``."""
        alloc = res = peak = peakd = 0
        for d in devices:
            before = d.before.allocated
            alloc += d.after.allocated - before
            res += d.after.reserved - d.before.reserved
            if d.peak is not None:
                peak += d.peak
                peakd += d.peak - before
        return cls(
            name,
            devices,
            duration,
            started_at,
            exception,
            children,
            thread,
            synced,
            peak_tracked,
            alloc,
            res,
            peak if peak_tracked else None,
            peakd if peak_tracked else None,
            dropped_children,
            notes,
        )

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device (``KeyError`` if the span did not see it)."""
        index = device if isinstance(device, int) else resolve_device(device)
        for d in self.devices:
            if d.device == index:
                return d
        seen = ", ".join(device_name(d.device) for d in self.devices) or "none"
        raise KeyError(f"span {self.name!r} saw no {device_name(index)} (devices: {seen})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping, children included."""
        return {
            "name": self.name,
            "allocated_delta": self.allocated_delta,
            "reserved_delta": self.reserved_delta,
            "peak": self.peak,
            "peak_delta": self.peak_delta,
            "duration": self.duration,
            "started_at": self.started_at,
            "thread": self.thread,
            "synced": self.synced,
            "peak_tracked": self.peak_tracked,
            "exception": None if self.exception is None else self.exception.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "children": [c.to_dict() for c in self.children],
            "dropped_children": self.dropped_children,
            "notes": list(self.notes),
        }

    def _repr_html_(self) -> str:
        from .render.notebook import record_html

        return record_html(self)

    def __str__(self) -> str:
        from .render.text import format_duration

        body = "; ".join(str(d) for d in self.devices) or "no CUDA device in use"
        text = f"{self.name}: {body}, {format_duration(self.duration)}"
        if self.exception is not None:
            text += f", raised {self.exception}"
        return text


# --------------------------------------------------------------------------- collection


class _OpenSpan:
    """Mutable collection state of a span while it is open."""

    __slots__ = (
        "before",
        "children",
        "device",
        "dropped_children",
        "folded",
        "name",
        "notes",
        "peak",
        "start_ns",
        "started_at",
        "sync",
    )

    def __init__(self, name: str, device: int | None, sync: bool, peak: bool) -> None:
        self.name = name
        self.device = device
        self.sync = sync
        self.peak = peak
        self.before: dict[int, AllocatorStats] = {}
        self.folded: dict[int, int] = {}
        self.children: list[SpanRecord] | None = None
        self.dropped_children = 0
        self.notes: list[str] | None = None
        self.started_at = 0.0
        self.start_ns = 0

    def fold(self, device: int, value: int) -> None:
        if value > self.folded.get(device, -1):
            self.folded[device] = value

    def note(self, text: str) -> None:
        if self.notes is None:
            self.notes = []
        self.notes.append(text)

    def add_child(self, record: SpanRecord) -> None:
        if self.children is None:
            self.children = []
        if len(self.children) < MAX_CHILDREN:
            self.children.append(record)
        else:
            self.dropped_children += 1


class _State:
    """Process-wide span state: open spans of every thread and folded peaks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[_OpenSpan] = []
        self.process_peak: dict[int, int] = {}
        self.exit_hooks: list[Callable[[SpanRecord, bool], None]] = []
        self.warned: set[str] = set()


_state = _State()

# -- leaks (issue 6) --
#: Span names whose next call the growth detector wants captured (see ``cudamem.leaks``).
#: Replaced, never mutated, so the hot path reads it without a lock.
_leak_names: frozenset[str] = frozenset()
_stack: contextvars.ContextVar[tuple[_OpenSpan, ...]] = contextvars.ContextVar(
    "cudamem_span_stack", default=()
)


def _warn_once(key: str, message: str) -> None:
    if key in _state.warned:
        return
    _state.warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def add_exit_hook(hook: Callable[[SpanRecord, bool], None]) -> None:
    """Call ``hook(record, top_level)`` after every span closes (errors are swallowed)."""
    with _state.lock:
        if hook not in _state.exit_hooks:
            _state.exit_hooks.append(hook)


def remove_exit_hook(hook: Callable[[SpanRecord, bool], None]) -> None:
    """Undo :func:`add_exit_hook`."""
    with _state.lock:
        if hook in _state.exit_hooks:
            _state.exit_hooks.remove(hook)


def _fold_and_reset(backend: _backend.Backend, device: int, counter_peak: int) -> None:
    """Fold the counter's peak into every open span and the process max, then reset it."""
    with _state.lock:
        for other in _state.open:
            if other.peak:
                other.fold(device, counter_peak)
        if counter_peak > _state.process_peak.get(device, -1):
            _state.process_peak[device] = counter_peak
        backend.reset_peak(device)


def max_allocated(device: DeviceLike = 0) -> int:
    """The true process-wide peak of allocated bytes on ``device``.

    Use this instead of ``torch.cuda.max_memory_allocated()`` once spans with ``peak=True``
    have run: they reset PyTorch's peak counter on entry, and this function folds back
    what each reset discarded.
    """
    index = resolve_device(device)
    current = _backend.get().read(index).peak_allocated
    with _state.lock:
        return max(current, _state.process_peak.get(index, 0))


def _enter(span: _OpenSpan) -> None:
    backend = _backend._active
    devices = (span.device,) if span.device is not None else backend.initialized_devices()
    if span.sync:
        for d in devices:
            backend.synchronize(d)
    for d in devices:
        stats = backend.read(d)
        span.before[d] = stats
        if span.peak:
            _fold_and_reset(backend, d, stats.peak_allocated)
            span.folded[d] = stats.allocated


def _exit(span: _OpenSpan) -> tuple[DeviceSpan, ...]:
    backend = _backend._active
    if span.device is not None:
        devices: tuple[int, ...] = (span.device,)
    else:
        devices = backend.initialized_devices()
        if len(devices) != len(span.before) or any(d not in devices for d in span.before):
            devices = tuple(sorted(set(devices) | set(span.before)))
    if span.sync:
        for d in devices:
            if span.device is not None or backend.has_context(d):
                backend.synchronize(d)
    results = []
    for d in devices:
        after = backend.read(d)
        before = span.before.get(d) or AllocatorStats.zero(d, span.start_ns)
        peak: int | None = None
        if span.peak:
            peak = max(span.folded.get(d, before.allocated), after.peak_allocated)
        results.append(DeviceSpan(d, before, after, peak))
    return tuple(results)


# --------------------------------------------------------------------------- public API


class MemorySpan:
    """A measured region of code: a context manager, a decorator, and after exit its result.

    ``with cudamem.MemorySpan("step") as span: ...`` then ``span.allocated_delta``,
    ``span.reserved_delta``, ``span.peak``, ``span.peak_delta``, ``span.duration``,
    ``span.devices``, ``span.exception``, ``span.children``. Reading a result before the span
    has closed raises ``RuntimeError``. A span object measures one block: entering it a second
    time raises ``RuntimeError`` (create a new span, or decorate a function, which records one
    span per call).
    """

    __slots__ = (
        "__weakref__",
        "_detached",
        "_device",
        "_leak",
        "_leaks",
        "_name",
        "_open",
        "_peak",
        "_record",
        "_sync",
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        device: DeviceLike | None = None,
        sync: bool = True,
        peak: bool = True,
        leaks: bool = False,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"span name must be a str, not {type(name).__name__}")
        self._name = name
        self._device = None if device is None else resolve_device(device)
        self._sync = bool(sync)
        self._peak = bool(peak)
        self._open: _OpenSpan | None = None
        self._record: SpanRecord | None = None
        self._detached = False
        self._leaks = bool(leaks)
        # Storage keys at entry while open, the leak capture after exit (issue 6).
        self._leak: Any = None

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> MemorySpan:
        if self._open is not None:
            raise RuntimeError(f"span {self.name!r} is already open; spans cannot be re-entered")
        if self._record is not None:
            raise RuntimeError(
                f"span {self.name!r} has already measured a block; create a new span "
                "(or decorate a function to record one span per call)"
            )
        span = _OpenSpan(self._name or "span", self._device, self._sync, self._peak)
        self._open = span
        try:
            _enter(span)
        except Exception as exc:  # cudamem's bookkeeping must never break the user's code
            span.note(f"entry measurement failed: {type(exc).__name__}: {exc}")
            _warn_once("enter", f"cudamem: span entry measurement failed: {exc!r}")
        if span.peak:
            # Only spans that track peaks need folding when another span resets the counter.
            with _state.lock:
                _state.open.append(span)
        if not self._detached:
            _stack.set((*_stack.get(), span))
        if self._leaks or (_leak_names and span.name in _leak_names):
            from .leaks import begin as _leak_begin

            self._leak = _leak_begin(span.name)
        span.started_at = time.time()
        span.start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        end_ns = time.perf_counter_ns()
        span = self._open
        if span is None:
            return
        try:
            if span.peak:
                with _state.lock, contextlib.suppress(ValueError):
                    _state.open.remove(span)
            stack = _stack.get()
            parent = None
            if stack and stack[-1] is span:
                _stack.set(stack[:-1])
                parent = stack[-2] if len(stack) > 1 else None
            else:  # closed out of order (generators, manual __exit__): find it
                index = next((i for i, s in enumerate(stack) if s is span), None)
                if index is not None:
                    parent = stack[index - 1] if index > 0 else None
                    _stack.set(stack[:index] + stack[index + 1 :])
            try:
                devices = _exit(span)
            except Exception as err:
                span.note(f"exit measurement failed: {type(err).__name__}: {err}")
                _warn_once("exit", f"cudamem: span exit measurement failed: {err!r}")
                devices = ()
            info = None
            if exc is not None:
                info = ExceptionInfo.from_exception(exc, is_oom=_backend._active.is_oom(exc))
            record = SpanRecord.build(
                span.name,
                devices,
                duration=(end_ns - span.start_ns) / 1e9,
                started_at=span.started_at,
                exception=info,
                children=tuple(span.children) if span.children else (),
                thread=threading.current_thread().name,
                synced=span.sync,
                peak_tracked=span.peak,
                dropped_children=span.dropped_children,
                notes=tuple(span.notes) if span.notes else (),
            )
            if self._leaks or self._leak is not None:
                from .leaks import end as _leak_end

                self._leak = _leak_end(span.name, self._leak, explicit=self._leaks)
            self._record = record
            self._open = None
            if parent is not None:
                parent.add_child(record)
            else:
                _record_history(record)
            if _state.exit_hooks:
                for hook in tuple(_state.exit_hooks):
                    try:
                        hook(record, parent is None)
                    except Exception as err:
                        _warn_once(f"hook{id(hook)}", f"cudamem: span hook failed: {err!r}")
        except Exception as err:  # pragma: no cover - last line of defence
            self._open = None
            _warn_once("exit-outer", f"cudamem: span bookkeeping failed: {err!r}")

    def _detach(self) -> None:
        """Open without joining the span stack: a top-level span that never becomes anyone's
        parent (``cudamem run`` uses it for the span between two optimizer steps)."""
        self._detached = True

    # -- decorator ------------------------------------------------------------------

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Decorate ``func``: every call records its own span named like this one."""
        if not callable(func):
            raise TypeError(
                f"cudamem.track used as a decorator on a non-callable {type(func).__name__}"
            )
        name = self._name or getattr(func, "__qualname__", None) or repr(func)
        device, sync, peak, leaks = self._device, self._sync, self._peak, self._leaks

        if inspect.iscoroutinefunction(func):
            afunc = cast(Callable[P, Awaitable[Any]], func)

            @functools.wraps(func)
            async def awrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                with MemorySpan(name, device=device, sync=sync, peak=peak, leaks=leaks):
                    return await afunc(*args, **kwargs)

            return cast(Callable[P, R], awrapper)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with MemorySpan(name, device=device, sync=sync, peak=peak, leaks=leaks):
                return func(*args, **kwargs)

        return wrapper

    # -- results --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The span's name (``'span'`` when none was given)."""
        return self._name or "span"

    @property
    def closed(self) -> bool:
        """Whether the span has measured its block."""
        return self._record is not None

    @property
    def record(self) -> SpanRecord:
        """The frozen result (raises ``RuntimeError`` while the span is open or unused)."""
        if self._record is None:
            state = "still open" if self._open is not None else "not entered yet"
            raise RuntimeError(f"span {self.name!r} is {state}; its results exist after exit")
        return self._record

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry (summed over devices)."""
        return self.record.allocated_delta

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry (summed over devices)."""
        return self.record.reserved_delta

    @property
    def peak(self) -> int | None:
        """Highest allocated during the span; ``None`` with ``peak=False``."""
        return self.record.peak

    @property
    def peak_delta(self) -> int | None:
        """Peak minus allocated at entry; ``None`` with ``peak=False``."""
        return self.record.peak_delta

    @property
    def duration(self) -> float:
        """Seconds the block ran."""
        return self.record.duration

    @property
    def devices(self) -> tuple[DeviceSpan, ...]:
        """Per-device results: devices with a context at entry or exit (or the named one)."""
        return self.record.devices

    @property
    def exception(self) -> ExceptionInfo | None:
        """The exception that left the block, described (``is_oom`` for out of memory)."""
        return self.record.exception

    @property
    def children(self) -> tuple[SpanRecord, ...]:
        """Spans that opened and closed inside this one, on the same thread or task."""
        return self.record.children

    # -- leaks (issue 6) --
    @property
    def leaks(self) -> LeakReport:
        """Storages created inside the block and still alive at its exit, with holders.

        Needs ``leaks=True``; ``cudamem.leaks(since=span)`` asks again later.
        """
        report: LeakReport | None = self._leak_capture().report
        if report is None:  # pragma: no cover - explicit captures always carry a report
            raise RuntimeError(f"span {self.name!r} has no leak report")
        return report

    def _leak_capture(self) -> Any:
        self.record  # noqa: B018 - raises while the span is open or unused
        if not self._leaks or self._leak is None:
            raise ValueError(
                f"span {self.name!r} did not record storages: use "
                f"cudamem.track({self.name!r}, leaks=True)"
            )
        return self._leak

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device."""
        return self.record.device(device)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping of the result."""
        return self.record.to_dict()

    def __str__(self) -> str:
        if self._record is None:
            return f"{self.name}: {'open' if self._open is not None else 'not entered'}"
        return str(self._record)

    def __repr__(self) -> str:
        return f"<MemorySpan {self}>"

    def _repr_html_(self) -> str:
        from .render.notebook import span_html

        return span_html(self)


@overload
def track(name: Callable[P, R]) -> Callable[P, R]: ...


@overload
def track(
    name: str | None = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = True,
    peak: bool = True,
    leaks: bool = False,
) -> MemorySpan: ...


def track(
    name: Any = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = True,
    peak: bool = True,
    leaks: bool = False,
) -> Any:
    """Measure a block or a function: ``with cudamem.track("step") as span:``,
    ``@cudamem.track`` or ``@cudamem.track("fwd")``.

    Args:
        name: the span's name; a function when used as a bare decorator.
        device: measure only this device (``0``, ``'cuda:1'``); by default every device
            that has a CUDA context at entry or exit. Naming a device allows cudamem to
            synchronize it even if that creates its context.
        sync: synchronize the devices before each read (correct numbers; ~7 µs per idle
            device). ``False`` is the cheap mode: allocator counters are updated on the
            host when work is queued, so they are exact for allocations, but the kernels
            may not have run yet.
        peak: track the highest allocated during the span. This resets PyTorch's
            per-device peak counter on entry; use :func:`cudamem.max_allocated` for the
            process-wide peak. ``False`` leaves the counter alone (``span.peak`` is None).
        leaks: record which storages exist at entry and exit, so that ``span.leaks`` lists
            those created inside the block and still alive after it, with their holders
            (and ``cudamem.leaks(since=span)`` asks again later). This runs the census twice
            per call: for investigating, not for every step of a long run.

    Cost (H200, PyTorch 2.11): ~45 µs per span in a tight loop (two raw counter reads of
    ~19 µs each, plus bookkeeping); ~0.13 ms inside a CPU-bound training step, where caches
    are cold. Where the GPU has work queued that time hides behind it; in a launch-bound loop
    of ~1 ms steps it is ~10 %, so measure every Nth step there.
    """
    if name is not None and not isinstance(name, str):
        if callable(name):
            return MemorySpan(None, device=device, sync=sync, peak=peak, leaks=leaks)(name)
        raise TypeError(
            f"cudamem.track() takes a span name (str) or a function to decorate, "
            f"not {type(name).__name__}"
        )
    return MemorySpan(name, device=device, sync=sync, peak=peak, leaks=leaks)


from ._history import record as _record_history  # noqa: E402  (history imports this module)
