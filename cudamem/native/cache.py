"""Where native builds live and what names them: the per-user cache, the key over every
source of an extension, and loading a built library by path.

A build is named by a sha256 over each of its sources (every ``*.c``, ``*.h``, ``*.cpp``
and ``*.hpp`` under its folder, in sorted relative-path order: the path, a NUL, the length,
the bytes) and what else it depends on (flags, interpreter tag, suffix, machine), so that a
change of any source or header builds anew.

Standard library only, like everything the reader's build loads.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = [
    "CACHE_ENV",
    "SOURCE_SUFFIXES",
    "cache_base",
    "load_library",
    "sources",
    "sources_digest",
]

#: Overrides the cache directory (default ``$XDG_CACHE_HOME/cudamem`` or ``~/.cache/cudamem``).
CACHE_ENV = "CUDAMEM_CACHE_DIR"
#: What counts as a source of an extension (everything its build reads from its folder).
SOURCE_SUFFIXES = (".c", ".h", ".cpp", ".hpp")
#: The extensions' source folders.
SOURCE_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")


def cache_base() -> str:
    """``$CUDAMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudamem``, else ``~/.cache/cudamem``."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "cudamem")
    return base


def sources(directory: str) -> list[str]:
    """The sources under ``directory`` (relative paths with ``/``, sorted)."""
    found = []
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            if name.endswith(SOURCE_SUFFIXES):
                rel = os.path.relpath(os.path.join(parent, name), directory)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def sources_digest(directory: str, *extra: str) -> str:
    """sha256 (hex) over every source under ``directory`` (relative path, NUL, length,
    bytes; sorted by path), then each of ``extra`` (NUL-separated): the build's name."""
    digest = hashlib.sha256()
    for rel in sources(directory):
        with open(os.path.join(directory, rel), "rb") as fh:
            data = fh.read()
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()


def load_library(path: str, name: str) -> Any:
    """Import the compiled extension module ``name`` from ``path``."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
