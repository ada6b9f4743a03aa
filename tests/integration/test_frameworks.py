"""The framework integrations' tests (``tests/integration/frameworks``), each file in a
process of its own: Lightning, Transformers, IPython, matplotlib and torch.compile stay out
of this process's heap, which every census and holder search of the other tests walks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p.name for p in (ROOT / "tests" / "integration" / "frameworks").glob("test_*.py"))


def test_every_framework_file_is_run_here() -> None:
    assert FILES == [
        "test_compile.py",
        "test_lightning.py",
        "test_modules_gpt2.py",
        "test_notebook.py",
        "test_plot.py",
        "test_transformers.py",
    ]


@pytest.mark.parametrize("name", FILES)
def test_framework_file(name: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"tests/integration/frameworks/{name}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    tail = (out.stdout + out.stderr)[-6000:]
    # 0: passed; 5: nothing collected (its framework is not installed: every test skipped
    # at import, which pytest reports as no tests).
    assert out.returncode in (0, 5), tail
    print(tail)
