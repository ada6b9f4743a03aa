"""A benchmark script imported by path for a test (the benchmarks are no package)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")


@contextlib.contextmanager
def benchmark(filename: str) -> Iterator[Any]:
    """``benchmarks/<filename>`` as a module; the import path and the benchmarks' own
    modules it loaded are put back after."""
    path = os.path.abspath(os.path.join(BENCHMARKS, filename))
    saved_path, saved_names = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"_bench_{filename[:-3]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved_path
        bench_dir = os.path.dirname(path)
        for name in set(sys.modules) - saved_names:  # the benchmarks' own modules only
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if name == spec.name or os.path.dirname(os.path.abspath(origin)) == bench_dir:
                del sys.modules[name]
