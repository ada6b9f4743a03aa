"""``cudamem run script.py``: run a user's script as ``python script.py`` would, watched.

The script runs in this process as ``__main__`` (same ``sys.argv``, ``sys.path[0]``, exit
code). Training steps are found without code changes through PyTorch's global optimizer-step
hooks: the time between two ``optimizer.step()`` calls is one ``training step`` span, so
growth detection watches it like any span the script opens itself. At exit, or on an uncaught
out-of-memory error, the report is collected *while the script's ``__main__`` module is still
installed*, so holders read ``__main__.loss_history[3]`` rather than an anonymous dict.

``run_script(name, module=True)`` runs a module as ``python -m name`` does: ``sys.argv[0]`` is
its file, ``sys.path[0]`` the working directory, a package runs its ``__main__``.

Collection only: ``RunReport`` is frozen data, rendered by ``render/report.py`` (text),
``render/html.py`` and ``render/json.py`` (``cudamem run --json FILE``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from ..allocator import backend as _backend
from ..base.args import check_bool, check_int
from ..base.frames import own_frame
from ..base.present import Presented
from ..growth.settings import LeakWarning
from ..holders.census import Census, listing_order, live_storages, live_tensors
from ..holders.culprits import group_culprits
from ..host import workers
from ..host.ledger import HostRun, host_run
from ..host.workers import HostMemoryWarning
from ..ledger.device import Explanation
from ..ledger.oom import OomReport, oom_report
from ..ledger.reading import explain
from ..modules.profiler import track_modules
from ..spans import history as _history
from ..spans.history import History
from ..spans.record import ExceptionInfo
from ..spans.span import StepSpan, max_allocated

__all__ = ["RunReport", "ScriptError", "StepWatcher", "Unlisted", "run_script"]

STEP_SPAN = "training step"


class ScriptError(Exception):
    """The script could not be started (missing, unreadable, not Python)."""


class Unlisted(NamedTuple):
    """Live storages at exit smaller than the listed ones: how many, and their bytes."""

    storages: int = 0
    nbytes: int = 0


#: Nothing unlisted: no census ran, or it listed every live storage.
_NONE_UNLISTED = Unlisted()


@dataclass(frozen=True, slots=True)
class RunReport(Presented):
    """What ``cudamem run`` learned about one run of a script."""

    json_properties: ClassVar[tuple[str, ...]] = ("cuda_used",)

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
    #: The largest storages still alive at exit, with holders, or None.
    live: Census | None
    #: The ``explain()`` ledger at exit, or None without a GPU.
    ledger: Explanation | None
    #: The OOM post-mortem, when the script died of one.
    oom: OomReport | None
    #: Finished top-level spans (the script's own and the training steps).
    history: History | None
    notes: tuple[str, ...] = field(default=())
    #: The module run with ``-m``, or None for a script.
    module: str | None = None
    #: The listed storages (``live``) grouped by the container that holds them, largest
    #: first (``Culprit`` values: holder, items, storages, bytes, an example path).
    groups: tuple[Any, ...] = ()
    #: Live storages smaller than the listed ones: how many, and their bytes.
    unlisted: Unlisted = _NONE_UNLISTED
    #: CUDA devices visible to torch (0: spans and growth detection had nothing to measure).
    cuda_devices: int = 0
    #: The per-module profile (``cudamem run --modules``), or None.
    modules: Any = None
    #: The host half: this process's RSS/PSS/USS at exit, the pinned pool, every DataLoader
    #: whose workers were watched, and the ``HostMemoryWarning`` texts.
    host: HostRun | None = None

    @property
    def cuda_used(self) -> bool:
        """Whether the script used a CUDA device (one had a context at exit)."""
        return bool(self.peaks)


class StepWatcher:
    """Turns ``optimizer.step()`` calls into ``training step`` spans (no code changes).

    The span between two steps is opened detached from the span stack, so spans the script
    opens itself stay top-level and keep their own history and growth detection.
    """

    def __init__(self, name: str = STEP_SPAN, on_step: Callable[[], None] | None = None) -> None:
        self.name = name
        self.steps = 0
        self._on_step = on_step
        self._step = StepSpan(name, sync=False, peak=False)
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
        self._step.stop()
        if self._on_step is not None:
            self._on_step()
        self._step.start()

    def close(self) -> None:
        """Close the step in progress (an unfinished step is not a finished call)."""
        self._step.stop()

    def uninstall(self) -> None:
        """Remove the hook; the step in progress is dropped, not recorded."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._step.drop()


class _LeakCollector:
    """Records every LeakWarning shown while the script runs, then shows it as usual."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.names: list[str] = []
        self.host: list[str] = []
        self._show: Callable[..., None] = warnings.showwarning

    def install(self) -> None:
        self._show = warnings.showwarning
        warnings.showwarning = self._record

    def uninstall(self) -> None:
        if warnings.showwarning == self._record:
            warnings.showwarning = self._show

    def _record(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:

        if isinstance(category, type) and issubclass(category, HostMemoryWarning):
            self.host.append(str(message))
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
    if isinstance(code, int):  # sys.exit(True) exits 1, as Python's does
        return int(code), None
    return 1, str(code)


def _script_traceback(exc: BaseException) -> str:
    """The traceback as Python would print it, starting at the script's own frames."""
    tb = exc.__traceback__
    while tb is not None and own_frame(tb.tb_frame):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _by_container(storages: Sequence[Any]) -> tuple[Any, ...]:
    """The listed storages grouped by the container that holds them, largest first, by the
    one culprit rule (``cudamem.holders.culprits``: a list of ten losses is one holder; a storage
    Python names directly belongs to that name, not to an autograd path through it)."""

    return tuple(group_culprits(storages))


@dataclass(frozen=True, slots=True)
class _Collected:
    live: Census | None = None
    ledger: Explanation | None = None
    peaks: tuple[tuple[int, int], ...] = ()
    groups: tuple[Any, ...] = ()
    unlisted: Unlisted = _NONE_UNLISTED


def _collect(top: int, with_ledger: bool, notes: list[str]) -> _Collected:

    live = ledger = None
    groups: tuple[Any, ...] = ()
    unlisted = _NONE_UNLISTED
    try:
        # Holders only for the storages listed: the search is the expensive part. The second
        # pass asks for the same storages (by identity), not for whatever is at their address.
        census = live_tensors()
        refs = [s.ref for s in census.storages[:top] if s.ref is not None]
        listed = live_storages(holders=True, among=refs) if refs else ()
        unlisted = Unlisted(
            max(len(census) - top, 0),
            sum(s.nbytes for s in census.storages[top:]),
        )
        live = Census(tuple(sorted(listed, key=listing_order)), census.notes, census.elapsed)
        groups = _by_container(live.storages)
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
            ledger = explain(host=False)  # the host half is the report's own section
        except Exception as exc:
            notes.append(f"explain() failed: {type(exc).__name__}: {exc}")
    return _Collected(live, ledger, tuple(peaks), groups, unlisted)


@dataclass(frozen=True, slots=True)
class _Target:
    """What to execute as ``__main__``, and how ``sys`` must look while it runs."""

    code: types.CodeType
    module: types.ModuleType
    argv0: str
    path0: str
    #: The file run (absolute).
    file: str


def _main_module(file: str) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__file__ = file
    module.__dict__["__builtins__"] = __builtins__
    module.__dict__["__cached__"] = None
    return module


def _script_target(path: str) -> _Target:
    if not os.path.exists(path):
        raise ScriptError(f"no such script: {path}")
    if os.path.isdir(path):
        raise ScriptError(f"{path} is a directory, not a Python script")
    # ``python script.py`` gives the script an absolute __file__ (and code filename) while
    # sys.argv[0] stays as typed.
    file = os.path.abspath(path)
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        code = compile(source, file, "exec")
    except (OSError, SyntaxError, ValueError) as exc:
        raise ScriptError(f"cannot run {path}: {type(exc).__name__}: {exc}") from exc
    return _Target(code, _main_module(file), path, os.path.dirname(file), file)


def _module_target(name: str) -> _Target:
    """``python -m name``: the module's code, run as ``__main__`` (a package's ``__main__``)."""
    if not name or name.startswith("."):
        raise ScriptError(f"cannot run -m {name!r}: relative module names are not supported")
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            package = name
            spec = importlib.util.find_spec(f"{name}.__main__")
            if spec is None:
                raise ScriptError(
                    f"no module named {package}.__main__; {package!r} is a package and "
                    "cannot be directly executed"
                )
        if spec is None:
            raise ScriptError(f"no module named {name}")
        loader = spec.loader
        get_code = getattr(loader, "get_code", None)
        code = get_code(spec.name) if callable(get_code) else None
    except ScriptError:
        raise
    except Exception as exc:  # importing the parent package ran its code
        raise ScriptError(f"cannot run -m {name}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(code, types.CodeType):
        raise ScriptError(f"cannot run -m {name}: no Python code found for {spec.name}")
    file = os.path.abspath(spec.origin) if spec.origin else name
    module = _main_module(file)
    module.__spec__ = spec
    module.__loader__ = loader
    module.__package__ = spec.parent
    module.__dict__["__cached__"] = spec.cached
    return _Target(code, module, file, os.getcwd(), file)


def run_script(
    path: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    top: int = 10,
    ledger: bool = True,
    modules: bool = False,
    progress: Callable[[str], None] | None = None,
    on_traceback: Callable[[str], None] | None = None,
) -> RunReport:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and report on it.

    With ``module=True``, ``path`` is a module name run as ``python -m path`` would.
    ``top`` storages (the largest alive at exit) are searched for holders and listed.
    ``modules``: profile memory per module (``cudamem.track_modules()`` over every module
    tree the script calls), in the report's ``modules``.

    Raises ``ScriptError`` when the script cannot be read or compiled (before it runs).
    The script's own exceptions never propagate: they become the report's ``exception``,
    ``traceback`` and ``exit_code`` (1, as Python's; ``SystemExit`` keeps its code).
    ``on_traceback`` gets the script's traceback text the moment it fails, before the
    report is collected (``progress`` lines come after it, as on a terminal).
    """

    if not isinstance(path, str):
        raise TypeError(f"path must be a str, not {type(path).__name__}")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise TypeError("args must be a sequence of str")
    check_int("top", top, minimum=0)
    check_bool("modules", modules)

    old_main = sys.modules.get("__main__")
    old_argv = sys.argv
    old_path = list(sys.path)
    collector = _LeakCollector()
    host: HostRun | None = None
    profiler = track_modules() if modules else None
    # With --modules a profile step is a training step: optimizer.step() to optimizer.step().
    watcher = StepWatcher(on_step=None if profiler is None else profiler.step)
    profile = None
    exit_code = 0
    info: ExceptionInfo | None = None
    tb_text: str | None = None
    oom = None
    notes: list[str] = []
    try:
        if module:
            # python -m puts the working directory first before importing anything.
            _set_path0(os.getcwd())
            target = _module_target(path)
        else:
            target = _script_target(path)
        main = target.module
        sys.modules["__main__"] = main
        sys.argv = [target.argv0, *args]
        _set_path0(target.path0)
        watcher.install()
        if profiler is not None:
            profiler.start()
        t0 = time.perf_counter()
        with warnings.catch_warnings(), workers.watching() as loaders:
            warnings.simplefilter("always", LeakWarning)
            collector.install()
            try:
                exec(target.code, main.__dict__)
            except SystemExit as exc:
                exit_code, message = _exit_code(exc)
                if message:
                    print(message, file=sys.stderr)
            except BaseException as exc:  # the script's failure is the report's subject
                exit_code = 130 if isinstance(exc, KeyboardInterrupt) else 1
                is_oom = _backend.get().is_oom(exc)
                info = ExceptionInfo.from_exception(exc, is_oom=is_oom)
                tb_text = _script_traceback(exc)
                if on_traceback is not None:
                    on_traceback(tb_text)
                if is_oom:
                    try:
                        oom = oom_report(exc)
                    except Exception as err:
                        notes.append(f"OOM post-mortem failed: {type(err).__name__}: {err}")
                del exc
            finally:
                # The step in progress at exit is not a finished call: dropped, not recorded.
                watcher.uninstall()
                host = _host_at_exit(loaders, collector, notes)
                collector.uninstall()
                if profiler is not None:
                    profile = profiler.stop()
        duration = time.perf_counter() - t0
        if progress is not None:
            progress("collecting the report (census, holders, ledger)")
        collected = _collect(top, ledger, notes)
        hist = _history.history()
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
        if old_main is not None:
            sys.modules["__main__"] = old_main
    return RunReport(
        script=target.file if module else path,
        argv=tuple(args),
        exit_code=exit_code,
        duration=duration,
        exception=info,
        traceback=tb_text,
        steps=watcher.steps,
        peaks=collected.peaks,
        leak_warnings=tuple(collector.messages),
        leak_names=tuple(collector.names),
        live=collected.live,
        ledger=collected.ledger,
        oom=oom,
        history=hist,
        notes=tuple(notes),
        module=path if module else None,
        groups=collected.groups,
        unlisted=collected.unlisted,
        cuda_devices=_backend.get().device_count(),
        modules=profile,
        host=host,
    )


def _host_at_exit(
    loaders: workers.WorkerWatcher, collector: _LeakCollector, notes: list[str]
) -> HostRun | None:
    """The watched loaders read one last time (a final judgement may warn), then the host."""
    try:
        seen = loaders.reports(refresh=True)
        return host_run(seen, tuple(collector.host))
    except Exception as exc:
        notes.append(f"host memory not measured: {type(exc).__name__}: {exc}")
        return None


def _set_path0(entry: str) -> None:
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.append(entry)
