"""The docs' examples run on the CPU, and the outputs the docs show are what they print.

``docs/gen_outputs.py`` writes ``docs/output/*.txt`` from real runs; these tests run every
example again and compare (timings, addresses and column widths aside), so an output that
drifts from the code fails here. ``python docs/gen_outputs.py`` rewrites the files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from .. import extras

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("gen_outputs", ROOT / "docs" / "gen_outputs.py")
assert _SPEC is not None and _SPEC.loader is not None
gen: ModuleType = importlib.util.module_from_spec(_SPEC)
sys.modules["gen_outputs"] = gen  # dataclasses look their module up
_SPEC.loader.exec_module(gen)

EXAMPLES = gen.examples()
INCLUDE = re.compile(r'--8<-- "(?P<path>[^":]+)(?::(?P<section>[a-z][-_0-9a-z]*))?"')


@cache
def _run(name: str) -> object:
    return gen.run(gen.EXAMPLES / f"{name}.py", gpu=False)


def cpu_run(name: str) -> object:
    """The example's CPU run; a skip naming the extra to install where it imports an optional
    framework that is missing here."""
    for module in gen.imports(gen.EXAMPLES / f"{name}.py"):
        if module in extras.EXTRA:
            extras.need(module)
    return _run(name)


def test_there_are_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"leaks", "oom", "quickstart", "scalars", "spans", "train", "who_holds"} <= names


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_example_runs_on_the_cpu(name: str) -> None:
    run = cpu_run(name)
    if run.needs_gpu:
        # one clear line, never torch's "Torch not compiled with CUDA enabled"
        assert run.output.strip() == f"{name}.py: this example needs a CUDA GPU"
        assert not gen.output_file(gen.EXAMPLES / f"{name}.py", gpu=False).exists()
        return
    assert run.returncode == 0, run.output[-3000:]
    assert "Traceback" not in run.output
    assert "AssertionError" not in run.output


@cache
def _same_environment() -> str | None:
    """Why the committed CPU outputs cannot be compared here, or None when they can."""
    recorded = json.loads(gen.environment_file(gpu=False).read_text(encoding="utf-8"))
    here = gen.environment()
    differs = [
        f"{k} {recorded.get(k)!r} there, {here.get(k)!r} here"
        for k in here
        if here[k] != recorded.get(k)
    ]
    return "; ".join(differs) or None


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_committed_cpu_output_matches_a_fresh_run(name: str) -> None:
    why = _same_environment()
    if why is not None:
        pytest.skip(f"docs/output was written elsewhere ({why})")
    run = cpu_run(name)
    if run.needs_gpu:
        pytest.skip("needs a GPU: no CPU output")
    assert run.returncode == 0, run.output[-3000:]
    path = gen.output_file(gen.EXAMPLES / f"{name}.py", gpu=False)
    assert path.exists(), f"{path} is missing: run python docs/gen_outputs.py"
    committed = gen.normalise(path.read_text(encoding="utf-8"))
    fresh = gen.normalise(gen.to_snippets(run.output))
    assert committed == fresh, f"{path.name} drifted: run python docs/gen_outputs.py"


def test_normalise_keeps_what_matters() -> None:
    n = gen.normalise
    assert n("create: no CUDA device in use, 131.2 ms") == n("create: no CUDA device in use, 2 ms")
    assert n("exit code 0 after 1.05 s") == n("exit code 0 after 12.30 s")
    assert n("time mean 137 µs  0") == n("time mean  27.3 ms  0")
    assert n("-----  ----\nab  c") == n("---  --------\nab     c")
    assert n("(2026-12-01T09:06:58, oom_report())") == n("(2027-01-02T10:00:00, oom_report())")
    assert n("pid 1410 at 0x7f00aa") == n("pid 99 at 0x1")
    # what the docs say must still differ
    assert n("4.0 MiB: 1 holder") != n("4.0 MiB: 2 holders")
    assert n("saved result (+2 more)") != n("saved result (+1 more)")
    assert n("5 calls") != n("6 calls") and n("5 storages") != n("4 storages")
    assert n("256.0 MiB") != n("257.0 MiB")
    # a host section's first line: RSS/PSS/USS as the OS measured them
    assert n("host at exit (pid 12: RSS 300.0 MiB, USS 2.0 MiB)\n  CPU tensors: 4.0 MiB") == n(
        "host at exit (pid 99: RSS 310.5 MiB, USS 2.5 MiB)\n  CPU tensors: 4.0 MiB"
    )
    assert n("host, this process (pid 1: RSS 1 B)\n  CPU tensors: 4.0 MiB") != n(
        "host, this process (pid 1: RSS 1 B)\n  CPU tensors: 5.0 MiB"
    )
    # measured- sections: the OS's figures vary, their words do not
    measured = "--8<-- [start:measured-x]\nUSS {} grew by {}\n--8<-- [end:measured-x]\n{}"
    assert n(measured.format("12.0 MiB", "+1 B", "4.0 MiB")) == n(
        measured.format("13.5 MiB", "+2.0 GiB", "4.0 MiB")
    )
    assert n(measured.format("1 B", "1 B", "4.0 MiB")) != n(
        measured.format("1 B", "1 B", "5.0 MiB")
    )
    assert n(measured.format("1 B", "1 B", "")) != n(
        measured.format("1 B", "1 B", "").replace("USS", "RSS")
    )
    # a finished loader's workers: whether the last look saw them exit is the OS's timing
    table = (
        "--8<-- [start:measured-r]\n"
        "    worker    pid  USS first       USS{state_h}\n"
        "    ------  -----  ---------  --------{state_d}\n"
        "         0  15679   12.2 MiB  36.7 MiB{state}\n"
        "--8<-- [end:measured-r]\n"
    )
    plain = table.format(state_h="", state_d="", state="")
    exited = table.format(state_h="  state", state_d="  ------", state="  exited")
    assert n(plain) == n(exited)
    assert n(plain) != n(exited.replace("15679   12.2 MiB", "15679   12.2 MiB  1.0 MiB"))
    assert n(plain.replace("measured-r", "report")) != n(exited.replace("measured-r", "report"))


def test_to_snippets_turns_markers_into_sections() -> None:
    text = gen.to_snippets(f"head\n=== one ===\na\n\n=== two-b ===\nb\n{ROOT}/docs/x.py:3\n")
    assert text == (
        "head\n--8<-- [start:one]\na\n--8<-- [end:one]\n"
        "--8<-- [start:two-b]\nb\ndocs/x.py:3\n--8<-- [end:two-b]\n"
    )
    assert gen.to_snippets("=== Not A Section ===\n") == "=== Not A Section ===\n"


def _includes() -> list[tuple[Path, str, str | None]]:
    pages = [*(ROOT / "docs").rglob("*.md")]
    found = []
    for page in pages:
        for m in INCLUDE.finditer(page.read_text(encoding="utf-8")):
            found.append((page, m["path"], m["section"]))
    return found


def test_every_included_output_exists_and_comes_from_an_example() -> None:
    includes = _includes()
    assert len(includes) >= 25
    stems = {p.stem for p in EXAMPLES}
    for page, path, section in includes:
        target = ROOT / path
        assert target.is_file(), f"{page.name} includes {path}, which does not exist"
        assert path.startswith("docs/output/")
        if path.startswith("docs/output/figures/"):
            # benchmark figures: docs/gen_figures.py writes them (tests/unit/test_doc_figures.py)
            assert (ROOT / "docs" / "gen_figures.py").is_file()
        elif target == gen.card_file():
            # the card the GPU outputs ran on, written with them from environment-gpu.json
            recorded = json.loads(gen.environment_file(gpu=True).read_text(encoding="utf-8"))
            assert target.read_text(encoding="utf-8") == gen.card_phrase(recorded)
        else:
            assert target.stem.removesuffix("-gpu") in stems, f"{path}: no docs/examples/ script"
        if section is not None:
            text = target.read_text(encoding="utf-8")
            assert f"--8<-- [start:{section}]" in text, f"{page.name}: {path} has no {section}"
            assert f"--8<-- [end:{section}]" in text


def test_cpu_outputs_are_the_ones_the_pages_use() -> None:
    """Every CPU output a page includes is written by the generator (not by hand)."""
    for _page, path, _section in _includes():
        if path.endswith("-gpu.txt") or path.startswith("docs/output/figures/"):
            continue  # GPU outputs; benchmark figures (docs/gen_figures.py)
        example = gen.EXAMPLES / f"{Path(path).stem}.py"
        assert example.exists()
        assert gen.output_file(example, gpu=False) == ROOT / path


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    part = readme.split("## 30-second example", 1)[1]
    m = re.search(r"```python\n(.*?)```", part, re.S)
    assert m is not None
    return m.group(1)


def test_readme_example_runs_on_the_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-c", _readme_example()],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Torch not compiled with CUDA enabled" not in out.stderr
    assert "__main__.saved[0]" in out.stdout
    assert "256.0 MiB: 1 holder" in out.stdout


def test_readme_example_is_the_quickstart_example() -> None:
    """The README shows GPU output in comments; its code is docs/examples/quickstart.py's."""

    def code(text: str) -> list[str]:
        lines = [re.sub(r"\s+#.*$", "", line).rstrip() for line in text.splitlines()]
        return [line for line in lines if line and not line.startswith("#")]

    source = (gen.EXAMPLES / "quickstart.py").read_text(encoding="utf-8")
    body = source.split('"""', 2)[2]  # after the docstring
    assert code(_readme_example()) == code(body)


def test_the_card_phrase_names_the_gpu_and_torch() -> None:
    phrase = gen.card_phrase({"gpu": "NVIDIA H200", "torch": "2.11", "cuda_devices": 1})
    assert phrase == "an NVIDIA H200 with PyTorch 2.11\n"
    assert gen.card_file().name == "card-gpu.txt"
