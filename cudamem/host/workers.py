"""DataLoader workers watched: their private memory, and copy-on-read named when it grows.

``watch_workers()`` wraps ``_MultiProcessingDataLoaderIter.__init__`` (the iterator torch
creates for ``num_workers > 0``) so that each new iterator registers itself, and starts one
daemon thread. No user code changes; nothing runs on a training step's path.

The thread reads each worker's minor page faults (``/proc/<pid>/stat``: microseconds) every
``interval`` seconds, and its USS/PSS (``smaps_rollup``: a walk of every page table, tens of
milliseconds for a process mapping a large dataset) only when the faults say pages changed,
and no more often than ``budget`` allows: after a read that took ``c`` seconds the next waits
``c / budget``. A dataset's first loader is read at its start and once more as torch shuts its
workers down; later loaders of the same dataset (each epoch without persistent workers)
only as the budget allows. The watcher's share of one core stays at ``budget`` (0.5 %) or
below, plus those few reads of each new dataset's first loader.

A loader is judged by its workers' USS growth since their first reading, never by RSS (a
forked worker's RSS counts the parent's shared pages and stays flat while they are copied).
When the mean growth per worker reaches ``min_growth`` (``min_growth_unexplained`` when the
dataset holds no large Python containers) a ``HostMemoryWarning`` names the growth per
worker and in total, the cause (copy-on-read for forked workers; under spawn each worker
unpickled its own copy), the dataset's large containers and the fix. Once per dataset.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..allocator import torch_backend as _torch_backend
from ..base.args import check_seconds
from ..base.frames import is_library_file
from ..base.present import Presented, present
from . import procfs as _procfs
from ._dataset_walk import ContainerAttr, large_containers
from .procfs import ProcessMemory

__all__ = [
    "HostMemoryWarning",
    "LoaderReport",
    "WatchSettings",
    "WorkerMemory",
    "WorkerWatcher",
    "find_loaders",
    "stop_watching",
    "watch_workers",
    "watcher",
]

MiB = 1024**2
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostMemoryWarning(UserWarning):
    """DataLoader workers' private host memory grew. ``warning.report`` has the details."""

    def __init__(self, message: str, report: LoaderReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True, slots=True)
class WatchSettings(Presented):
    """How often and how cheaply workers are read, and what growth warns."""

    #: Seconds between the cheap fault reads.
    interval: float = 1.0
    #: Share of one core the ``smaps_rollup`` reads may take (1: no limit).
    budget: float = 0.005
    #: Mean USS growth per worker that warns when the dataset holds large Python containers.
    min_growth: int = 16 * MiB
    #: The same when it holds none (the growth is then the workers' own allocations).
    min_growth_unexplained: int = 256 * MiB
    #: Faults (as bytes of pages) since a worker's last reading that make it worth reading.
    fault_step: int = 1 * MiB


@dataclass(frozen=True, slots=True)
class WorkerMemory:
    """One worker: its first and latest readings. ``exited``: it was gone at the last look."""

    index: int
    pid: int
    first: ProcessMemory
    last: ProcessMemory
    exited: bool = False

    @property
    def growth(self) -> int | None:
        """USS growth since the first reading (``None``: not measured twice)."""
        if self.first.uss is None or self.last.uss is None:
            return None
        return self.last.uss - self.first.uss


@dataclass(frozen=True, slots=True)
class LoaderReport(Presented):
    """One DataLoader iterator's workers, as the watcher last saw them."""

    json_properties: ClassVar[tuple[str, ...]] = ("growth", "uss", "pss", "cause")

    #: Which loader: 1 for the first iterator the watcher saw, 2 for the next, ...
    number: int
    #: The dataset's class name.
    dataset: str
    #: ``fork``, ``spawn`` or ``forkserver``.
    start_method: str
    persistent: bool
    workers: tuple[WorkerMemory, ...]
    #: The dataset's large Python containers (filled when the loader is judged).
    containers: tuple[ContainerAttr, ...] = ()
    #: The iterator is gone (finished, abandoned mid-epoch, or deleted).
    ended: bool = False
    warned: bool = False
    #: Followed by the watcher (else read once, by ``explain()``: no growth is known).
    watched: bool = True

    @property
    def live(self) -> tuple[WorkerMemory, ...]:
        """The workers still running at the last look."""
        return tuple(w for w in self.workers if not w.exited)

    @property
    def growth(self) -> int:
        """Total USS growth of the workers (those measured twice)."""
        return sum(w.growth or 0 for w in self.workers)

    @property
    def uss(self) -> int:
        """Sum of the live workers' latest USS."""
        return sum(w.last.uss or 0 for w in self.live)

    @property
    def pss(self) -> int:
        """Sum of the live workers' latest PSS."""
        return sum(w.last.pss or 0 for w in self.live)

    @property
    def cause(self) -> str:
        """``copy-on-read``, ``spawn: each worker unpickled its own copy`` or
        ``the workers' own allocations``."""
        if self.start_method == "spawn" or self.start_method == "forkserver":
            return f"{self.start_method}: each worker unpickled its own copy of the dataset"
        if self.containers:
            return "copy-on-read"
        return "the workers' own allocations"


# --------------------------------------------------------------------------- the watcher


@dataclass(frozen=True, slots=True)
class _Site:
    """Where the user's code started a loader's iterator (``for batch in loader:``): where
    its ``HostMemoryWarning`` is located, whichever thread judges it."""

    filename: str
    lineno: int
    module: str
    globals: dict[str, Any]


def _user_site() -> _Site | None:
    """The first frame outside cudamem and torch in this thread, or ``None`` (none: the
    iterator was made by library code alone, or in a thread of its own)."""
    frame: Any = sys._getframe(1)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    module = frame.f_globals.get("__name__", "<string>")
    return _Site(frame.f_code.co_filename, frame.f_lineno, str(module), frame.f_globals)


def _warn_at(warning: Warning, site: _Site | None) -> None:
    """``warning`` located at ``site`` (the user's line), as ``warnings.warn`` would locate
    it there: the filters, the once-per-location registry and the source line are that
    line's. Without a site, at the first frame outside cudamem and torch in this thread."""
    if site is None:
        site = _user_site()
    if site is None:  # pragma: no cover - a thread with no user frame at all
        warnings.warn(warning, stacklevel=2)
        return
    registry = site.globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        warning,
        type(warning),
        site.filename,
        site.lineno,
        module=site.module,
        registry=registry,
        module_globals=site.globals,
    )


@dataclass
class _Worker:
    index: int
    pid: int
    first: ProcessMemory
    last: ProcessMemory
    faults: int | None
    read_at: float
    exited: bool = False

    def value(self) -> WorkerMemory:
        return WorkerMemory(self.index, self.pid, self.first, self.last, self.exited)


@dataclass
class _Loader:
    number: int
    ref: weakref.ReferenceType[Any]
    dataset: str
    start_method: str
    persistent: bool
    key: tuple[int, str]
    workers: dict[int, _Worker] = field(default_factory=dict)
    containers: tuple[ContainerAttr, ...] = ()
    walked: bool = False
    ended: bool = False
    warned: bool = False
    watched: bool = True
    #: The first loader of its dataset this watcher saw: read at its start and end whatever
    #: the budget.
    first_of_dataset: bool = True
    #: Where the user's code started the iterator (its warning is located there).
    site: _Site | None = None

    def value(self) -> LoaderReport:
        return LoaderReport(
            number=self.number,
            dataset=self.dataset,
            start_method=self.start_method,
            persistent=self.persistent,
            workers=tuple(w.value() for w in self.workers.values()),
            containers=self.containers,
            ended=self.ended,
            warned=self.warned,
            watched=self.watched,
        )


def _start_method(it: Any) -> str:
    for w in list(getattr(it, "_workers", ())):
        method = getattr(w, "_start_method", None)
        if isinstance(method, str):
            return method
    return multiprocessing.get_start_method(allow_none=False)


def _iter_class() -> type | None:
    try:
        from torch.utils.data import dataloader
    except Exception:
        return None
    cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    return cls if isinstance(cls, type) else None


class WorkerWatcher:
    """The daemon thread that reads registered loaders' workers (``watch_workers``)."""

    def __init__(self, settings: WatchSettings | None = None) -> None:
        self.settings = settings or WatchSettings()
        self._lock = threading.Lock()
        self._loaders: dict[int, _Loader] = {}
        self._finished: list[_Loader] = []
        self._tick_lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._warned_keys: set[tuple[int, str]] = set()
        #: Datasets whose loader was read at its start and again later.
        self._judged_keys: set[tuple[int, str]] = set()
        self._wake = threading.Event()
        self._stopping = False
        self._next_full = 0.0
        self._thread: threading.Thread | None = None
        #: Seconds spent reading ``/proc`` (both kinds of reads), and how many full reads.
        self.cost = 0.0
        self.full_reads = 0
        #: This process's latest reading, when ``sample_self`` is on (the trainer callbacks'
        #: host columns read it instead of ``/proc``).
        self.process: ProcessMemory | None = None
        self.sample_self = False
        self._self_faults: int | None = None

    # -- life --------------------------------------------------------------------------
    def start(self) -> WorkerWatcher:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="cudamem-worker-watch", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def register(self, it: Any, *, watched: bool = True) -> None:
        """Watch the workers of ``it``, a ``_MultiProcessingDataLoaderIter``."""
        dataset = getattr(it, "_dataset", None)
        entry = _Loader(
            number=next(self._numbers),
            ref=weakref.ref(it),
            dataset=type(dataset).__name__,
            start_method=_start_method(it),
            persistent=bool(getattr(it, "_persistent_workers", False)),
            key=(id(dataset), type(dataset).__qualname__),
            watched=watched,
            site=_user_site(),
        )
        with self._lock:
            entry.first_of_dataset = not any(
                e.key == entry.key for e in (*self._finished, *self._loaders.values())
            )
            stale = self._loaders.pop(id(it), None)
            if stale is not None:  # its iterator is gone: a new one took its address
                stale.ended = True
                self._finished.append(stale)
            self._loaders[id(it)] = entry
        if entry.first_of_dataset and watched:
            # The baseline now, in the caller's thread, before the workers read anything (the
            # thread may be scheduled late on a busy machine): once per dataset.
            with self._tick_lock:
                for index, proc in enumerate(list(getattr(it, "_workers", ()))):
                    pid = getattr(proc, "pid", None)
                    if isinstance(pid, int) and pid not in entry.workers:
                        self._first(entry, index, pid, _procfs.read_faults(pid))
        self._wake.set()

    def _first(self, entry: _Loader, index: int, pid: int, faults: int | None) -> None:
        if faults is None:
            return  # gone before its first reading
        first = self._full(pid)
        entry.workers[pid] = _Worker(
            index, pid, first, first, faults, time.monotonic(), not first.measured
        )

    # -- reading -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.settings.interval)
            self._wake.clear()
            if self._stopping:
                break
            with contextlib.suppress(Exception):  # the watcher never ends the user's job
                self.tick()

    def _full(self, pid: int) -> ProcessMemory:
        t0 = time.perf_counter()
        memory = _procfs.read_memory(pid)
        spent = time.perf_counter() - t0
        self.cost += spent
        self.full_reads += 1
        if self.settings.budget < 1:  # 1: a whole core, no wait
            self._next_full = time.monotonic() + spent / self.settings.budget
        return memory

    def tick(self, *, force: bool = False) -> None:
        """One round: new workers get their first reading, changed ones a new one when the
        budget allows (``force``: every live worker now)."""
        with self._tick_lock:
            self._tick(force)

    def _tick(self, force: bool) -> None:
        with self._lock:
            loaders = list(self._loaders.values())
        due: list[tuple[float, _Loader, _Worker]] = []
        for entry in loaders:
            it = entry.ref()
            if it is None:
                entry.ended = True
                continue
            processes = list(getattr(it, "_workers", ()))
            del it
            for index, proc in enumerate(processes):
                pid = getattr(proc, "pid", None)
                if not isinstance(pid, int):
                    continue
                worker = entry.workers.get(pid)
                t0 = time.perf_counter()
                faults = _procfs.read_faults(pid)
                self.cost += time.perf_counter() - t0
                if worker is None:
                    if self._budgeted(entry) and not force:
                        continue  # a dataset already judged: read only as the budget allows
                    self._first(entry, index, pid, faults)
                    continue
                if faults is None:
                    worker.exited = True
                    continue
                step = (faults - (worker.faults or 0)) * PAGE
                if force or step >= self.settings.fault_step:
                    due.append((worker.read_at, entry, worker))
        for _, _entry, worker in sorted(due, key=lambda d: d[0]):
            if not force and time.monotonic() < self._next_full:
                break
            faults = _procfs.read_faults(worker.pid)
            memory = self._full(worker.pid)
            if not memory.measured:
                worker.exited = True
                continue
            worker.last, worker.faults, worker.read_at = memory, faults, time.monotonic()
        if self.sample_self:
            self._read_self(force)
        for entry in loaders:
            self._judge(entry)
            if any(w.last is not w.first for w in entry.workers.values()):
                self._judged_keys.add(entry.key)
        with self._lock:
            for key in [k for k, e in self._loaders.items() if e.ended]:
                self._finished.append(self._loaders.pop(key))

    def _judge(self, entry: _Loader, it: Any = None) -> None:
        if entry.warned or entry.key in self._warned_keys:
            return
        growths = [
            w.last.uss - w.first.uss for w in entry.workers.values() if w.last.uss and w.first.uss
        ]
        if not growths:
            return
        mean = sum(growths) / len(growths)
        if mean < self.settings.min_growth:
            return
        if not entry.walked:
            it = entry.ref() if it is None else it
            dataset = getattr(it, "_dataset", None) if it is not None else None
            del it
            if dataset is None:
                return
            entry.containers = tuple(c for c in large_containers(dataset) if c.nbytes >= MiB)
            entry.walked = True
            del dataset
        # Copy-on-read explains the growth only where the containers are at least that large
        # (a list of 1,000 class names does not; a worker's start-up allocates a few MiB).
        explained = sum(c.nbytes for c in entry.containers) >= self.settings.min_growth
        if not explained and mean < self.settings.min_growth_unexplained:
            return
        entry.warned = True
        self._warned_keys.add(entry.key)
        report = entry.value()
        with contextlib.suppress(Exception):
            _warn_at(HostMemoryWarning(present(report), report), entry.site)

    def _read_self(self, force: bool) -> None:
        pid = os.getpid()
        faults = _procfs.read_faults(pid)
        if self.process is not None and not force:
            if (
                faults is None
                or (faults - (self._self_faults or 0)) * PAGE < self.settings.fault_step
            ):
                return
            if time.monotonic() < self._next_full:
                return
        self.process, self._self_faults = self._full(pid), faults

    def workers_uss(self) -> int:
        """Sum of the live loaders' live workers' latest USS."""
        with self._lock:
            entries = list(self._loaders.values())
        return sum(w.last.uss or 0 for e in entries for w in e.workers.values() if not w.exited)

    def _budgeted(self, entry: _Loader) -> bool:
        """Whether reading ``entry``'s workers must wait for the budget now: its dataset was
        judged on an earlier loader (a new epoch without persistent workers), and the last
        read's wait has not passed. A dataset's first loader is read in full."""
        return (
            not entry.first_of_dataset
            and (entry.key in self._judged_keys or entry.key in self._warned_keys)
            and self.settings.budget < 1
            and time.monotonic() < self._next_full
        )

    def final(self, it: Any) -> None:
        """Read ``it``'s workers now, outside the budget where their faults say pages changed
        (torch is about to end them), and judge the loader."""
        with self._lock:
            entry = self._loaders.get(id(it))
        if entry is None:
            return
        with self._tick_lock:
            for worker in entry.workers.values():
                if worker.exited or self._budgeted(entry):
                    continue
                faults = _procfs.read_faults(worker.pid)
                if faults is None:
                    worker.exited = True
                    continue
                if (faults - (worker.faults or 0)) * PAGE < self.settings.fault_step:
                    continue
                memory = self._full(worker.pid)
                if memory.measured:
                    worker.last, worker.faults = memory, faults
            self._judge(entry, it)
            if any(w.last is not w.first for w in entry.workers.values()):
                self._judged_keys.add(entry.key)

    # -- results -----------------------------------------------------------------------
    def reports(self, *, refresh: bool = False) -> tuple[LoaderReport, ...]:
        """Every loader seen, the ended ones included, oldest first (``refresh``: read every
        live worker now, outside the budget)."""
        if refresh:
            self.tick(force=True)
        with self._lock:
            entries = [*self._finished, *self._loaders.values()]
        return tuple(e.value() for e in sorted(entries, key=lambda e: e.number))


# --------------------------------------------------------------------------- the hook

_watcher: WorkerWatcher | None = None
_hook_lock = threading.Lock()
_originals: dict[str, Any] = {}


def _install_hook() -> bool:
    """Wrap the iterator's ``__init__`` (register it) and ``_shutdown_workers`` (read its
    workers one last time, before torch ends them: at the end of an epoch without persistent
    workers, or when the loop is left mid-epoch)."""
    global _originals
    cls = _iter_class()
    if cls is None:
        return False
    if _originals:
        return True
    init = cls.__dict__["__init__"]
    shutdown = cls.__dict__.get("_shutdown_workers")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        current = _watcher
        if current is not None:
            with contextlib.suppress(Exception):
                current.register(self)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    _originals = {"__init__": init}
    if shutdown is not None:

        def _shutdown_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
            current = _watcher
            if current is not None and getattr(self, "_shutdown", True) is False:
                with contextlib.suppress(Exception):
                    current.final(self)
            return shutdown(self, *args, **kwargs)

        _shutdown_workers.__wrapped__ = shutdown  # type: ignore[attr-defined]
        cls._shutdown_workers = _shutdown_workers  # type: ignore[attr-defined]
        _originals["_shutdown_workers"] = shutdown
    return True


def _remove_hook() -> None:
    global _originals
    cls = _iter_class()
    if cls is not None:
        for name, original in _originals.items():
            setattr(cls, name, original)
    _originals = {}


def watch_workers(
    *,
    interval: float = 1.0,
    min_growth: int = 16 * MiB,
    budget: float = 0.005,
) -> WorkerWatcher:
    """Watch every DataLoader iterator created from now on (``num_workers > 0``): their
    workers' USS/PSS, and a ``HostMemoryWarning`` when it grows. Returns the running watcher
    (the same one when already watching); ``stop_watching()`` ends it."""
    global _watcher
    check_seconds("interval", interval)
    if isinstance(min_growth, bool) or not isinstance(min_growth, int) or min_growth < 0:
        raise ValueError(f"min_growth must be a number of bytes >= 0, not {min_growth!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be a share of one core in (0, 1], not {budget!r}")
    with _hook_lock:
        if _watcher is not None:
            return _watcher
        settings = WatchSettings(
            interval=float(interval), budget=float(budget), min_growth=min_growth
        )
        current = WorkerWatcher(settings)
        _install_hook()
        _watcher = current.start()
        return current


def stop_watching() -> tuple[LoaderReport, ...]:
    """Stop the watcher; returns its reports (empty when none was running)."""
    global _watcher
    with _hook_lock:
        current, _watcher = _watcher, None
        _remove_hook()
    if current is None:
        return ()
    current.stop()
    return current.reports()


def watcher() -> WorkerWatcher | None:
    """The running watcher, if any."""
    return _watcher


@contextlib.contextmanager
def watching(**kwargs: Any) -> Iterator[WorkerWatcher]:
    """``watch_workers`` for a block; stops it after unless it was already running."""
    already = _watcher is not None
    current = watch_workers(**kwargs)
    try:
        yield current
    finally:
        if not already:
            stop_watching()


def find_loaders() -> tuple[LoaderReport, ...]:
    """The live DataLoader iterators' workers, read now: the watcher's, or when none runs,
    those found on the heap (one reading each, so no growth)."""
    current = _watcher
    if current is not None:
        return tuple(r for r in current.reports(refresh=True) if not r.ended)
    cls = _iter_class()
    if cls is None:
        return ()
    found = _torch_backend.instances_of([cls])
    scratch = WorkerWatcher()
    for it in found:
        scratch.register(it, watched=False)
    del found
    scratch.tick(force=True)
    return tuple(r for r in scratch.reports() if not r.ended)
