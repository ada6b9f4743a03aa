"""The README's two commands stay runnable on a fresh machine, and CI runs the same tests."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import pytest

from .. import extras

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "readme_commands", ROOT / ".ci" / "readme_commands.py"
)
assert _SPEC is not None and _SPEC.loader is not None
readme_commands: ModuleType = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(readme_commands)


def _commands() -> list[str]:
    """The demo and the test command, as .ci/run reads them out of README.md."""
    found = readme_commands.commands((ROOT / "README.md").read_text(encoding="utf-8"))
    return [found["demo"], found["tests"]]


def test_the_marked_blocks_are_the_two_commands_section() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    part = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"```sh\n(.*?)\n```", part, re.S) == _commands()


def test_a_marker_that_is_missing_or_twice_is_an_error() -> None:
    block = "<!-- ci: {} -->\n```sh\n{}\n```\n"
    both = block.format("demo", "a") + block.format("tests", "b")
    assert readme_commands.commands(both) == {"demo": "a", "tests": "b"}
    with pytest.raises(ValueError, match="no marked block for tests"):
        readme_commands.commands(block.format("demo", "a"))
    with pytest.raises(ValueError, match="marks 'demo' twice"):
        readme_commands.commands(both + block.format("demo", "c"))
    with pytest.raises(ValueError, match="more than one line"):
        readme_commands.commands(block.format("demo", "a\nb") + block.format("tests", "b"))


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


def _ci_lines() -> list[str]:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_ci_runs_the_readme_commands_first_each_in_a_fresh_venv() -> None:
    lines = _ci_lines()
    reads = [ln for ln in lines if "readme_commands.py" in ln]
    assert reads == [
        "demo=$(python3 .ci/readme_commands.py demo)",
        "tests=$(python3 .ci/readme_commands.py tests)",
    ]
    runs = [i for i, ln in enumerate(lines) if ln.startswith("bash -euo pipefail -c")]
    assert [lines[i] for i in runs] == [
        'bash -euo pipefail -c "$demo"',
        'bash -euo pipefail -c "$tests"',
    ]
    # each after a fresh venv, and before anything else is installed
    assert all(lines[i - 1] == "rm -rf .venv" for i in runs)
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln]
    assert installs and min(installs) > max(runs)


def test_every_extra_named_by_a_skip_installs_its_module() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    optional = data["project"]["optional-dependencies"]
    for module, extra in extras.EXTRA.items():
        dists = [re.split(r"[<>=!\[ ]", req)[0].lower() for req in optional[extra]]
        assert module.lower() in dists, (module, extra)
        # the smallest extra that installs it
        smaller = [e for e, reqs in optional.items() if len(reqs) < len(optional[extra])]
        assert not any(
            module.lower() in [re.split(r"[<>=!\[ ]", r)[0].lower() for r in optional[e]]
            for e in smaller
        ), (module, extra)
    assert extras.reason("lightning.pytorch") == "needs lightning: pip install 'cudamem[lightning]'"


def test_ci_runs_again_every_test_file_that_needs_an_extra() -> None:
    """A file that skips without a framework runs in CI once the extras are installed: in
    the framework folder (``test_frameworks.py`` runs it) or named in .ci/run's rerun."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    rerun = set(re.findall(r"tests/integration/[\w/]+\.py", ci))
    assert "tests/integration/test_frameworks.py" in rerun
    needing = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests" / "integration").rglob("test_*.py")
        if re.search(r"\bextras\.need\(", p.read_text(encoding="utf-8"))
    }
    frameworks = {p for p in needing if p.startswith("tests/integration/frameworks/")}
    assert frameworks and needing - frameworks <= rerun, needing - frameworks - rerun
