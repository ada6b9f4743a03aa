"""The figures the docs quote are the benchmark JSON's: ``docs/gen_figures.py`` writes them
into ``docs/output/figures/``, pages include them, and these tests fail when a committed file,
the README's one figure or a page's hand-written copy drifts from what the JSON says."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _gen() -> ModuleType:
    path = ROOT / "docs" / "gen_figures.py"
    spec = importlib.util.spec_from_file_location("cudamem_docs_gen_figures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_committed_figures_are_what_the_json_gives() -> None:
    gen = _gen()
    written = gen.figures()
    assert written, "gen_figures.py writes no figures"
    committed = {p.name for p in gen.FIGURES.glob("*")}
    assert committed == set(written), (
        "docs/output/figures/ holds files gen_figures.py does not write"
    )
    for name, text in written.items():
        on_disk = (gen.FIGURES / name).read_text(encoding="utf-8")
        assert on_disk == text, f"{name} is stale: run python docs/gen_figures.py"


def test_figures_name_the_card_and_torch() -> None:
    gen = _gen()
    for name, text in gen.figures().items():
        assert re.search(r"(NVIDIA [A-Z]\d+|CPU only)", text), name
        assert re.search(r"torch 2\.\d+\.\d+", text), name
        assert "benchmarks/results/" in text, name


def test_spans_figures_are_the_json_medians() -> None:
    gen = _gen()
    data = gen._load(gen.SPANS_JSON)
    allocated = data["readers_us"]["torch.cuda.memory_allocated(0)"]
    assert gen.memory_allocated_us() == f"{sorted(allocated)[len(allocated) // 2]:.2f} µs"
    assert gen.memory_allocated_us() in gen.figures()["spans.txt"]


def test_readme_quotes_one_figure_the_generated_one() -> None:
    gen = _gen()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert gen.readme_figure() in readme
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.S | re.M)  # code blocks show output
    timings = re.findall(r"\d[\d.,]*\s*(?:µs|ms)\b", prose)
    assert timings == [gen.track_us()], timings


def _pages() -> list[Path]:
    docs = ROOT / "docs"
    return [ROOT / "README.md"] + [p for p in docs.rglob("*.md") if "output" not in p.parts]


def test_memory_allocated_cost_has_one_home() -> None:
    """The cost of ``torch.cuda.memory_allocated()`` once had five values on four pages: a
    page quotes it only through the generated snippet."""
    quoted = re.compile(r"memory_allocated\(\d?\)`?[^.|\n]{0,80}?\d[\d.]*\s*µs")
    offenders = [
        f"{page.relative_to(ROOT)}: {m.group(0)}"
        for page in _pages()
        for m in quoted.finditer(page.read_text(encoding="utf-8"))
    ]
    assert not offenders, offenders


def test_pages_include_only_existing_figure_sections() -> None:
    gen = _gen()
    written = gen.figures()
    include = re.compile(r'--8<-- "docs/output/figures/([^":]+):([^"]+)"')
    seen = 0
    for page in _pages():
        for m in include.finditer(page.read_text(encoding="utf-8")):
            seen += 1
            name, section = m.groups()
            assert name in written, f"{page.name} includes {name}, which is not generated"
            assert f"--8<-- [start:{section}]" in written[name], f"{page.name}: {m.group(0)}"
    assert seen, "no page includes a generated figure"
