"""The optional compiled heap pass (``_heapscan.c``): one walk of a heap snapshot finds the
referrers of any number of objects, ~10x faster than ``_heap.chunked_pass`` in Python.

Life in one process, as the counter reader's (``cudamem._fastread``):

* ``idle``: nothing at import; ``pip install`` and ``import cudamem`` compile nothing.
* The first heap pass asks ``native()``: a cached build is loaded at once; otherwise a daemon
  thread compiles one (``cc``, Python's headers, a few hundred milliseconds) into the per-user
  cache, and the Python pass serves meanwhile (no call waits for a compiler).
* ``ready`` -> the next ``native()`` validates it on a small heap whose referrers are known
  (what ``gc.get_referrers`` and the Python pass say): ``active``, else ``dropped`` with why.
* ``CUDAMEM_FAST_HEAP=0``, no compiler, a failed build: ``disabled``/``failed``, and the
  Python pass serves. ``status()`` says which and why.

The traversal runs no Python code and calls no dunder; the pass keeps no reference after it
returns; callbacks (the search's own) run between traversals. See ``_heapscan.c``.

``walk`` (Python 3.11 to 3.13) lists the snapshot off gc's lists in place and records its
edge cache in the same walk: validated against three ``gc.get_objects`` listings and a pass
over its recording. The references it keeps (arrays and untracked containers leading to one,
in array mode) live in the edge cache, which its caller drops with the snapshot; the first
array-mode pass lets them go.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

from . import _fastread

__all__ = ["SWITCH_ENV", "HeapScanStatus", "native", "status", "wait"]

SWITCH_ENV = "CUDAMEM_FAST_HEAP"
SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_heapscan.c")
BUILD_TIMEOUT_S = 120.0

IDLE, BUILDING, READY, ACTIVE = "idle", "building", "ready", "active"
DISABLED, FAILED, DROPPED, UNSUPPORTED = "disabled", "failed", "dropped", "unsupported"


@dataclass(frozen=True, slots=True)
class HeapScanStatus:
    """Which heap pass serves the holder search, and why."""

    #: Whether the compiled pass serves now.
    active: bool
    state: str
    reason: str
    path: str | None = None


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = IDLE
        self.reason = "not needed yet (no holder search has run)"
        self.module: ModuleType | None = None
        self.path: str | None = None
        self.thread: threading.Thread | None = None


_s = _State()


def _source() -> bytes:
    with open(SOURCE_PATH, "rb") as fh:
        return fh.read()


def _paths() -> tuple[str, str]:
    """(module name, library path) of the build of this source for this Python."""
    source = _source()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(
        source + (sys.implementation.cache_tag or "py").encode() + suffix.encode()
    ).hexdigest()[:12]
    name = f"_cudamem_heapscan_{key}"
    root = os.path.join(os.path.dirname(_fastread.cache_root()), "heapscan")
    arch = platform.machine() or "unknown"
    return name, os.path.join(root, f"{sys.implementation.cache_tag}-{arch}", name + suffix)


def _compiler() -> str | None:
    """``$CC`` (or ``cc``) when it is on PATH."""
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc.split()[0]) else None


def build(path: str, name: str) -> None:
    """Compile the pass into ``path`` (atomically); ``RuntimeError`` with the compiler's
    words on failure."""
    cc = _compiler()
    include = sysconfig.get_paths().get("include")
    if cc is None:
        raise RuntimeError("no C compiler (cc, or $CC) on PATH")
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        raise RuntimeError(f"no Python.h in {include!r} (install Python's development headers)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=os.path.dirname(path))
    os.close(fd)
    argv = [
        *cc.split(),
        "-O2",
        "-shared",
        "-fPIC",
        f"-I{include}",
        f"-DCUDAMEM_HEAPSCAN_NAME={name}",
        SOURCE_PATH,
        "-o",
        tmp,
    ]
    if sys.platform == "darwin":  # Python's symbols resolve when the interpreter loads it
        argv[1:1] = ["-undefined", "dynamic_lookup"]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=BUILD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"the build failed: {' | '.join(tail) or 'no output'}")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _background(path: str, name: str) -> None:
    try:
        if not os.path.exists(path):
            build(path, name)
        module = cast(ModuleType, _fastread.load_library(path, name))
    except Exception as exc:  # reported through status(); the Python pass serves
        with _s.lock:
            _s.state, _s.reason = FAILED, f"{type(exc).__name__}: {exc}"
        return
    with _s.lock:
        _s.module, _s.path = module, path
        _s.state, _s.reason = READY, "built; validated at its first use"


def _start() -> None:
    """First use: load the cached build, or start building one (caller holds the lock)."""
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        _s.state, _s.reason = DISABLED, f"{SWITCH_ENV}={os.environ[SWITCH_ENV]} turns it off"
        return
    if os.name == "nt" or sys.implementation.name != "cpython":
        _s.state, _s.reason = UNSUPPORTED, "the compiled pass is built for CPython on POSIX"
        return
    name, path = _paths()
    _s.path = path
    _s.state, _s.reason = BUILDING, "compiling in the background; the Python pass serves"
    _s.thread = threading.Thread(
        target=_background, args=(path, name), name="cudamem-heapscan-build", daemon=True
    )
    _s.thread.start()


def native() -> Any:
    """The compiled pass's module when it is active, else ``None`` (never waits)."""
    module = _s.module
    if module is not None and _s.state == ACTIVE:
        return module
    with _s.lock:
        if _s.state == IDLE:
            _start()  # a cached build loads in the thread within milliseconds
            return None
        if _s.state != READY or _s.module is None:
            return None
        problem = validate(_s.module)
        if problem is not None:
            _s.state, _s.reason, _s.module = DROPPED, problem, None
            return None
        _s.state, _s.reason = ACTIVE, f"compiled pass, validated ({_s.path})"
        return _s.module


def wait(timeout: float = 60.0) -> HeapScanStatus:
    """Start the build if needed, wait for it, validate; the status afterwards (benchmarks
    and tests use this; the search itself never waits)."""
    native()
    thread = _s.thread
    if thread is not None:
        thread.join(timeout)
    native()
    return status()


def status() -> HeapScanStatus:
    with _s.lock:
        return HeapScanStatus(_s.state == ACTIVE, _s.state, _s.reason, _s.path)


@contextlib.contextmanager
def python_pass() -> Any:
    """Within the block the Python pass serves (tests compare the two)."""
    saved = _s.module, _s.state
    with _s.lock:
        _s.module, _s.state = None, DISABLED
    try:
        yield
    finally:
        with _s.lock:
            _s.module, _s.state = saved


def validate(module: Any) -> str | None:
    """Why ``module`` cannot serve (its answer differs from ``gc.get_referrers`` on a heap
    whose referrers are known), or ``None``."""

    class Box:
        pass

    target = Box()
    other = Box()
    holders: list[Any] = [[target], {"k": target}, (target, 1), Box(), {target: 1}, [other]]
    holders[3].attr = target
    heap = list(holders) + [Box() for _ in range(3000)] + [[1, 2], {"x": other}]
    try:
        found: list[Any] = []
        added: list[int] = []

        def hit(o: Any) -> bool:
            found.append(o)
            return False

        expected = [o for o in gc.get_referrers(target) if any(o is h for h in heap)]

        def wrong(cache: Any) -> str | None:
            found.clear()
            finished, last, whole = module.scan(
                heap, {id(target)}, added, hit, None, None, None, None, cache
            )
            if not (finished and whole and last == -1):
                return f"the compiled pass reported ({finished}, {last}, {whole}) on a full pass"
            if {id(o) for o in found} != {id(o) for o in expected} or len(found) != len(expected):
                return "the compiled pass's referrers differ from gc.get_referrers'"
            return None

        problem = wrong(None)
        if problem is not None:
            return problem
        # With an edge cache: the first pass records, the second reads the recording.
        edges = module.edges(1 << 20)
        problem = wrong(edges) or wrong(edges)
        if problem is not None:
            return problem
        if module.edges_info(edges)[0] != (len(heap) + 1023) // 1024:
            return "the compiled pass's edge cache did not record the heap"
        # The in-place walk of gc's lists: the same objects, in gc.get_objects()'s order.
        listed = [o for o in gc.get_objects() if type(o) is Box]
        walked = module.gc_instances((Box,))
        same = len(walked) == len(listed) and all(
            a is b for a, b in zip(walked, listed, strict=True)
        )
        listed.clear()
        walked.clear()
        if not same:
            return "the compiled walk of gc's lists differs from gc.get_objects()"
        return _wrong_walk(module, Box, target, expected) if hasattr(module, "walk") else None
    except Exception as exc:
        return f"the compiled pass failed its check: {type(exc).__name__}: {exc}"
    finally:
        heap.clear()
        holders.clear()


def _wrong_walk(module: Any, kind: type, target: Any, expected: list[Any]) -> str | None:
    """Why ``module.walk`` cannot serve: its listing is not the three generations' listings
    oldest first, its ``found`` not the objects of ``kind`` in ``gc.get_objects()``'s order,
    or a pass reading the edge cache it recorded misses ``target``'s referrers."""
    was = gc.isenabled()
    gc.disable()  # a collection in between would move objects between generations
    young: list[Any] = []
    middle = old = objs = found = listing = young
    try:
        young = gc.get_objects(generation=0)
        middle = gc.get_objects(generation=1)
        old = gc.get_objects(generation=2)
        cache = module.edges(1 << 26)
        objs, _sizes, found = module.walk((kind,), cache, None)
        listing = old + middle + young
        # What was made after the listing (the listings, the call's argument tuples) is the
        # youngest: it ends the walk's listing.
        n = len(listing)
        if not n <= len(objs) <= n + 16 or not all(
            a is b for a, b in zip(objs[:n], listing, strict=True)
        ):
            return "the compiled walk lists the heap otherwise than gc.get_objects()"
        mine = [o for o in young + middle + old if type(o) is kind]
        same = len(mine) == len(found) and all(a is b for a, b in zip(mine, found, strict=True))
        mine.clear()
        if not same:
            return "the compiled walk's objects of a type differ from gc.get_objects()'"
        hits: list[Any] = []

        def hit(o: Any) -> bool:
            hits.append(o)
            return False

        module.scan(objs, {id(target)}, [], hit, None, None, None, None, cache)
        want = {id(o) for o in expected}
        got = {id(o) for o in hits if id(o) in want}
        hits.clear()
        if got != want:
            return "a pass over the compiled walk's edge cache misses referrers"
        return None
    finally:
        for lst in (young, middle, old, objs, found, listing):
            lst.clear()
        if was:
            gc.enable()
