"""The README's two commands stay runnable on a fresh machine, and CI runs the same tests."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    part = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", part, re.S)


def _pytest_args(command: str) -> list[str]:
    last = command.split("&&")[-1]
    words = shlex.split(last)
    assert words[1:3] == ["-m", "pytest"], last
    return words[3:]


def test_the_readme_has_exactly_the_demo_and_the_test_command() -> None:
    demo, tests = _commands()
    assert demo.endswith("python -m cudamem demo")
    assert "pip install -e '.[test]'" in tests
    assert _pytest_args(tests)[0] == "-q"


def test_the_test_commands_options_come_with_the_test_extra() -> None:
    args = _pytest_args(_commands()[1])
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extra = " ".join(data["project"]["optional-dependencies"]["test"])
    if "-n" in args or "--dist" in args:  # pytest-xdist's options
        assert "pytest-xdist" in extra
    # ... and nothing in pytest's own configuration needs a plugin the GPU machine lacks
    # (it has pytest alone: .ci/gpu runs its groups without xdist).
    addopts = data["tool"]["pytest"]["ini_options"].get("addopts", "")
    assert "-n" not in shlex.split(addopts) and "--dist" not in addopts


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    line = next(ln for ln in ci.splitlines() if "README command" in ln)
    assert _pytest_args(line.split(";", 1)[1].strip()) == _pytest_args(_commands()[1])
