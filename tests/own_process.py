"""Test files that run in a pytest process of their own when the whole suite runs.

Their censuses and holder searches over every live CPU storage climb from the tests' own
tensors (a fixture's value, a module global) through pytest's objects to the session, and
walk all of it: in a process that collected the whole suite (each xdist worker does) they ran
5 to 15 times slower than with their own file collected alone (``test_leaks.py``: 25 s alone, 130
to 330 s on a worker of the full run). ``tests/integration/test_own_process.py``
runs each file in its own ``python -m pytest`` process, and ``tests/conftest.py`` leaves
them out of the process that runs it; a file named on the command line, or any run with
``-m`` or ``-k``, collects them as before (the GPU runs name these files with ``-m cuda``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FILES = (
    "tests/integration/test_culprits.py",
    "tests/integration/test_deep_paths.py",
    "tests/integration/test_integration_memviz.py",
    "tests/integration/test_integration_pytest.py",
    "tests/integration/test_leaks.py",
    "tests/integration/test_leaks_order.py",
    "tests/integration/test_oom.py",
)
PATHS = frozenset(ROOT / f for f in FILES)
#: Set in the processes ``test_own_process.py`` starts: there the files are collected.
ENV = "CUDAMEM_TESTS_OWN_PROCESS"


def run_pytest(path: str, *options: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m pytest -q <options> <path>`` from the repository root in a process of its
    own (no xdist, no cache, this checkout first on the path): its exit status and the last
    6,000 characters of its output."""
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    full.pop("PYTEST_XDIST_WORKER", None)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    out = subprocess.run(
        [*pytest, *options, path],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    return out.returncode, (out.stdout + out.stderr)[-6000:]
