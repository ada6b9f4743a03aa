"""Out-of-memory reports as they happen: from a span's exit while the exception propagates, and
(``on_oom``) from the allocator's OOM observer, which records four numbers inside ``malloc``
and leaves the report to ``OomGuard``'s exception hooks; deduplicated, written to stderr
or a file.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..allocator import backend as _backend
from ..growth.detector import leak_settings
from ..spans.state import add_exit_hook

if TYPE_CHECKING:
    from types import TracebackType

    from ..spans.raw import RawSpan
    from ..spans.record import SpanRecord

from .oom import OomEvent, OomReport, _events, _exc_message, _exc_type_name, build_report

__all__ = ["OomGuard", "caught_oom", "on_oom", "own_ooms"]


_report_lock = threading.Lock()


#: (type, message, per-device OOM counters) of the last report: the same failure seen by
#: nested spans and then by the excepthook is reported once.
_last_key: tuple[Hashable, ...] | None = None


def _dedup_key(exception_type: str, message: str) -> tuple[Hashable, ...]:
    backend = _backend.get()
    try:
        counters = tuple((d, backend.read(d).ooms) for d in backend.initialized_devices())
    except Exception:
        counters = ()
    return (exception_type, message, counters)


def _resolve_file(file: str | os.PathLike[str]) -> Path:
    text = os.fspath(file)
    text = text.replace("{pid}", str(os.getpid())).replace("{rank}", os.environ.get("RANK", "0"))
    return Path(text).expanduser()


def _write(report: OomReport, *, stderr: bool, file: str | os.PathLike[str] | None) -> OomReport:
    path: Path | None = None
    if file is not None:
        path = _resolve_file(file)
        report = replace(report, file=str(path))
    text = str(report)
    if stderr:
        stream: TextIO | None = sys.stderr
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.write(text + "\n")
                stream.flush()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as fh:
                fh.write(text + "\n\n")
        except OSError as exc:
            if sys.stderr is not None:
                sys.stderr.write(f"cudamem: could not write the OOM report to {path}: {exc}\n")
    return report


def _produce(exception_type: str, message: str, source: str) -> OomReport | None:
    """Build, dedupe and write one report with the installed guard's settings."""
    global _last_key
    try:
        key = _dedup_key(exception_type, message)
        with _report_lock:
            if key == _last_key:
                return None
            _last_key = key
        guard = _guard
        top = guard.top if guard is not None else 10
        report = build_report(exception_type, message, source=source, top=top)
        report = _write(
            report,
            stderr=guard.stderr if guard is not None else True,
            file=guard.file if guard is not None else None,
        )
        if guard is not None:
            guard.last_report = report
        return report
    except Exception as exc:  # a post-mortem must never add a second failure
        with contextlib.suppress(Exception):
            sys.stderr.write(f"cudamem: OOM post-mortem failed: {exc!r}\n")
        return None


def _report_from_span(record: SpanRecord) -> None:
    """Exit hook path: an OOM left span ``record``."""
    info = record.exception
    if info is None:
        return
    _produce(info.type_name, info.message, f"span {record.name!r}")


def _on_span_exit(span: RawSpan) -> None:
    """The span exit hook: an OOM left a span (reported while its frames are alive)."""
    info = span.exception
    if info is not None and info.is_oom and leak_settings().span_oom_reports:
        _report_from_span(span.record())


add_exit_hook(_on_span_exit, errors_only=True)


def _report_exception(exc: BaseException | None, source: str) -> None:
    if exc is None:
        return
    try:
        if not _backend.get().is_oom(exc):
            return
    except Exception:
        return
    _produce(_exc_type_name(exc), _exc_message(exc), source)


#: The backends the observer is attached to (the allocator cannot detach one): the real
#: backend once per process; a fake one (tests) of its own.
_observer_on: weakref.WeakSet[object] = weakref.WeakSet()


_observer_active = False


#: Out-of-memory errors cudamem caused and caught itself (``cudamem.plan``'s steps), per
#: backend (the allocator counting them) and device: not the user's, so no verdict or note
#: speaks of them.
_caught: weakref.WeakKeyDictionary[object, dict[int, int]] = weakref.WeakKeyDictionary()


def caught_oom(device: int, since: float) -> None:
    """A step cudamem ran on ``device`` ran out of memory and cudamem caught it: count it
    and drop what the observer recorded of it (at ``time.time()`` ``since`` or later), so
    that ``explain()`` and ``fragmentation()`` judge the user's own OOMs only."""
    counts = _caught.setdefault(_backend.get(), {})
    counts[device] = counts.get(device, 0) + 1
    kept = [ev for ev in _events if ev.device != device or ev.time < since]
    if len(kept) != len(_events):
        _events.clear()
        _events.extend(kept)


def own_ooms(device: int, counted: int) -> int:
    """The allocator's OOM count on ``device`` less those cudamem caught itself."""
    return max(0, counted - _caught.get(_backend.get(), {}).get(device, 0))


def _observer(device: int, requested: int, total: int, free: int) -> None:
    """Runs inside the allocator's ``malloc`` on OOM: record the facts, nothing more."""
    if _observer_active:
        _events.append(OomEvent(int(device), int(requested), int(total), int(free), time.time()))


_guard: OomGuard | None = None


_install_lock = threading.Lock()


class OomGuard(_backend.InstalledHook):
    """Installed OOM post-mortems: returned by ``on_oom``.

    ``guard.uninstall()`` restores the previous hooks and turns history off if cudamem turned
    it on; used as a context manager, the guard also reports an OOM that leaves the block and
    uninstalls itself at the end. If other code replaced cudamem's hook after it was installed,
    that hook is left in place (removing it would break its chain) and cudamem's stays as a
    pass-through.
    """

    _install_lock = _install_lock

    def __init__(
        self,
        file: str | os.PathLike[str] | None,
        *,
        stderr: bool,
        top: int,
        record_history: bool,
        max_entries: int,
    ) -> None:
        super().__init__(record_history=record_history, max_entries=max_entries)
        self.file = file
        self.stderr = stderr
        self.top = top
        self.last_report: OomReport | None = None
        self.notes: list[str] = []
        self._prev_sys: Callable[..., Any] | None = None
        self._prev_thread: Callable[..., Any] | None = None
        self._sys_hook_ref = self._sys_hook
        self._thread_hook_ref = self._thread_hook
        self._ipython: Any = None
        self._ipython_prev: tuple[Any, Any] | None = None

    @property
    def events(self) -> tuple[OomEvent, ...]:
        """OOMs the allocator reported since install, caught by user code or not."""
        return tuple(_events)

    # -- hooks ----------------------------------------------------------------------

    def _sys_hook(
        self, etype: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        prev = self._prev_sys or sys.__excepthook__
        try:
            prev(etype, value, tb)
        finally:
            if self.installed:
                _report_exception(value, "sys.excepthook")

    def _thread_hook(self, args: Any) -> None:
        prev = self._prev_thread or threading.__excepthook__
        try:
            prev(args)
        finally:
            if self.installed:
                name = getattr(args.thread, "name", "?")
                _report_exception(args.exc_value, f"threading.excepthook ({name})")

    def _ipython_handler(
        self, shell: Any, etype: Any, value: Any, tb: Any, tb_offset: Any = None
    ) -> Any:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        if self.installed:
            _report_exception(value, "IPython")
        return None

    def _install(self) -> None:
        global _observer_active
        backend = _backend.get()
        self._prev_sys = sys.excepthook
        sys.excepthook = self._sys_hook_ref
        self._prev_thread = threading.excepthook
        threading.excepthook = self._thread_hook_ref
        self._install_ipython()
        if backend not in _observer_on and backend.attach_oom_observer(_observer):
            _observer_on.add(backend)
        _observer_active = True
        # Installed before asking for history: with CUDA already initialised the request
        # runs at once and checks _wanted(), which reads this flag.
        self.installed = True
        if self._take_history():
            self.notes.append("allocation history was already on: left as it is")

    def _install_ipython(self) -> None:
        ipython_mod = sys.modules.get("IPython")
        get = getattr(ipython_mod, "get_ipython", None)
        shell = get() if callable(get) else None
        if shell is None or not hasattr(shell, "set_custom_exc"):
            return
        if getattr(shell, "custom_exceptions", ()):
            self.notes.append("IPython already has a custom exception handler: left alone")
            return
        oom_types = tuple(
            t
            for t in (getattr(sys.modules.get("torch"), "OutOfMemoryError", None),)
            if isinstance(t, type)
        )
        if not oom_types:
            return
        self._ipython = shell
        self._ipython_prev = (shell.custom_exceptions, shell.CustomTB)
        shell.set_custom_exc(oom_types, self._ipython_handler)

    def _unhook(self) -> None:
        """Restore the hooks that were there before, where they are still cudamem's."""
        global _guard, _observer_active
        if sys.excepthook is self._sys_hook_ref:
            sys.excepthook = self._prev_sys or sys.__excepthook__
        if threading.excepthook is self._thread_hook_ref:
            threading.excepthook = self._prev_thread or threading.__excepthook__
        if self._ipython is not None and self._ipython_prev is not None:
            self._ipython.custom_exceptions, self._ipython.CustomTB = self._ipython_prev
            self._ipython = self._ipython_prev = None
        if _guard is self:
            _guard = None
            _observer_active = False

    def _leaving(self, exc: BaseException | None) -> None:
        """The ``with`` block's end: report an OOM that leaves it."""
        if exc is not None and self.installed:
            _report_exception(exc, "on_oom() block")

    def __repr__(self) -> str:
        where = f", file={os.fspath(self.file)!r}" if self.file is not None else ""
        return f"<OomGuard {self._state()}{where}>"


def on_oom(
    file: str | os.PathLike[str] | None = None,
    *,
    stderr: bool = True,
    top: int = 10,
    record_history: bool = False,
    max_entries: int = 100_000,
) -> OomGuard:
    """Print a post-mortem for every out-of-memory error that reaches the top of a thread.

    Args:
        file: also append each report to this file (``{pid}`` and ``{rank}`` are replaced,
            for one file per process). Spans use it too.
        stderr: write the report to ``sys.stderr``.
        top: how many of the largest live storages to list, with their holders.
        record_history: record allocation history (``_record_memory_history``, Python stacks
            at allocation) so the report says where each large storage was allocated. It
            costs time on every allocation; off again at ``OomGuard.uninstall``.
        max_entries: bound of the history's ring buffer.

    Installs ``sys.excepthook``, ``threading.excepthook`` and (in IPython) a custom exception
    handler, each forwarding to what was there before; the exception is never changed.
    Calling ``on_oom`` again replaces the previous guard. Returns the guard::

        guard = cudamem.on_oom("oom-{pid}.txt")
        ...
        guard.uninstall()

        with cudamem.on_oom("oom.txt"):   # also reports an OOM leaving the block
            train()
    """
    global _guard
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int >= 0, got {top!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    if file is not None and not isinstance(file, (str, os.PathLike)):
        raise TypeError(f"file must be a path, not {type(file).__name__}")
    previous = _guard
    if previous is not None:
        previous.uninstall()
    guard = OomGuard(
        file, stderr=stderr, top=top, record_history=record_history, max_entries=max_entries
    )
    with _install_lock:
        guard._install()
        _guard = guard
    return guard
