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

The build subprocess loads ``native/reader_build.py`` by path (where no package exists), not
this file; the states are ``native.states``', the cache's root and loading a library are
``native.cache``'s. ``ReaderStatus.__str__`` finds the renderer registry in ``sys.modules``
instead of importing it (results never import a renderer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from .native import reader_build
from .native.cache import CACHE_ENV, cache_base
from .native.cache import load_library as _load
from .native.states import (
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
    switched_off,
)

__all__ = [
    "ACTIVE",
    "BUILDING",
    "CACHED",
    "CACHE_ENV",
    "DISABLED",
    "DROPPED",
    "FAILED",
    "IDLE",
    "NOT_BUILT",
    "READY",
    "SWITCH_ENV",
    "UNSUPPORTED",
    "BuildSpec",
    "FastReader",
    "GateLog",
    "Reader",
    "ReaderStatus",
    "ReaderUnavailable",
    "cache_key",
    "cache_root",
]

#: ``CUDAMEM_FAST_READER=0`` (or ``false``/``no``/``off``) keeps the dict path.
SWITCH_ENV = "CUDAMEM_FAST_READER"

#: The reader's sources (a header and its parts, one translation unit: ``reader_build.bundle``).
SOURCE_DIR = reader_build.SOURCE_DIR

#: Longest a build may take before it is abandoned (a hung compiler must not leave a
#: subprocess behind forever).
BUILD_TIMEOUT_S = 900.0
#: A failed build is retried by later processes after this long, or at once when the
#: compiler setting (``CXX``) changed.
RETRY_FAILED_AFTER_S = 7 * 24 * 3600.0
#: Reads that may find the counters moving (another thread allocating) or all zero before
#: the reader is validated; it stays on the dict path meanwhile.
VALIDATION_ATTEMPTS = 1000

Counters = tuple[int, int, int]

# The states (``native.states``): idle, building, ready, active; the dead ends, where the
# dict path serves: disabled, unsupported, failed, dropped; seen from a process that has not
# started the reader (``cudamem status``): cached, not built.
_FINAL = FINAL


#: The module of cudamem's renderer registry, looked up (never imported) by ``__str__``.
_REGISTRY = "cudamem.base.present"


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

    def log_drain(self, owner: int, /) -> tuple[tuple[int, ...], int]:
        """The events so far, flat (tag, allocated, peak, ns) quadruples, and how many were
        dropped past the log's bound; both emptied."""
        ...

    def log_replay(
        self, owner: int, first: int, active: bool, close: bool, forwards: bool, /
    ) -> tuple[int, int]:
        """The events since the last replay as each module call's figures, added up per
        module slot (``log_figures``): how many calls ended, and how many events were
        dropped (see ``native/src/fastread/replay.cpp``)."""
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


class ReaderUnavailable(Exception):
    """The reader cannot serve here; ``state`` says how (``failed``, ``unsupported``...)."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ReaderStatus:
    """Which counter reader serves this process, and why (``python -m cudamem status``).

    ``state`` is one of ``active`` (the C++ reader serves), ``ready``/``building`` (it
    will soon), ``cached``/``not built`` (seen from a process where CUDA has not started),
    ``disabled``, ``unsupported``, ``failed`` or ``dropped`` (the dict path serves).
    """

    json_properties: ClassVar[tuple[str, ...]] = ("reader",)

    #: Whether the C++ reader serves counter reads in this process now.
    active: bool
    state: str
    #: One sentence: why this reader, and what to do about it.
    reason: str
    #: The build directory for this torch/CUDA/ABI/source (``None`` when no build applies).
    cache_dir: str | None = None

    @property
    def reader(self) -> str:
        """``"C++"`` or ``"dict"``: what answers a counter read now."""
        return "C++" if self.active else "dict"

    def __str__(self) -> str:
        # One line (cudamem/render/reader.py), through the renderer registry where cudamem
        # has loaded it: this file imports no cudamem module (the build loads it by path).
        registry = sys.modules.get(_REGISTRY)
        return str(registry.present(self)) if registry is not None else repr(self)


# --------------------------------------------------------------------------- cache


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """Everything a build depends on; two processes with equal specs share one build."""

    torch_version: str
    torch_git: str
    cuda_version: str
    cxx11_abi: bool
    python_tag: str
    machine: str
    source: str

    @property
    def source_sha(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def key(self) -> str:
        return cache_key(
            torch_version=self.torch_version,
            torch_git=self.torch_git,
            cuda_version=self.cuda_version,
            cxx11_abi=self.cxx11_abi,
            source=self.source,
            python_tag=self.python_tag,
            machine=self.machine,
        )

    @property
    def module_name(self) -> str:
        # A C identifier (PyInit_<name>); the source hash keeps two versions apart.
        return "_cudamem_reader_" + self.source_sha[:12]


def cache_key(
    *,
    torch_version: str,
    cuda_version: str,
    cxx11_abi: bool,
    source: str,
    torch_git: str = "",
    python_tag: str | None = None,
    machine: str | None = None,
) -> str:
    """The cache directory name of one build: torch version (and commit), CUDA version, C++
    ABI, CPython tag, machine and the source's hash. Safe as a single path component."""
    tag = python_tag if python_tag is not None else (sys.implementation.cache_tag or "py")
    arch = machine if machine is not None else (platform.machine() or "unknown")
    sha = hashlib.sha256(source.encode()).hexdigest()[:12]
    parts = [
        f"torch{torch_version}" + (f"-{torch_git[:8]}" if torch_git else ""),
        f"cuda{cuda_version}",
        f"abi{int(bool(cxx11_abi))}",
        tag,
        arch,
        sha,
    ]
    return re.sub(r"[^A-Za-z0-9._+-]", "_", "-".join(parts))


def cache_root() -> str:
    """``$CUDAMEM_CACHE_DIR/reader``, else ``$XDG_CACHE_HOME/cudamem/reader``, else
    ``~/.cache/cudamem/reader``."""
    return os.path.join(cache_base(), "reader")


_library_suffix = reader_build.library_suffix


@dataclass(frozen=True, slots=True)
class _Paths:
    directory: str
    library: str
    failed: str
    dropped: str
    log: str
    lock: str

    @classmethod
    def of(cls, spec: BuildSpec, root: str | None = None) -> _Paths:
        directory = os.path.join(root or cache_root(), spec.key)
        join = os.path.join
        return cls(
            directory=directory,
            library=join(directory, spec.module_name + _library_suffix()),
            failed=join(directory, "failed.json"),
            dropped=join(directory, "dropped.json"),
            log=join(directory, "build.log"),
            lock=join(directory, "lock"),
        )


def _read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_marker(path: str, data: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs later processes a retry


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _tool_path() -> str:
    """PATH for the build: this Python's own bin directory first, where ``pip install
    ninja`` puts ninja even when the virtual environment is not activated."""
    here = os.path.dirname(os.path.abspath(sys.executable)) if sys.executable else ""
    rest = os.environ.get("PATH", os.defpath)
    return os.pathsep.join(p for p in (here, rest) if p)


def _failed_blocks(marker: dict[str, Any] | None) -> bool:
    """Whether a failed-build marker still holds: same compiler setting, recent enough."""
    if marker is None:
        return False
    when = marker.get("time")
    if not isinstance(when, (int, float)) or time.time() - when > RETRY_FAILED_AFTER_S:
        return False
    return marker.get("cxx") == _compiler()


def _cuda_home() -> str | None:
    """The CUDA toolkit to build against: the first of ``CUDA_HOME``, ``CUDA_PATH``, nvcc's
    installation and ``/usr/local/cuda`` (torch.utils.cpp_extension's search order) that has
    the runtime headers. The build is handed it as ``CUDA_HOME``, so that an nvcc wrapper
    script on PATH (``/usr/local/bin/nvcc``) does not send the compiler to a directory
    without headers."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc", path=_tool_path())
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


def _toolchain_problem() -> str | None:
    """Why a build cannot even start here (no compiler, ninja or CUDA headers), or None."""
    cxx, path = _compiler(), _tool_path()
    if shutil.which(cxx, path=path) is None:
        return f"no C++ compiler: {cxx!r} is not on PATH (install g++ or set CXX)"
    if shutil.which("ninja", path=path) is None:
        return "ninja is not on PATH (pip install ninja): torch.utils.cpp_extension needs it"
    if _cuda_home() is None:
        return (
            "no CUDA headers (cuda_runtime_api.h) under CUDA_HOME, CUDA_PATH, nvcc's "
            "directory or /usr/local/cuda: install the CUDA toolkit or set CUDA_HOME"
        )
    return None


def _error_tail(output: str, limit: int = 400) -> str:
    """The lines of a build's output that say what went wrong, shortened for one sentence."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    picked = [line for line in lines if re.search(r"\berror\b|fatal|undefined|Error", line)]
    text = " | ".join((picked or lines)[-3:]) or "no output"
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- building

#: The build subprocess: ``native/reader_build.py`` loaded by path (no package there).
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_cudamem_reader_build', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "sys.exit(mod.build_main(sys.argv[2:]))\n"
)


def build_in_subprocess(spec: BuildSpec, paths: _Paths) -> float:
    """Compile the reader into ``paths.library``; the build's seconds. Raises
    ``ReaderUnavailable`` (``failed``) with the compiler's error and writes the log."""
    os.makedirs(paths.directory, exist_ok=True)
    source_copy = os.path.join(paths.directory, spec.module_name + ".cpp")
    with open(source_copy, "w", encoding="utf-8") as fh:
        fh.write(spec.source)
    env = dict(os.environ)
    env["PATH"] = _tool_path()
    # The build needs no GPU: hide them, so that cpp_extension's arch query creates no
    # CUDA context (the arch list is unused, only a .cpp is compiled).
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    home = _cuda_home()
    if home is not None:
        env["CUDA_HOME"] = home
    argv = [
        sys.executable,
        "-c",
        _BOOTSTRAP,
        reader_build.__file__,
        paths.directory,
        spec.module_name,
        source_copy,
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = f"build timed out after {BUILD_TIMEOUT_S:.0f} s: {exc}"
        code = -1
    except OSError as exc:
        output, code = f"could not start {sys.executable!r}: {exc}", -1
    seconds = time.perf_counter() - start
    try:
        with open(paths.log, "w", encoding="utf-8") as fh:
            fh.write(output)
    except OSError:
        pass
    if code != 0 or not os.path.exists(paths.library):
        reason = f"the build failed ({_error_tail(output)}); log: {paths.log}"
        _write_marker(paths.failed, {"reason": reason, "cxx": _compiler(), "time": time.time()})
        raise ReaderUnavailable(FAILED, reason)
    _remove(paths.failed)
    return seconds


def load_library(path: str, name: str) -> Reader:
    """Import the compiled reader from ``path``."""
    reader: Reader = _load(path, name)
    return reader


# --------------------------------------------------------------------------- the manager


def _switched_off() -> bool:
    return switched_off(SWITCH_ENV)


def torch_spec() -> BuildSpec | ReaderUnavailable:
    """This process's build spec, or why no build applies (reads torch's version info)."""
    import torch

    if getattr(torch.version, "hip", None):
        return ReaderUnavailable(
            UNSUPPORTED, f"ROCm torch ({torch.__version__}): the HIP allocator is not read"
        )
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        return ReaderUnavailable(UNSUPPORTED, f"torch {torch.__version__} is built without CUDA")
    try:
        source = reader_build.bundle()
    except (OSError, ValueError) as exc:
        return ReaderUnavailable(UNSUPPORTED, f"the reader's source is missing: {exc}")
    return BuildSpec(
        torch_version=str(torch.__version__),
        torch_git=str(getattr(torch.version, "git_version", "") or ""),
        cuda_version=str(cuda),
        cxx11_abi=bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        python_tag=sys.implementation.cache_tag or "py",
        machine=platform.machine() or "unknown",
        source=source,
    )


def _short(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home) :] if home != "/" and path.startswith(home + os.sep) else path


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
