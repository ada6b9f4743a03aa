"""The C++ counter reader's build: what the build subprocess runs, and the one translation
unit it compiles.

The build subprocess (``reader_toolchain.build_in_subprocess``) loads this file by path, where
no package exists: it imports the standard library and torch only, never a cudamem
module, at module level or in a function (``tests/unit/test_layout.py`` checks the rule;
``tests/integration/test_fastread.py`` performs that load in a fresh process).

The reader's sources are split by concern under ``src/fastread/`` (a header and a few
``.cpp`` files). ``bundle`` joins them, in ``ORDER``, into the one translation unit the build
compiles (``torch.utils.cpp_extension.load_inline`` takes one; the parts share one anonymous
namespace, so nothing but ``PyInit`` leaves the library), each part after a ``#line`` that
names its file, so a compiler error points at the file and line it comes from.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

__all__ = ["ORDER", "SOURCE_DIR", "build_main", "bundle", "library_suffix"]

#: The reader's sources.
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "fastread")
#: The parts in the order the translation unit takes them (the header first); every source
#: of ``SOURCE_DIR`` is one of them.
ORDER = (
    "fastread.h",
    "log.cpp",
    "counters.cpp",
    "gates.cpp",
    "forward.cpp",
    "replay.cpp",
    "module.cpp",
)
_INCLUDE = '#include "fastread.h"'


def bundle(directory: str = SOURCE_DIR) -> str:
    """The one translation unit of the sources under ``directory``: each part of ``ORDER``
    after a ``#line`` naming it, its include of the header dropped (the header leads).
    ``ValueError`` when the folder holds a source ``ORDER`` does not name, or lacks one."""
    present = sorted(
        name for name in os.listdir(directory) if name.endswith((".c", ".h", ".cpp", ".hpp"))
    )
    if sorted(ORDER) != present:
        raise ValueError(f"the reader's sources are {present}, not {sorted(ORDER)}")
    parts = []
    for name in ORDER:
        with open(os.path.join(directory, name), encoding="utf-8") as fh:
            text = fh.read()
        lines = [
            f"// {line} (the bundle holds it above)" if line.strip() == _INCLUDE else line
            for line in text.splitlines()
        ]
        parts.append(f'#line 1 "fastread/{name}"\n' + "\n".join(lines) + "\n")
    return "".join(parts)


def library_suffix() -> str:
    return ".pyd" if os.name == "nt" else ".so"


def build_main(argv: list[str]) -> int:
    """Entry point of the build subprocess: ``directory module_name source_path``.

    Holds an exclusive lock on the build directory (one build at a time, for every process
    of the machine; the lock dies with its process), builds in a private subdirectory and
    moves the finished library into place atomically, so that readers never see half a file.
    """
    directory, name, source_path = argv
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, name + library_suffix())
    with open(os.path.join(directory, "lock"), "a+") as lock:
        try:
            import fcntl

            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except ImportError:  # Windows: no lock, the atomic rename still holds
            pass
        if os.path.exists(target):
            return 0  # another process built it while this one waited
        for entry in os.listdir(directory):  # left by builds that died (the lock is ours)
            if entry.startswith("build-"):
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
        import inspect
        import tempfile

        import torch.utils.cpp_extension as cpp_extension

        with open(source_path, encoding="utf-8") as fh:
            source = fh.read()
        build_dir = tempfile.mkdtemp(prefix="build-", dir=directory)
        options: dict[str, Any] = {}
        if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
            options["no_implicit_headers"] = True  # only Python.h and the allocator header
        try:
            cpp_extension.load_inline(  # type: ignore[no-untyped-call]
                name=name,
                cpp_sources=[source],
                with_cuda=True,  # CUDA headers, and -lc10_cuda for the allocator's symbol
                extra_cflags=["-O2"],
                # Nothing of libcudart/libtorch_cuda is used: keep them out of DT_NEEDED, so
                # the library loads against the CUDA runtime torch itself ships.
                extra_ldflags=["-Wl,--as-needed"] if sys.platform.startswith("linux") else [],
                build_directory=build_dir,
                verbose=False,
                is_python_module=True,  # imports it here once: every symbol resolves
                **options,
            )
            os.replace(os.path.join(build_dir, name + library_suffix()), target)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return 0
