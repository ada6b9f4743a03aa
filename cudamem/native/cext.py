"""cudamem's own optional C extensions (the heap pass, the span core): one life for each.

* ``idle``: nothing at import; ``pip install`` and ``import cudamem`` compile nothing.
* The first use asks ``native()``: a cached build is loaded at once; otherwise a daemon
  thread compiles one (``cc``, Python's headers, well under a second) into the per-user
  cache, and the pure-Python path serves meanwhile (no call waits for a compiler).
* ``ready`` -> the next ``native()`` validates it (the extension's own check): ``active``,
  else ``dropped`` with why. A user of the module may still ``drop()`` it later (a check of
  its own failed).
* The switch variable set to ``0``, no compiler, a failed build: ``disabled``/``failed``,
  and Python serves. ``status()`` says which and why.

An extension ``stem`` is the folder ``cudamem/native/src/{stem}/``: every ``*.c`` there is
compiled into one library, its headers beside them. A hash over every source and header of
the folder and the compiler's flags name the build (``native.cache.sources_digest``), so a
change of any file or flag builds anew. The module name reaches the sources as
``CUDAMEM_MODULE_NAME``. The states are ``native.states``'.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, cast

from .cache import SOURCE_ROOT, cache_base, load_library, sources, sources_digest
from .states import (
    ACTIVE,
    BUILDING,
    DISABLED,
    DROPPED,
    FAILED,
    FINAL,
    IDLE,
    READY,
    UNSUPPORTED,
    ExtensionStatus,
    switched_off,
)

__all__ = ["FINAL", "Extension", "ExtensionStatus", "compiler"]

BUILD_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """``$CC`` (or ``cc``) when it is on PATH."""
    cc = os.environ.get("CC") or "cc"
    return cc if shutil.which(cc.split()[0]) else None


def _flags() -> list[str]:
    """The compiler's flags for this platform (part of a build's name)."""
    flags = ["-O2", "-shared", "-fPIC", "-fvisibility=hidden"]
    if sys.platform.startswith("linux"):  # the heap walk's side thread (older glibc)
        flags.insert(0, "-pthread")
    if sys.platform == "darwin":  # Python's symbols resolve when the interpreter loads it
        flags[:0] = ["-undefined", "dynamic_lookup"]
    return flags


class Extension:
    """One optional C extension: its source, its cache, its state."""

    def __init__(
        self,
        *,
        stem: str,
        name: str,
        switch_env: str,
        idle_reason: str,
        exports: tuple[str, ...],
        validate: Callable[[Any], str | None] | None = None,
    ) -> None:
        #: Cache folder and module-name prefix (``heapscan``, ``spancore``); the sources are
        #: ``cudamem/native/src/{stem}/``.
        self.stem = stem
        #: What it does, as ``cudamem status`` names it: "heap pass", "span core".
        self.name = name
        self.source = os.path.join(SOURCE_ROOT, stem)
        self.switch_env = switch_env
        #: What it is, in a reason: "compiled heap pass", "compiled span core".
        self.what = f"compiled {name}"
        #: The functions a build must have; ``validate`` is the extension's own check beyond.
        self.exports = exports
        self.validate = validate
        self.lock = threading.Lock()
        self.state = IDLE
        self.reason = idle_reason
        self.module: ModuleType | None = None
        self.path: str | None = None
        self.thread: threading.Thread | None = None

    # -- where the build lives ------------------------------------------------------

    def key(self) -> str:
        """The build's name: every source and header of the folder, the flags, this
        interpreter's tag, the library suffix and the machine (``sources_digest``)."""
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        tag = sys.implementation.cache_tag or "py"
        arch = platform.machine() or "unknown"
        return sources_digest(self.source, " ".join(_flags()), tag, suffix, arch)

    def paths(self) -> tuple[str, str]:
        """(module name, library path) of the build of these sources for this Python."""
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        name = f"_cudamem_{self.stem}_{self.key()[:12]}"
        root = os.path.join(cache_base(), self.stem)
        arch = platform.machine() or "unknown"
        return name, os.path.join(root, f"{sys.implementation.cache_tag}-{arch}", name + suffix)

    def build(self, path: str, name: str) -> None:
        """Compile every C file of the folder into ``path`` (atomically); ``RuntimeError``
        with the compiler's words on failure."""
        cc = compiler()
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
            *_flags(),
            f"-I{include}",
            f"-I{self.source}",
            f"-DCUDAMEM_MODULE_NAME={name}",
            *[os.path.join(self.source, c) for c in sources(self.source) if c.endswith(".c")],
            "-o",
            tmp,
        ]
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

    # -- life -----------------------------------------------------------------------

    def _background(self, path: str, name: str) -> None:
        try:
            if not os.path.exists(path):
                self.build(path, name)
            module = cast(ModuleType, load_library(path, name))
        except Exception as exc:  # reported through status(); Python serves
            with self.lock:
                self.state, self.reason = FAILED, f"{type(exc).__name__}: {exc}"
            return
        with self.lock:
            self.module, self.path = module, path
            self.state, self.reason = READY, "built; validated at its first use"

    def _start(self) -> None:
        """First use: load the cached build, or start building one (caller holds the lock)."""
        if switched_off(self.switch_env):
            env = self.switch_env
            self.state, self.reason = DISABLED, f"{env}={os.environ[env]} turns it off"
            return
        if os.name == "nt" or sys.implementation.name != "cpython":
            self.state, self.reason = UNSUPPORTED, f"the {self.what} is built for CPython on POSIX"
            return
        name, path = self.paths()
        self.path = path
        self.state = BUILDING
        self.reason = "compiling in the background; the Python path serves"
        self.thread = threading.Thread(
            target=self._background,
            args=(path, name),
            name=f"cudamem-{self.stem}-build",
            daemon=True,
        )
        self.thread.start()

    def native(self) -> Any:
        """The module when it is active, else ``None`` (never waits)."""
        module = self.module
        if module is not None and self.state == ACTIVE:
            return module
        with self.lock:
            if self.state == IDLE:
                self._start()  # a cached build loads in the thread within milliseconds
                return None
            if self.state != READY or self.module is None:
                return None
            problem = self.check(self.module)
            if problem is not None:
                self.state, self.reason, self.module = DROPPED, problem, None
                return None
            self.state, self.reason = ACTIVE, f"{self.what}, validated ({self.path})"
            return self.module

    def check(self, module: Any) -> str | None:
        """Why ``module`` cannot serve (an export missing, or the extension's own
        ``validate`` says why), or ``None``."""
        missing = [n for n in self.exports if not callable(getattr(module, n, None))]
        if missing:
            return f"the {self.what} lacks {', '.join(missing)}"
        return None if self.validate is None else self.validate(module)

    def settled(self) -> bool:
        """Whether no later ``native()`` can change the answer (active, or never will be)."""
        return self.state in FINAL

    def drop(self, reason: str) -> None:
        """Stop serving: a check of the module's user failed (``reason`` says which)."""
        with self.lock:
            self.state, self.reason, self.module = DROPPED, reason, None

    def wait(self, timeout: float = 60.0) -> ExtensionStatus:
        """Start the build if needed, wait for it, validate; the status afterwards
        (benchmarks and tests use this; the library itself never waits)."""
        self.native()
        thread = self.thread
        if thread is not None:
            thread.join(timeout)
        self.native()
        return self.status()

    def status(self) -> ExtensionStatus:
        with self.lock:
            return ExtensionStatus(
                self.name, self.state == ACTIVE, self.state, self.reason, self.path
            )

    @contextlib.contextmanager
    def python_path(self) -> Iterator[None]:
        """Within the block the Python path serves (tests compare the two)."""
        saved = self.module, self.state
        with self.lock:
            self.module, self.state = None, DISABLED
        try:
            yield
        finally:
            with self.lock:
                self.module, self.state = saved
