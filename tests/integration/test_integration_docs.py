"""The integration guides show real runs of ``docs/examples/integrations/*.py``: each example
runs here (on the CPU, skipped without its framework) and must still print every line its
page shows, timings and column widths aside.

These examples live apart from ``docs/examples/*.py`` because they need optional frameworks
(``docs/gen_outputs.py`` runs every top-level example, on any install).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .. import extras

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples" / "integrations"
GUIDE = ROOT / "docs" / "guide"

_TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:ns|µs|us|ms|s)\b")
_SPACE = re.compile(r"[ \t]+")
_RULE = re.compile(r"-{2,}")


#: How many further holders a line folds away: it varies with what the interpreter has cached.
_MORE = re.compile(r"\(\+\d+( more)?\)")


def normalise(line: str) -> str:
    line = _MORE.sub(r"(+N\1)", line)
    return _SPACE.sub(" ", _RULE.sub("--", _TIME.sub("<time>", line))).strip()


def page_block(page: str, anchor: str) -> list[str]:
    """The lines of the first ```text block after ``anchor`` on ``page``."""
    text = (GUIDE / page).read_text(encoding="utf-8")
    start = text.index("```text\n", text.index(anchor)) + len("```text\n")
    return text[start : text.index("```", start)].splitlines()


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    # pytest cuts its short summary to the terminal's width except under CI/BUILD_NUMBER:
    # the examples run as on a user's terminal, wherever the suite runs.
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    env = dict(
        base,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        CUDA_VISIBLE_DEVICES="",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTHONHASHSEED="0",
        COLUMNS="80",
    )
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def needs(*modules: str) -> None:
    for m in modules:
        extras.need(m)


def assert_page_lines_printed(lines: list[str], output: str, *, skip: str = "^$") -> None:
    printed = {normalise(line) for line in output.splitlines()}
    ignore = re.compile(skip)
    missing = [
        line
        for line in lines
        if line.strip() and not ignore.search(line) and normalise(line) not in printed
    ]
    assert not missing, f"the page shows lines the example no longer prints: {missing}\n{output}"


def test_pytest_example() -> None:
    proc = run(
        [
            "-m",
            "pytest",
            "-p",
            "pytest_cudamem",
            "-p",
            "no:cacheprovider",
            "-q",
            "docs/examples/integrations/pytest_limits.py",
        ]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # two tests fail, as designed
    lines = page_block("pytest.md", "## What a failure says")[1:]  # after the $ line
    assert_page_lines_printed(lines, proc.stdout + proc.stderr, skip=r"^USDT:")
    assert "FAILED docs/examples/integrations/pytest_limits.py::test_keeps_a_batch" in proc.stdout
    assert "FAILED docs/examples/integrations/pytest_limits.py::test_peak_too_high" in proc.stdout


def test_lightning_example() -> None:
    needs("lightning")
    proc = run(["docs/examples/integrations/lightning_memory.py"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The example path is one of the five equal outputs, whichever the census lists first.
    lines = page_block("lightning.md", "## A run, and a leak caught")
    assert_page_lines_printed(lines, proc.stdout, skip=r"^\s+e\.g\. ")
    assert "    e.g. __main__.model.seen[" in proc.stdout


def test_transformers_example() -> None:
    needs("transformers", "accelerate")
    proc = run(["docs/examples/integrations/transformers_memory.py"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert_page_lines_printed(page_block("transformers.md", "log history reads"), out)
    assert_page_lines_printed(page_block("transformers.md", "which still has its own"), out)
    assert_page_lines_printed(page_block("transformers.md", "then, after `del model`"), out)


def test_notebook_example() -> None:
    needs("IPython")
    proc = run(["docs/examples/integrations/notebook_magics.py"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_page_lines_printed(page_block("notebooks.md", "## A session"), proc.stdout)
