"""Each docs example says what it needs: without its optional framework it stops with one
line naming what is missing and the extra that installs it (before importing it), and
without a GPU an example that needs one says so in one line (never a traceback).

The framework is made missing by ``sys.modules[name] = None`` in the example's own process
(``import name`` then fails as it would without the package).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .. import extras
from .test_cli_docs import gen

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").rglob("*.py"))

_RUN_WITHOUT = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
path = sys.argv[2]
sys.argv = [path]
sys.path.insert(0, path.rsplit("/", 1)[0])
runpy.run_path(path, run_name="__main__")
"""


def _needs() -> list[tuple[Path, str]]:
    """(example, optional module it imports) for every example and each such module."""
    found = [(p, m) for p in EXAMPLES for m in gen.imports(p) if m in extras.EXTRA]
    assert found, "no example imports an optional framework"
    return found


def test_examples_that_need_a_framework_are_known() -> None:
    needs = {(p.name, m) for p, m in _needs()}
    assert {
        ("fit.py", "transformers"),
        ("modules.py", "transformers"),
        ("lightning_memory.py", "lightning"),
        ("transformers_memory.py", "transformers"),
        ("transformers_memory.py", "accelerate"),
        ("notebook_magics.py", "IPython"),
    } <= needs


@pytest.mark.parametrize(
    ("example", "module"), _needs(), ids=[f"{p.name}-{m}" for p, m in _needs()]
)
def test_without_its_framework_an_example_names_the_extra(example: Path, module: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT, module, str(example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    # The module made unimportable, or another the example needs that this install lacks
    # (the README's install has neither transformers nor accelerate): the first it meets.
    absent = [module] + [
        m for p, m in _needs() if p == example and importlib.util.find_spec(m) is None
    ]
    missing = {
        f"{example.name}: this example needs {extras.reason(m)[len('needs ') :]}" for m in absent
    }
    gpu = gen.needs_gpu_line(example)
    # A GPU-only example may stop at the GPU first, which is checked before its framework.
    assert proc.stderr.strip() in {*missing, gpu}, proc.stderr
    assert "Traceback" not in proc.stderr
