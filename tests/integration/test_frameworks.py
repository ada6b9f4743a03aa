"""The framework integrations' tests (``tests/integration/frameworks``), each file in a
process of its own: Lightning, Transformers, IPython, matplotlib and torch.compile stay out
of this process's heap, which every census and holder search of the other tests walks."""

from __future__ import annotations

import pytest

from ..own_process import ROOT, run_pytest

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
    returncode, tail = run_pytest(f"tests/integration/frameworks/{name}")
    # 0: passed; 5: nothing collected (its framework is not installed: every test skipped
    # at import, which pytest reports as no tests).
    assert returncode in (0, 5), tail
    print(tail)
