"""Spans: ``track()``, ``MemorySpan`` and ``StepSpan``, the quiet spans of cudamem's own
measurements, ``max_allocated``, and the switch between the Python path and the compiled
span core (``open``/``close`` and ``MemorySpan``'s ``with`` methods are the core's while it
serves; see ``core``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from typing_extensions import ParamSpec

from ..allocator import backend as _backend
from ..allocator.device_arg import DeviceLike, resolve_device
from ..base.data import to_data
from ..base.present import PresentedHtml
from ..native import spancore as _spancore
from ..native.states import ExtensionStatus
from . import state as _state
from .core import _Core, core_check, core_table
from .python_path import _merge_peaks, _py_close, _py_open
from .raw import RawSpan
from .record import DeviceSpan, ExceptionInfo, SpanRecord
from .state import STATE, _CloseFn, _OpenFn

if TYPE_CHECKING:
    from .leftovers import LeakReport

__all__ = [
    "MemorySpan",
    "StepSpan",
    "close_quiet",
    "max_allocated",
    "open_quiet",
    "span_core_status",
    "track",
]

# Bound by assignment, not imported by name: see python_path (method calls on them).
_lock = _state._lock
_process_peak = _state._process_peak
_top = _state._top

P = ParamSpec("P")
R = TypeVar("R")


def max_allocated(device: DeviceLike = 0) -> int:
    """The true process-wide peak of allocated bytes on ``device``.

    Use this instead of ``torch.cuda.max_memory_allocated()`` once spans with ``peak=True``
    have run: they reset PyTorch's peak counter on entry, and this function folds back
    what each reset discarded.

    Raises:
        ValueError: ``device`` is not a CUDA device of this process, or torch sees no CUDA
            device at all (then there is no allocator peak to read).
    """
    try:
        index = resolve_device(device)
    except ValueError as exc:
        raise ValueError(f"max_allocated(device={device!r}): {exc}") from None
    current = _backend.get().counters(index)[2]
    with _lock:
        _merge_peaks()
        return max(current, _process_peak.get(index, 0))


# -- the compiled span core ---------------------------------------------------------------


#: What every span opens and closes with: the Python functions above, until the compiled
#: span core (``native/src/spancore/``) is active; then the ``open``/``close`` of its state for this
#: module (``_core_check``), which do the common case (one device, no synchronize) in C and
#: hand every other to ``_py_open``/``_py_close``.
_open: _OpenFn = _py_open
_close: _CloseFn = _py_close


def _core_poll() -> None:
    """One step of the span core's life, at a Python open that read a device (without one,
    as on a machine without CUDA, the core would hand every span back: nothing is built):
    start its build (first call), and once it is built, check it and switch to it. Never
    waits for a compiler."""
    ext = _spancore.EXTENSION
    module = ext.native()
    if module is None:
        if ext.settled():
            STATE.core_poll = None
        return
    STATE.core_poll = None
    problem = _use_core(module)
    if problem is not None:
        ext.drop(problem)


def _use_core(module: Any) -> str | None:
    """Open and close every span through ``module`` (the compiled core; ``None``: the
    Python functions), or say why it cannot serve (then nothing changes). The core serves
    through a state of this module's own (``_core_check``), which the functions installed
    here hold: another ``cudamem.spans`` in the process (a reload) has its own."""
    global _open, _close, _make_span, _columns
    if module is None:
        _open, _close, _make_span, _columns = _py_open, _py_close, _py_make_span, None
        MemorySpan.__enter__ = _py_span_enter  # type: ignore[method-assign]
        MemorySpan.__exit__ = _py_span_exit  # type: ignore[method-assign]
        return None
    core = _core_check(module)
    if isinstance(core, str):
        return core
    _open, _close, _make_span, _columns = core.open, core.close, core.make, core.columns
    MemorySpan.__enter__, MemorySpan.__exit__ = core.enter, core.exit  # type: ignore[method-assign]
    return None


def span_core_status(wait: float = 0.0) -> ExtensionStatus:
    """Which path opens and closes spans, the compiled span core or Python, and why.

    ``wait``: seconds to wait for the core's build first and then switch to it, as the first
    span after a build does (``cudamem status``); by default the state as it is now."""
    if wait > 0:
        _spancore.EXTENSION.wait(wait)
        if STATE.core_poll is not None:
            _core_poll()
    return _spancore.status()


@contextlib.contextmanager
def _serving(module: Any) -> Iterator[None]:
    """Within the block every span opens and closes through ``module`` (the compiled core;
    ``None``: the Python functions), and no poll switches it; afterwards what served
    before serves again (tests and benchmarks compare the two paths with it)."""
    global _open, _close, _make_span, _columns
    saved = (
        _open,
        _close,
        _make_span,
        _columns,
        MemorySpan.__dict__["__enter__"],
        MemorySpan.__dict__["__exit__"],
        STATE.core_poll,
    )
    problem = _use_core(module)
    if problem is not None:
        raise RuntimeError(problem)
    STATE.core_poll = None
    try:
        yield
    finally:
        _open, _close, _make_span, _columns, enter, exit_, STATE.core_poll = saved
        MemorySpan.__enter__, MemorySpan.__exit__ = enter, exit_  # type: ignore[method-assign]


def _core_table() -> tuple[Any, ...]:
    """This machinery's table for the compiled core's ``init`` (``core.core_table``)."""
    return core_table(MemorySpan, _py_span_enter, _py_span_exit)


def _core_check(module: Any) -> _Core | str:
    """The compiled core's state for this machinery, or why it cannot serve
    (``core.core_check`` with ``_core_table()``)."""
    try:
        table = _core_table()
    except Exception as exc:
        return f"the compiled span core failed its check: {type(exc).__name__}: {exc}"
    return core_check(module, table)


# --------------------------------------------------------------------------- public API


class MemorySpan(PresentedHtml):
    """A measured region of code: a context manager, a decorator, and after exit its result.

    ``with cudamem.MemorySpan("step") as span: ...`` then ``span.allocated_delta``,
    ``span.reserved_delta``, ``span.peak``, ``span.peak_delta``, ``span.duration``,
    ``span.devices``, ``span.exception``, ``span.children``. Reading a result before the span
    has closed raises ``RuntimeError``. A span object measures one block: entering it a second
    time raises ``RuntimeError`` (create a new span, or decorate a function, which records one
    span per call). It may be closed on another thread than the one that opened it.
    """

    __slots__ = (
        "__weakref__",
        "_detached",
        "_device",
        "_extras",
        "_leaks",
        "_name",
        "_peak",
        "_raw",
        "_sync",
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        device: DeviceLike | None = None,
        sync: bool = False,
        peak: bool = True,
        leaks: bool = False,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"span name must be a str, not {type(name).__name__}")
        self._name = name
        self._device = None if device is None else resolve_device(device)
        self._sync = bool(sync)
        self._peak = bool(peak)
        self._leaks = bool(leaks)
        #: 0: on the span stack; 1: detached (``StepSpan``); 2: detached, no hooks.
        self._detached = 0
        self._raw: RawSpan | None = None
        #: The hooks' per-span data, kept after exit (``leaks=True`` captures).
        self._extras: dict[str, Any] | None = None

    # -- context manager ------------------------------------------------------------

    def __enter__(self) -> MemorySpan:
        if self._raw is not None:
            self._refuse_reentry()
        if self._detached:
            self._raw = _open(
                self._name or "span",
                self._device,
                self._sync,
                self._peak,
                self._leaks,
                False,
                False,
                hooks=self._detached == 1,
            )
        else:
            self._raw = _open(
                self._name or "span", self._device, self._sync, self._peak, self._leaks
            )
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        raw = self._raw
        if raw is not None:
            _close(raw, exc, self)  # a span closed already (elsewhere) is left alone

    def _refuse_reentry(self) -> None:
        raw = self._raw
        if raw is not None and not raw.closed:
            raise RuntimeError(f"span {self.name!r} is already open; spans cannot be re-entered")
        raise RuntimeError(
            f"span {self.name!r} has already measured a block; create a new span "
            "(or decorate a function to record one span per call)"
        )

    # -- decorator ------------------------------------------------------------------

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Decorate ``func``: every call records its own span named like this one.

        Generator and async-generator functions stay what they are, and their span covers
        the whole iteration (from the first ``next()`` to exhaustion or ``close()``); spans
        opened inside the generator nest under it, spans the consumer opens between items do
        not. ``staticmethod`` and ``classmethod`` objects are unwrapped and rewrapped.
        """
        if isinstance(func, (staticmethod, classmethod)):
            return cast(Callable[P, R], self._rewrap(func))
        if isinstance(func, type):
            raise TypeError(
                f"cudamem.track cannot decorate a class ({func.__qualname__}): decorate its "
                "methods, or wrap the code in `with cudamem.track(...)`"
            )
        if not callable(func):
            raise TypeError(
                f"cudamem.track used as a decorator on a non-callable {type(func).__name__}"
            )
        qualname = getattr(func, "__qualname__", None)
        name = self._name or (qualname if isinstance(qualname, str) else type(func).__qualname__)
        opts = (name, self._device, self._sync, self._peak, self._leaks)
        if inspect.isasyncgenfunction(func):
            return cast(Callable[P, R], _wrap_async_generator(func, opts))
        if inspect.isgeneratorfunction(func):
            return cast(Callable[P, R], _wrap_generator(func, opts))
        if inspect.iscoroutinefunction(func):
            return cast(Callable[P, R], _wrap_coroutine(func, opts))

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            span = _open(*opts)
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                _close(span, exc)
                raise
            _close(span, None)
            return result

        return wrapper

    def _rewrap(self, method: staticmethod[Any, Any] | classmethod[Any, Any, Any]) -> Any:
        """``method``'s function decorated, in a new object of ``method``'s own type; a
        ``TypeError`` saying where ``@cudamem.track`` goes when that cannot be done."""
        kind = type(method).__name__
        hint = f"put @cudamem.track under @{kind}, directly on the function"
        inner = method.__func__
        if not callable(inner) or isinstance(inner, (staticmethod, classmethod)):
            raise TypeError(
                f"cudamem.track cannot decorate a {kind} of a {type(inner).__name__}: {hint}"
            )
        try:
            rebuilt = type(method)(self(inner))
        except Exception as exc:
            raise TypeError(f"cudamem.track cannot rebuild this {kind} ({exc}): {hint}") from exc
        if not isinstance(rebuilt, type(method)) or not callable(rebuilt.__func__):
            raise TypeError(f"cudamem.track cannot rebuild this {kind}: {hint}")
        return rebuilt

    # -- results --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The span's name (``'span'`` when none was given)."""
        return self._name or "span"

    @property
    def closed(self) -> bool:
        """Whether the span has measured its block."""
        return self._raw is not None and self._raw.closed

    @property
    def record(self) -> SpanRecord:
        """The frozen result (raises ``RuntimeError`` while the span is open or unused)."""
        raw = self._raw
        if raw is None or not raw.closed:
            state = "not entered yet" if raw is None else "still open"
            raise RuntimeError(f"span {self.name!r} is {state}; its results exist after exit")
        return raw.record()

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry (summed over devices; 0 if none measured)."""
        return self.record.allocated_delta

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry (summed over devices; 0 if none measured)."""
        return self.record.reserved_delta

    @property
    def peak(self) -> int | None:
        """Highest allocated during the span; ``None`` with ``peak=False`` or when no device
        was measured (no CUDA device)."""
        return self.record.peak

    @property
    def peak_delta(self) -> int | None:
        """Peak minus allocated at entry; ``None`` when ``peak`` is."""
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
        """What the leaks hook captured for this span (``ValueError`` without ``leaks=True``)."""
        self.record  # noqa: B018 - raises while the span is open or unused
        capture = None if self._extras is None else self._extras.get("leaks")
        if not self._leaks or capture is None:
            raise ValueError(
                f"span {self.name!r} did not record storages: use "
                f"cudamem.track({self.name!r}, leaks=True)"
            )
        return capture

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device."""
        return self.record.device(device)

    def to_dict(self) -> dict[str, Any]:
        """The finished span's ``SpanRecord`` as JSON data (``render.json.to_data``)."""

        data: dict[str, Any] = to_data(self.record)
        return data

    def __str__(self) -> str:
        raw = self._raw
        if raw is None or not raw.closed:
            return f"{self.name}: {'not entered' if raw is None else 'open'}"
        return str(raw.record())

    def __repr__(self) -> str:
        return f"<MemorySpan {self}>"


#: MemorySpan's ``with`` methods in Python: while the compiled core serves, its methods
#: replace them and hand these a span entered twice or a detached one.
_py_span_enter = MemorySpan.__enter__
_py_span_exit = MemorySpan.__exit__

_Opts = tuple[str, "int | None", bool, bool, bool]
_new_span = object.__new__


def _wrap_coroutine(func: Callable[..., Awaitable[Any]], opts: _Opts) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        span = _open(*opts)
        try:
            result = await func(*args, **kwargs)
        except BaseException as exc:
            _close(span, exc)
            raise
        else:
            _close(span, None)
        return result

    return wrapper


class _Within:
    """A generator resumed with a span as this thread's (or task's) innermost span:
    ``yield from`` delegates ``send``, ``throw`` and ``close`` here."""

    __slots__ = ("gen", "span")

    def __init__(self, gen: Any, span: RawSpan) -> None:
        self.gen = gen
        self.span = span

    def __iter__(self) -> _Within:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def _resume(self, step: Callable[..., Any], *args: Any) -> Any:
        token = _top.set(self.span)
        try:
            return step(*args)
        finally:
            _top.reset(token)

    def send(self, value: Any) -> Any:
        return self._resume(self.gen.send, value)

    def throw(self, *exc: Any) -> Any:
        return self._resume(self.gen.throw, *exc)

    def close(self) -> None:
        self._resume(self.gen.close)


def _wrap_generator(func: Callable[..., Iterator[Any]], opts: _Opts) -> Callable[..., Any]:
    """A generator function whose one span covers the whole iteration.

    The span is this thread's innermost only while the generator's own code runs (around
    each ``send``/``throw``/``close``), so the consumer's spans between items do not nest
    under it. A consumer that stops early (``close()``) ends the span without an error.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        within = _Within(func(*args, **kwargs), _open(*opts, True, False))
        failure: BaseException | None = None
        try:
            return (yield from within)
        except GeneratorExit:
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _close(within.span, failure)

    return wrapper


def _wrap_async_generator(
    func: Callable[..., AsyncIterator[Any]], opts: _Opts
) -> Callable[..., Any]:
    """The async-generator form of ``_wrap_generator``."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen: Any = func(*args, **kwargs)
        span = _open(*opts, True, False)
        failure: BaseException | None = None
        try:
            sent: Any = None
            thrown: BaseException | None = None
            while True:
                token = _top.set(span)
                try:
                    if thrown is not None:
                        item = await agen.athrow(thrown)
                    else:
                        item = await agen.asend(sent)
                except StopAsyncIteration:
                    return
                finally:
                    thrown = None
                    _top.reset(token)
                try:
                    sent = yield item
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    thrown = exc
        except GeneratorExit:
            token = _top.set(span)
            try:
                await agen.aclose()
            finally:
                _top.reset(token)
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _close(span, failure)

    return wrapper


class StepSpan:
    """A step measured by calls where no ``with`` block fits: the span between two
    optimizer steps (``cudamem run``), a trainer's step callbacks (Lightning,
    Transformers), a pytest test's peak.

    ``start()`` opens a new ``MemorySpan`` and returns it; ``stop(exc)`` closes it (with the
    exception that ended the step, if any, so that an out-of-memory error gets its
    post-mortem as in any ``track()`` block) and returns it, measured; ``drop()`` forgets it
    unrecorded. The span is detached from the span stack: spans the code opens meanwhile
    stay top-level and keep their own history and growth detection. ``hooks=False``: a
    measurement of cudamem's own that no feature sees (no history, no growth detection).
    """

    __slots__ = ("_device", "_hooks", "_name", "_peak", "_span", "_sync")

    def __init__(
        self,
        name: str,
        *,
        device: DeviceLike | None = None,
        sync: bool = False,
        peak: bool = True,
        hooks: bool = True,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"step span name must be a str, not {type(name).__name__}")
        self._name = name
        self._device = None if device is None else resolve_device(device)
        self._sync = bool(sync)
        self._peak = bool(peak)
        self._hooks = bool(hooks)
        self._span: MemorySpan | None = None

    @property
    def running(self) -> bool:
        """Whether a step is open."""
        return self._span is not None

    def start(self) -> MemorySpan:
        """Open a step (``RuntimeError`` while one is open: ``stop()`` it first)."""
        if self._span is not None:
            raise RuntimeError(f"step span {self._name!r} is running; stop() it first")
        span = MemorySpan(self._name, device=self._device, sync=self._sync, peak=self._peak)
        span._detached = 1 if self._hooks else 2
        span.__enter__()
        self._span = span
        return span

    def stop(self, exc: BaseException | None = None) -> MemorySpan | None:
        """Close the open step (``None`` when none is open) and return it."""
        span, self._span = self._span, None
        if span is not None and span._raw is not None:
            _close(span._raw, exc, span, hooks=self._hooks)
        return span

    def drop(self) -> None:
        """Forget the open step without recording it."""
        self._span = None


def open_quiet(name: str, device: int | None = None) -> RawSpan:
    """Open a detached span with a peak, seen by no feature (no history, no growth
    detection, no OOM post-mortem): a measurement of cudamem's own, the per-module
    profile's (``cudamem.modules``) one per module call, ``cudamem.plan``'s one per probe
    step (on its ``device``; by default every device in use). Its peak folds into every open
    span and theirs into it, as any span's does. Close it with ``close_quiet``; then read
    ``alloc_delta``, ``peak_delta``, ``peak_total``, ``level`` and ``duration`` (plain ints
    summed over devices; the peaks are ``None`` when no device was measured). Never raises."""
    return _open(name, device, False, True, False, False, False, hooks=False)


def close_quiet(span: RawSpan, exc: BaseException | None = None) -> None:
    """Close a span of ``open_quiet`` (a closed one is left alone). Never raises."""
    _close(span, exc, hooks=False)


@overload
def track(name: Callable[P, R]) -> Callable[P, R]: ...


@overload
def track(
    name: str | None = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = False,
    peak: bool = True,
    leaks: bool = False,
) -> MemorySpan: ...


def track(
    name: Any = None,
    *,
    device: DeviceLike | None = None,
    sync: bool = False,
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
        sync: synchronize the devices at both edges, so that ``span.duration`` includes
            the GPU time of the block's kernels. The byte counts do not need it: the
            allocator's counters change when the CPU queues an allocation or a free, not
            when the GPU runs it, so a read without synchronize equals the read right after
            one. The default ``False`` leaves CPU/GPU overlap alone.
        peak: track the highest allocated during the span. This resets PyTorch's
            per-device peak counter on entry; use ``cudamem.max_allocated`` for the
            process-wide peak. ``False`` leaves the counter alone (``span.peak`` is None).
        leaks: record which storages exist at entry and exit, so that ``span.leaks`` lists
            those created inside the block and still alive after it, with their holders
            (and ``cudamem.leaks(since=span)`` asks again later). This runs the census twice
            per call: for investigating, not for every step of a long run.

    Generator and async-generator functions are measured over their whole iteration;
    ``staticmethod``/``classmethod`` objects may be decorated. Cost: see the guide's
    "Cost" section (``benchmarks/span_overhead.py`` measures it).
    """
    if name is not None and not isinstance(name, str):
        if callable(name) or isinstance(name, (staticmethod, classmethod)):
            return MemorySpan(None, device=device, sync=sync, peak=peak, leaks=leaks)(name)
        raise TypeError(
            f"cudamem.track() takes a span name (str) or a function to decorate, "
            f"not {type(name).__name__}"
        )
    if device is None:  # the hot form, ``with track("step"):``, skips re-validation
        return _make_span(name, sync, peak, leaks)
    return MemorySpan(name, device=device, sync=sync, peak=peak, leaks=leaks)


def _py_make_span(name: str | None, sync: bool, peak: bool, leaks: bool) -> MemorySpan:
    """``track(name)``'s span, its fields stored without ``__init__``'s checks (``track``
    made them); ``_make_span`` is this, or the compiled core's ``make`` while it serves."""
    span = _new_span(MemorySpan)
    span._name = name
    span._device = span._raw = span._extras = None
    span._detached = 0
    span._sync, span._peak, span._leaks = bool(sync), bool(peak), bool(leaks)
    return span


_make_span: Callable[[str | None, bool, bool, bool], MemorySpan] = _py_make_span
#: The compiled core's fold of a batch of closed spans into the history's sums and maxima
#: (``columns(spans)``, ``None`` for a batch it does not read), while the core serves.
_columns: Callable[[list[RawSpan]], tuple[int, ...] | None] | None = None
#: Until the compiled core is settled, a Python open that read a device asks it again.
STATE.core_poll = _core_poll
