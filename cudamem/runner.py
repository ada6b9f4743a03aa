"""``cudamem run script.py``: run a user's script as ``python script.py`` would, watched.

The script runs in this process as ``__main__`` (same ``sys.argv``, ``sys.path[0]``, exit
code). Training steps are found without code changes through PyTorch's global optimizer-step
hooks: the time between two ``optimizer.step()`` calls is one ``training step`` span, so
growth detection watches it like any span the script opens itself. At exit, or on an uncaught
out-of-memory error, the report is collected *while the script's ``__main__`` module is still
installed*, so holders read ``__main__.loss_history[3]`` rather than an anonymous dict.

Collection only: :class:`RunReport` is frozen data, rendered by ``render/report.py`` (text)
and ``render/html.py``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _backend
from .span import ExceptionInfo, MemorySpan

__all__ = ["RunReport", "ScriptError", "StepWatcher", "run_script"]

STEP_SPAN = "training step"


class ScriptError(Exception):
    """The script could not be started (missing, unreadable, not Python)."""


@dataclass(frozen=True, slots=True)
class RunReport:
    """What ``cudamem run`` learned about one run of a script."""

    script: str
    argv: tuple[str, ...]
    exit_code: int
    duration: float
    exception: ExceptionInfo | None
    #: The uncaught exception's traceback as Python prints it (cudamem's frames removed).
    traceback: str | None
    #: ``optimizer.step()`` calls seen (training steps).
    steps: int
    #: Highest allocated bytes per CUDA device during the run (process-wide).
    peaks: tuple[tuple[int, int], ...]
    #: Leak warnings raised during the run, in order.
    leak_warnings: tuple[str, ...]
    #: Span names those warnings were about.
    leak_names: tuple[str, ...]
    #: The largest storages still alive at exit, with holders (a ``Census``), or None.
    live: Any
    #: The ``explain()`` ledger at exit, or None without a GPU.
    ledger: Any
    #: The OOM post-mortem, when the script died of one.
    oom: Any
    #: Finished top-level spans (the script's own and the training steps).
    history: Any
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""

        def dump(obj: Any) -> Any:
            return None if obj is None else obj.to_dict()

        return {
            "script": self.script,
            "argv": list(self.argv),
            "exit_code": self.exit_code,
            "duration": self.duration,
            "exception": dump(self.exception),
            "traceback": self.traceback,
            "steps": self.steps,
            "peaks": {f"cuda:{d}": b for d, b in self.peaks},
            "leak_warnings": list(self.leak_warnings),
            "leak_names": list(self.leak_names),
            "live": dump(self.live),
            "ledger": dump(self.ledger),
            "oom": dump(self.oom),
            "history": dump(self.history),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.report import render_report

        return render_report(self)


class StepWatcher:
    """Turns ``optimizer.step()`` calls into ``training step`` spans (no code changes).

    The span between two steps is opened detached from the span stack, so spans the script
    opens itself stay top-level and keep their own history and growth detection.
    """

    def __init__(self, name: str = STEP_SPAN) -> None:
        self.name = name
        self.steps = 0
        self._span: MemorySpan | None = None
        self._handle: Any = None

    def install(self) -> None:
        """Register the global optimizer-step hook."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # torch < 2.0 has no global hooks
            return
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self.close()
        span = MemorySpan(self.name, sync=False, peak=False)
        span._detach()
        span.__enter__()
        self._span = span

    def close(self) -> None:
        """Close the step in progress (an unfinished step is not a finished call)."""
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)

    def uninstall(self) -> None:
        """Remove the hook; the step in progress is dropped, not recorded."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._span = None


class _LeakCollector:
    """Records every LeakWarning shown while the script runs, then shows it as usual."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.names: list[str] = []
        self._show: Callable[..., None] = warnings.showwarning

    def install(self) -> None:
        self._show = warnings.showwarning
        warnings.showwarning = self._record

    def uninstall(self) -> None:
        if warnings.showwarning == self._record:
            warnings.showwarning = self._show

    def _record(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        from .leaks import LeakWarning

        if isinstance(category, type) and issubclass(category, LeakWarning):
            self.messages.append(str(message))
            growth = getattr(message, "growth", None)
            name = getattr(growth, "name", None)
            if isinstance(name, str) and name not in self.names:
                self.names.append(name)
        self._show(message, category, *args, **kwargs)


def _exit_code(exc: SystemExit) -> tuple[int, str | None]:
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def _script_traceback(exc: BaseException) -> str:
    """The traceback as Python would print it, starting at the script's own frames."""
    tb = exc.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    while (
        tb is not None and os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == here
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _collect(
    top: int,
    with_ledger: bool,
    notes: list[str],
) -> tuple[Any, Any, tuple[tuple[int, int], ...]]:
    from .census import Census, live_tensors, storages_with_keys
    from .span import max_allocated

    live = ledger = None
    try:
        # Holders only for the storages listed: the search is the expensive part.
        census = live_tensors()
        listed = storages_with_keys([s.key for s in census.storages[:top]], holders=True)
        extra = census.notes
        if len(census) > top:
            rest = len(census) - top
            more = sum(s.nbytes for s in census.storages[top:])
            extra = (*extra, f"{rest} smaller storages ({more} bytes) not listed")
        live = Census(listed, extra, census.elapsed)
    except Exception as exc:
        notes.append(f"census failed: {type(exc).__name__}: {exc}")
    backend = _backend.get()
    peaks = []
    for d in backend.initialized_devices():
        try:
            peaks.append((d, max_allocated(d)))
        except Exception as exc:
            notes.append(f"peak of cuda:{d} unavailable: {exc}")
    if with_ledger and backend.initialized_devices():
        try:
            from .ledger import explain

            ledger = explain()
        except Exception as exc:
            notes.append(f"explain() failed: {type(exc).__name__}: {exc}")
    return live, ledger, tuple(peaks)


def run_script(
    path: str,
    args: Sequence[str] = (),
    *,
    top: int = 10,
    ledger: bool = True,
    progress: Callable[[str], None] | None = None,
) -> RunReport:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and report on it.

    Raises :class:`ScriptError` when the script cannot be read or compiled (before it runs).
    The script's own exceptions never propagate: they become the report's ``exception``,
    ``traceback`` and ``exit_code`` (1, as Python's; ``SystemExit`` keeps its code).
    """
    from . import _history
    from .leaks import LeakWarning

    if not os.path.exists(path):
        raise ScriptError(f"no such script: {path}")
    if os.path.isdir(path):
        raise ScriptError(f"{path} is a directory, not a Python script")
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        code = compile(source, path, "exec")
    except (OSError, SyntaxError, ValueError) as exc:
        raise ScriptError(f"cannot run {path}: {type(exc).__name__}: {exc}") from exc

    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__dict__["__builtins__"] = __builtins__
    module.__dict__["__cached__"] = None
    old_main = sys.modules.get("__main__")
    old_argv = sys.argv
    old_path0 = sys.path[0] if sys.path else None
    sys.modules["__main__"] = module
    sys.argv = [path, *args]
    script_dir = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.append(script_dir)

    collector = _LeakCollector()
    watcher = StepWatcher()
    watcher.install()
    exit_code = 0
    info: ExceptionInfo | None = None
    tb_text: str | None = None
    oom = None
    notes: list[str] = []
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", LeakWarning)
            collector.install()
            try:
                exec(code, module.__dict__)
            except SystemExit as exc:
                exit_code, message = _exit_code(exc)
                if message:
                    print(message, file=sys.stderr)
            except BaseException as exc:  # the script's failure is the report's subject
                exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 1
                is_oom = _backend.get().is_oom(exc)
                info = ExceptionInfo.from_exception(exc, is_oom=is_oom)
                tb_text = _script_traceback(exc)
                if is_oom:
                    try:
                        from .oom import oom_report

                        oom = oom_report(exc)
                    except Exception as err:
                        notes.append(f"OOM post-mortem failed: {type(err).__name__}: {err}")
                del exc
            finally:
                # The step in progress at exit is not a finished call: dropped, not recorded.
                watcher.uninstall()
                collector.uninstall()
        duration = time.perf_counter() - t0
        if progress is not None:
            progress("collecting the report (census, holders, ledger)")
        live, ledger_result, peaks = _collect(top, ledger, notes)
        hist = _history.history()
    finally:
        sys.argv = old_argv
        if old_path0 is not None and sys.path:
            sys.path[0] = old_path0
        if old_main is not None:
            sys.modules["__main__"] = old_main
    return RunReport(
        script=path,
        argv=tuple(args),
        exit_code=exit_code,
        duration=duration,
        exception=info,
        traceback=tb_text,
        steps=watcher.steps,
        peaks=peaks,
        leak_warnings=tuple(collector.messages),
        leak_names=tuple(collector.names),
        live=live,
        ledger=ledger_result,
        oom=oom,
        history=hist,
        notes=tuple(notes),
    )
