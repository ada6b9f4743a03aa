"""The optional C++ counter reader: allocated, reserved and peak bytes in ~0.2 µs a read.

``torch._C._cuda_memoryStats`` builds 39 dicts of 122 ints per call (10.7 µs on an H200);
the C++ reader (``native/src/fastread/``) returns the three integers spans need (0.16 µs,
0.18 µs with a peak reset).
The same library holds the per-module profile's backward gates (``GateLog``: C++ pre-hooks on
autograd nodes that log the counters with no GIL; ``cudamem.modules`` replays the log). It is
compiled once per (torch, CUDA, C++ ABI, Python, source) into a per-user cache (about 20 s on
an H200's host) and loaded from there by every later process.

Life of the reader in one process (``FastReader``, driven by the backend):

* ``idle``: nothing happens at import, and nothing while CUDA is not initialised.
* The first counter read after CUDA starts hands the work to a daemon thread: it loads the
  cached build, or compiles one in a subprocess (``python -c``, GPUs hidden, its output kept
  in ``build.log``). Until the thread is done the dict path serves, so no read waits.
* ``ready``: the next read validates it: its three values must equal the dict read's, with
  nothing allocated in between. Then ``active``; otherwise ``dropped`` with the reason.
* Wherever it cannot be built or used (``CUDAMEM_FAST_READER=0``, a torch without CUDA,
  ROCm, no compiler, ninja or CUDA headers, a compile error, values that disagree), the dict
  path serves and ``FastReader.status`` says why.

A failed build and a disagreeing reader leave a marker in the cache so that later processes
do not pay for the same failure again; ``python -m cudamem build-reader`` ignores the
markers and builds afresh.

This module is the reader in one process; ``reader_toolchain`` is its build (spec, cache
paths, markers, the build subprocess, which loads ``reader_build.py`` by path), ``states``
its states, ``ReaderUnavailable`` and ``ReaderStatus``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .cache import load_library as _load
from .reader_toolchain import (
    BuildSpec,
    _compiler,
    _failed_blocks,
    _Paths,
    _read_marker,
    _remove,
    _short,
    _toolchain_problem,
    _write_marker,
    build_in_subprocess,
    torch_spec,
)
from .states import (
    ACTIVE,
    BUILDING,
    CACHED,
    DISABLED,
    DROPPED,
    FAILED,
    FINAL,
    IDLE,
    NOT_BUILT,
    READY,
    UNSUPPORTED,
    ReaderStatus,
    ReaderUnavailable,
    switched_off,
)

__all__ = [
    "SWITCH_ENV",
    "VALIDATION_ATTEMPTS",
    "FastReader",
    "ForwardHooks",
    "GateLog",
    "Reader",
    "build_in_subprocess",
    "load_library",
    "torch_spec",
]

#: ``CUDAMEM_FAST_READER=0`` (or ``false``/``no``/``off``) keeps the dict path.
SWITCH_ENV = "CUDAMEM_FAST_READER"

#: Reads that may find the counters moving (another thread allocating) or all zero before
#: the reader is validated; it stays on the dict path meanwhile.
VALIDATION_ATTEMPTS = 1000

Counters = tuple[int, int, int]

# The states (``native.states``): idle, building, ready, active; the dead ends, where the
# dict path serves: disabled, unsupported, failed, dropped; seen from a process that has not
# started the reader (``cudamem status``): cached, not built.
_FINAL = FINAL


class Reader(Protocol):
    """What a loaded reader offers (the compiled module, or a fake in tests)."""

    def counters(self, device: int, /) -> Counters:
        """(allocated, reserved, peak_allocated) bytes of ``device``'s "all" pool."""
        ...

    def counters_reset_peak(self, device: int, /) -> Counters:
        """The counters, read just before resetting the device's peak."""
        ...


class ForwardHooks(Protocol):
    """A module profile's forward hooks in C (``GateLog.Forward``): ``pre`` and ``post``
    take a module call's entry and exit as ``ModuleProfiler._pre`` and ``_post`` would,
    handing them what they do not take (a top-level call, an exception, the span path)."""

    owner: int
    step: int
    next: int
    paused: bool

    def pre(self, node: object, module: object, args: object, kwargs: object, /) -> None: ...

    def post(self, node: object, module: object, args: object, output: object, /) -> None: ...


class GateLog(Protocol):
    """The per-module profile's counter log (``cudamem.modules``): module calls' forward
    edges logged by ``mark``, their backward edges by C++ pre-hooks on autograd nodes that
    log the counters, with no GIL, when the node is about to run (``native/src/fastread/``)."""

    def gate(self, grad_fn: object, code: int, owner: int, step: int, device: int, /) -> bool:
        """Log ``code`` whenever ``grad_fn`` is about to run: added to the node's C++ gate for
        ``owner`` (put there now if it has none; codes of steps before ``step - 1`` are
        dropped). ``False`` if ``grad_fn`` is no node this build can reach."""
        ...

    def codes(self, grad_fn: object, owner: int, /) -> tuple[int, ...]:
        """The codes ``grad_fn``'s gate for ``owner`` logs, in the order they were added."""
        ...

    def log_start(self) -> int:
        """Start a new log (dropping any other); its owner id."""
        ...

    def log_stop(self, owner: int, /) -> None:
        """End log ``owner``: its gates do nothing from here."""
        ...

    def log_replay(
        self, owner: int, first: int, active: bool, close: bool, forwards: bool, /
    ) -> int:
        """The events since the last replay as each module call's figures, added up per
        module slot (``log_figures``): how many events were dropped (see
        ``native/src/fastread/replay.cpp``)."""
        ...

    def log_figures(self, owner: int, /) -> tuple[int, ...]:
        """What the replays added up since the last call: flat (slot, then the 11 figures of
        ``module_profile.STEP_FIELDS``) per module slot that ran; emptied."""
        ...

    def log_drop(self, owner: int, call: int, /) -> None:
        """The forward of ``call`` ended without its exit: the replay forgets it."""
        ...

    def Forward(
        self,
        stack: list[Any],
        pre: Callable[..., Any],
        post: Callable[..., Any],
        grad_tensor: Callable[..., Any],
        owner: int,
        device: int,
        /,
    ) -> ForwardHooks:
        """The forward hooks' fast path of log ``owner`` over the profiler's ``stack`` of
        open forwards; ``pre`` and ``post`` take what it hands on, ``grad_tensor`` finds a
        grad-requiring tensor in what it does not read itself."""
        ...

    def mark(self, owner: int, device: int, tag: int, meta: int = -1, parent: int = -1, /) -> None:
        """Log ``tag`` now, as a gate would; a forward's entry also gives its module's slot
        times two plus 1 for a recomputation (``meta``) and the call it runs in
        (``parent``)."""
        ...


def load_library(path: str, name: str) -> Reader:
    """Import the compiled reader from ``path``."""
    reader: Reader = _load(path, name)
    return reader


# --------------------------------------------------------------------------- the manager


def _switched_off() -> bool:
    return switched_off(SWITCH_ENV)


class FastReader:
    """One process's C++ reader: builds or loads it off the hot path, validates it, says why
    it is or is not in use. Never raises into its caller.

    Args:
        provide: returns a loaded ``Reader``, or raises ``ReaderUnavailable``
            (default: load the cached build, compiling it first if needed). Runs on a daemon
            thread, except in ``build_now``.
        spec: the build spec, or why none applies (default: from torch).
        root: the cache root (default ``cache_root`` at first use).
    """

    def __init__(
        self,
        provide: Callable[[bool], Reader] | None = None,
        *,
        spec: Callable[[], BuildSpec | ReaderUnavailable] | None = None,
        root: str | None = None,
    ) -> None:
        self._provide = provide or self._load_or_build
        self._spec_fn = spec or torch_spec
        self._root = root
        self._lock = threading.Lock()
        self._spec: BuildSpec | None = None
        self._state = IDLE
        self._reason = "not started: CUDA has not been initialised in this process"
        self._candidate: Reader | None = None
        self._thread: threading.Thread | None = None
        self._attempts = 0
        self._origin = ""  # "built in 4.1 s" / "loaded from the cache"

    # -- what the backend calls ------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @property
    def pending(self) -> bool:
        """Whether a later ``poll`` may still make the reader active."""
        return self._state not in _FINAL

    def poll(self, device: int, dict_read: Callable[[int], Counters]) -> Reader | None:
        """Advance one step; the reader once it is validated (returned once), else None.

        Call it on a counter read once CUDA is initialised. It never waits for a build:
        ``idle`` starts the thread, ``building`` returns at once, ``ready`` validates
        against ``dict_read(device)``.
        """
        state = self._state
        if state == BUILDING or state in _FINAL:
            return None
        if not self._lock.acquire(blocking=False):
            return None  # another thread is starting or validating it
        try:
            if self._state == IDLE:
                self._start()
                return None
            if self._state == READY:
                return self._validate(device, dict_read)
            return None
        except Exception as exc:  # cudamem's own failure: report it, serve the dict path
            self._finish(DROPPED, f"the reader failed: {exc!r}")
            return None
        finally:
            self._lock.release()

    def _take_spec(self) -> bool:
        """Find what to build; ``False`` (and the state says why) when nothing can be."""
        if _switched_off():
            self._finish(DISABLED, f"{SWITCH_ENV}={os.environ.get(SWITCH_ENV)} turns it off")
            return False
        spec = self._spec_fn()
        if isinstance(spec, ReaderUnavailable):
            self._finish(spec.state, spec.reason)
            return False
        self._spec = spec
        return True

    def _start(self) -> None:
        if not self._take_spec():
            return
        self._state = BUILDING
        self._reason = "building or loading it in the background; the dict path serves meanwhile"
        self._thread = threading.Thread(
            target=self._run, args=(False,), name="cudamem-reader-build", daemon=True
        )
        self._thread.start()

    def _run(self, force: bool) -> None:
        try:
            reader = self._provide(force)
        except ReaderUnavailable as exc:
            self._finish(exc.state, exc.reason)
        except BaseException as exc:  # a daemon thread: nothing may escape it
            self._finish(FAILED, f"loading the reader failed: {exc!r}")
        else:
            self._candidate = reader
            self._reason = f"{self._origin or 'loaded'}; validating on the next read"
            self._state = READY

    def _validate(self, device: int, dict_read: Callable[[int], Counters]) -> Reader | None:
        reader = self._candidate
        if reader is None:  # pragma: no cover - READY always has a candidate
            return None
        try:
            first = tuple(reader.counters(device))
            expected = tuple(dict_read(device))
            second = tuple(reader.counters(device))
        except Exception as exc:
            # A read that raises (another allocator backend, a bad device) is this process's
            # problem, not the build's: no marker.
            self._candidate = None
            self._finish(DROPPED, f"a read raised on cuda:{device}: {exc!r}")
            return None
        if first != second:
            # Another thread allocated between the reads: decide on a later read.
            self._attempts += 1
            if self._attempts >= VALIDATION_ATTEMPTS:
                self._candidate = None
                self._finish(DROPPED, "the counters never held still long enough to validate")
            return None
        if not any(expected):
            return None  # all zero proves nothing (a layout mismatch could read zeros too)
        if first != expected:
            self._candidate = None
            reason = (
                f"it disagreed with the dict read on cuda:{device} "
                f"(C++ {first} vs dict {expected} as allocated, reserved, peak)"
            )
            self._finish(DROPPED, reason)
            if self._spec is not None:
                _write_marker(self._paths(self._spec).dropped, {"reason": reason})
            return None
        self._candidate = None
        self._finish(
            ACTIVE,
            f"{self._origin or 'loaded'}; equal to the dict read on cuda:{device}",
        )
        return reader

    def _finish(self, state: str, reason: str) -> None:
        self._state = state
        self._reason = reason

    def join(self, timeout: float | None = None) -> None:
        """Wait for the background thread, if any (tests and ``build-reader``)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def build_now(self, *, force: bool = True) -> None:
        """Build (or load) it on this thread, ignoring failure markers when ``force``; the
        next ``poll`` validates it. For ``python -m cudamem build-reader``."""
        with self._lock:
            if self._state == ACTIVE:
                return
            self.join()
            if not self._take_spec():
                return
            self._attempts = 0
            self._run(force)

    # -- the default provider --------------------------------------------------------

    def _paths(self, spec: BuildSpec) -> _Paths:
        return _Paths.of(spec, self._root)

    def _load_or_build(self, force: bool) -> Reader:
        spec = self._spec
        if spec is None:  # pragma: no cover - _start and build_now set it first
            raise ReaderUnavailable(UNSUPPORTED, "no build spec")
        paths = self._paths(spec)
        if force:
            _remove(paths.failed)
            _remove(paths.dropped)
        else:
            dropped = _read_marker(paths.dropped)
            if dropped is not None:
                raise ReaderUnavailable(
                    DROPPED,
                    f"dropped by an earlier process: {dropped.get('reason', '?')}; "
                    "`python -m cudamem build-reader` retries",
                )
        note = ""
        if os.path.exists(paths.library):
            try:
                reader = load_library(paths.library, spec.module_name)
            except Exception as exc:
                # A stale or damaged file: rebuild it once.
                _remove(paths.library)
                note = f"the cached build would not load ({exc!r}); "
            else:
                self._origin = f"loaded from the cache ({_short(paths.directory)})"
                return reader
        if not force:
            failed = _read_marker(paths.failed)
            if _failed_blocks(failed):
                reason = failed.get("reason", "?") if failed else "?"
                raise ReaderUnavailable(
                    FAILED, f"{reason}; `python -m cudamem build-reader` retries"
                )
        problem = _toolchain_problem()
        if problem is not None:
            raise ReaderUnavailable(UNSUPPORTED, problem)
        seconds = build_in_subprocess(spec, paths)
        try:
            reader = load_library(paths.library, spec.module_name)
        except Exception as exc:
            reason = f"the build would not load: {exc!r}"
            _write_marker(paths.failed, {"reason": reason, "cxx": _compiler(), "time": time.time()})
            raise ReaderUnavailable(FAILED, reason) from None
        self._origin = f"{note}built in {seconds:.1f} s into {_short(paths.directory)}"
        return reader

    # -- status ----------------------------------------------------------------------

    def status(self) -> ReaderStatus:
        """Which reader serves now and why; before the reader starts, what the cache holds
        (so ``cudamem status``, which never initialises CUDA, can say what spans will use)."""
        state, reason = self._state, self._reason
        spec = self._spec
        if state == IDLE:
            if _switched_off():
                value = os.environ.get(SWITCH_ENV)
                return ReaderStatus(False, DISABLED, f"{SWITCH_ENV}={value} turns it off")
            try:
                found = self._spec_fn()
            except Exception as exc:
                return ReaderStatus(False, UNSUPPORTED, f"torch's version is unreadable: {exc!r}")
            if isinstance(found, ReaderUnavailable):
                return ReaderStatus(False, found.state, found.reason)
            return self._cache_status(found)
        cache_dir = self._paths(spec).directory if spec is not None else None
        return ReaderStatus(state == ACTIVE, state, reason, cache_dir)

    def _cache_status(self, spec: BuildSpec) -> ReaderStatus:
        paths = self._paths(spec)
        where = paths.directory
        dropped = _read_marker(paths.dropped)
        if dropped is not None:
            return ReaderStatus(
                False,
                DROPPED,
                f"dropped by an earlier process: {dropped.get('reason', '?')}; "
                "`python -m cudamem build-reader` retries",
                where,
            )
        if os.path.exists(paths.library):
            return ReaderStatus(
                False,
                CACHED,
                f"built in {_short(where)}; spans switch to it at their first read after "
                "CUDA starts",
                where,
            )
        failed = _read_marker(paths.failed)
        if _failed_blocks(failed):
            reason = failed.get("reason", "?") if failed else "?"
            return ReaderStatus(
                False, FAILED, f"{reason}; `python -m cudamem build-reader` retries", where
            )
        problem = _toolchain_problem()
        if problem is not None:
            return ReaderStatus(False, UNSUPPORTED, problem, where)
        return ReaderStatus(
            False,
            NOT_BUILT,
            "not built yet: the first span after CUDA starts builds it in the background, "
            "or run `python -m cudamem build-reader`",
            where,
        )
