"""The imports of code that runs only on a GPU, checked on the CPU: the GPU tests, the docs'
examples, the benchmarks and cudamem's own scripts for child processes (strings, which no
linter reads) name ``cudamem`` modules and names that exist. After the package restructure a
GPU test imported ``graph_pool_blocks`` from the module it had left, and the demo's seed 001
script ``machine_status`` from ``cudamem.ledger.device``: only ``.ci/gpu`` saw either."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [
        *ROOT.glob("tests/gpu/**/*.py"),
        *ROOT.glob("docs/examples/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("cudamem/**/*.py"),  # scripts run in child processes are strings there
    ]
)
#: ``from cudamem[.x] import a, b as c`` (one line or parenthesised) and ``import cudamem.x``,
#: in code or inside the strings of scripts run in a child process.
FROM = re.compile(r"^\s*from\s+(cudamem(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
IMPORT = re.compile(r"^\s*import\s+(cudamem(?:\.\w+)+)", re.M)


def imports(text: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every name imported from a cudamem module (``name`` None for
    a plain ``import cudamem.x``)."""
    found: list[tuple[str, str | None]] = []
    for module, names in FROM.findall(text):
        for part in names.strip("()").replace("\\", " ").split(","):
            name = part.split(" as ")[0].strip()
            if name and name != "*":
                found.append((module, name))
    found += [(module, None) for module in IMPORT.findall(text)]
    return found


def _needs_an_extra(exc: ImportError) -> bool:
    """A cudamem module that exists but needs a package this machine lacks (an extra:
    ``cudamem.integrations.lightning`` without lightning): not a wrong name."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] != "cudamem":
        return True
    return "pip install 'cudamem[" in str(exc)


def test_a_missing_extra_is_not_a_wrong_name() -> None:
    assert _needs_an_extra(ModuleNotFoundError("No module named 'lightning'", name="lightning"))
    assert _needs_an_extra(ImportError("x needs lightning: pip install 'cudamem[lightning]'"))
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("cudamem.ledger.device.machine_status")
    assert not _needs_an_extra(info.value)


def test_the_pattern_reads_every_form() -> None:
    text = (
        "from cudamem.a import b, c as d\n"
        "    from cudamem.e import (\n        f,\n        g as h,\n    )\n"
        "import cudamem.i\n"
        "x = 'from cudamem.j import k'\n"
    )
    assert imports(text) == [
        ("cudamem.a", "b"),
        ("cudamem.a", "c"),
        ("cudamem.e", "f"),
        ("cudamem.e", "g"),
        ("cudamem.i", None),
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_what_gpu_only_code_imports_from_cudamem_exists(path: Path) -> None:
    missing = []
    for module, name in imports(path.read_text(encoding="utf-8")):
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            if not _needs_an_extra(exc):
                missing.append(f"{module}: {exc}")
            continue
        if name is not None and not hasattr(loaded, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{name} from {module}")
    assert not missing, missing
