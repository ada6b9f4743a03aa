"""The C++ reader's build, seen from the process that needs it: what a build depends on
(``BuildSpec``, from torch's version info: ``torch_spec``), where it lives in the per-user
cache (``cache_key``, ``cache_root``, ``_Paths``), the markers a failed or disagreeing
build leaves, whether this machine can build at all (``_toolchain_problem``), and the build
subprocess (``build_in_subprocess``: ``reader_build.py`` loaded by path).
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
import time
from dataclasses import dataclass
from typing import Any

from . import reader_build
from .cache import cache_base
from .states import FAILED, UNSUPPORTED, ReaderUnavailable

__all__ = [
    "BUILD_TIMEOUT_S",
    "RETRY_FAILED_AFTER_S",
    "SOURCE_DIR",
    "BuildSpec",
    "build_in_subprocess",
    "cache_key",
    "cache_root",
    "torch_spec",
]

#: The reader's sources (a header and its parts, one translation unit: ``reader_build.bundle``).
SOURCE_DIR = reader_build.SOURCE_DIR

#: Longest a build may take before it is abandoned (a hung compiler must not leave a
#: subprocess behind forever).
BUILD_TIMEOUT_S = 900.0
#: A failed build is retried by later processes after this long, or at once when the
#: compiler setting (``CXX``) changed.
RETRY_FAILED_AFTER_S = 7 * 24 * 3600.0


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
