"""The framework integrations' tests (``tests/integration/frameworks``), each file in a
process of its own: Lightning, Transformers, IPython, matplotlib and torch.compile stay out
of this process's heap, which every census and holder search of the other tests walks."""

from __future__ import annotations

import re

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


_COUNT = re.compile(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)\b")
_SKIPPED = re.compile(r"^SKIPPED \[\d+\] [^:]+(?::\d+)?: (?P<reason>.+)$", re.M)


def inner_outcome(returncode: int, tail: str) -> tuple[str, str]:
    """What an inner run of one framework file comes to: ``("passed", "")`` when some test
    passed and none failed, ``("skipped", reasons)`` when nothing passed and every test (or
    the file, at import: its framework missing) skipped, ``("failed", why)`` otherwise."""
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    counts = {
        kind.rstrip("s") if kind.startswith("error") else kind: int(n)
        for n, kind in _COUNT.findall(summary)
    }
    if returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        return "failed", tail
    if counts.get("passed"):
        return "passed", ""
    reasons = sorted(set(_SKIPPED.findall(tail)))
    if not reasons:
        return "failed", f"nothing passed and no test skipped:\n{tail}"
    return "skipped", "; ".join(reasons)


def test_an_inner_skip_is_a_skip_with_its_reason() -> None:
    missing = (
        "SKIPPED [1] tests/integration/frameworks/test_lightning.py:19: needs lightning: "
        "pip install 'cudamem[lightning]'\n1 skipped in 0.51s"
    )
    assert inner_outcome(5, missing) == (
        "skipped",
        "needs lightning: pip install 'cudamem[lightning]'",
    )
    assert inner_outcome(0, missing) == (
        "skipped",
        "needs lightning: pip install 'cudamem[lightning]'",
    )
    mixed = "SKIPPED [2] tests/x.py:3: needs a CUDA GPU\n4 passed, 2 skipped in 3.10s"
    assert inner_outcome(0, mixed) == ("passed", "")
    assert inner_outcome(1, "1 failed, 3 passed in 2.00s")[0] == "failed"
    assert inner_outcome(5, "no tests ran in 0.01s")[0] == "failed"


@pytest.mark.parametrize("name", FILES)
def test_framework_file(name: str) -> None:
    returncode, tail = run_pytest(f"tests/integration/frameworks/{name}", "-rs")
    outcome, why = inner_outcome(returncode, tail)
    print(tail)
    if outcome == "skipped":
        pytest.skip(why)
    assert outcome == "passed", why
