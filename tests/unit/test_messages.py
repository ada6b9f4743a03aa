"""Messages name only what exists, and say counts as a reader would.

Every call a message suggests (``cudamem.host.workers.watch_workers()``), every command line
(``python -m cudamem status``) and every extra (``pip install 'cudamem[lightning]'``) must
resolve: the call's target by ``getattr`` from ``import cudamem`` as a user's code would
reach it (after importing the submodules the name passes through), the subcommand among the
CLI's, the extra in ``pyproject.toml``. Two sources are checked: every string literal of
cudamem's code (a new wrong suggestion fails here wherever it is written), and each message
kind rendered (the texts users see, ``docs/output`` included).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.demo.registry import Experiment
from cudamem.demo.render import render_summary
from cudamem.host.procfs import ProcessMemory
from cudamem.host.workers import LoaderReport, WorkerMemory
from cudamem.ledger import nvml as _nvml
from cudamem.ledger.reading import explain

from ..built import census, culprit, growth, live_storage
from ..fakes import FakeAllocator

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "cudamem").rglob("*.py")), ROOT / "pytest_cudamem.py"]

CALL = re.compile(r"\bcudamem(?:\.[A-Za-z_]\w*)+(?=\()")
CLI = re.compile(r"python -m cudamem ([a-z][\w-]*)")
PIP = re.compile(r"pip install '?cudamem\[([\w-]+)\]")
SUBCOMMANDS = {"demo", "run", "status", "build-reader"}


def extras() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data["project"]["optional-dependencies"])


def resolve(dotted: str) -> Any:
    """``cudamem.a.b.c`` as ``import cudamem.a.b`` then ``cudamem.a.b.c`` reaches it: a
    function that hides its module (``cudamem.fragmentation``) does not resolve through."""
    parts = dotted.split(".")
    for i in range(2, len(parts) + 1):
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            break
    obj: Any = cudamem
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def wrong_names(text: str) -> list[str]:
    """What ``text`` suggests that does not exist."""
    wrong = []
    for m in CALL.finditer(text):
        try:
            resolve(m[0])
        except (AttributeError, ImportError):
            wrong.append(f"{m[0]}()")
    wrong += [f"python -m cudamem {m[1]}" for m in CLI.finditer(text) if m[1] not in SUBCOMMANDS]
    known = extras()
    wrong += [f"cudamem[{m[1]}]" for m in PIP.finditer(text) if m[1] not in known]
    return wrong


def literals(path: Path) -> Iterator[tuple[int, str]]:
    """Each string literal of ``path`` (an f-string with ``{}`` where it formats a value)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            yield node.lineno, "".join(str(p) for p in parts)


def test_the_checker_catches_a_wrong_suggestion() -> None:
    """What the issue found: names that do not exist fail, their right forms pass."""
    assert wrong_names("(cudamem.watch_workers() follows their growth)") == [
        "cudamem.watch_workers()"
    ]
    assert wrong_names("cudamem.fragmentation.judge_oom(exc)") == [
        "cudamem.fragmentation.judge_oom()"  # the function cudamem.fragmentation hides it
    ]
    assert wrong_names("python -m cudamem stats; pip install 'cudamem[lighting]'") == [
        "python -m cudamem stats",
        "cudamem[lighting]",
    ]
    assert (
        wrong_names(
            "cudamem.host.workers.watch_workers(), cudamem.render.json.to_json(x), "
            "python -m cudamem status, pip install 'cudamem[lightning]'"
        )
        == []
    )


def test_every_suggestion_in_cudamems_code_resolves() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in SOURCES
        for line, text in literals(path)
        for name in wrong_names(text)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_suggestion_in_the_docs_outputs_resolves() -> None:
    """The examples' real outputs: every message kind they print."""
    files = sorted((ROOT / "docs" / "output").glob("*.txt"))
    assert files
    wrong = [f"{p.name}: {n}" for p in files for n in wrong_names(p.read_text("utf-8"))]
    assert not wrong, "\n".join(wrong)


# -- each message kind, rendered ------------------------------------------------------------


def _memory(pid: int) -> ProcessMemory:
    return ProcessMemory(pid, 300 << 20, 200 << 20, 100 << 20)


def test_the_host_report_of_an_unwatched_loader_names_the_watcher_that_exists() -> None:
    report = LoaderReport(
        1,
        "Records",
        "fork",
        False,
        (WorkerMemory(0, 11, _memory(11), _memory(11)),),
        watched=False,  # read once by explain(): its text says what follows the growth
    )
    text = str(report)
    assert "cudamem.host.workers.watch_workers()" in text
    assert wrong_names(text) == []


@pytest.mark.parametrize("device_type", ["cuda", "cpu", None], ids=["gpu", "cpu", "unknown"])
def test_leak_fixes_name_what_exists(device_type: str | None) -> None:
    text = str(growth(culprit("__main__.outputs", autograd_bytes=0, device_type=device_type)))
    assert "fix: " in text and wrong_names(text) == []
    graphs = str(growth(culprit()))
    assert "cudamem.ScalarLogger" in graphs and wrong_names(graphs) == []


@pytest.mark.parametrize("nvml", [True, False])
def test_explain_without_a_context_suggests_only_what_works(
    nvml: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU but no context: explain(device=0) is the way to see it; with NVML it shows
    NVML's figures, without it torch's view (never "NVML figures" that cannot come)."""
    status = _nvml.NvmlStatus(nvml, None if nvml else "no driver here")
    monkeypatch.setattr(_nvml, "status", lambda: status)
    with _backend.use(FakeAllocator(devices=1, contexts=())):
        note = next(n for n in explain(host=False).notes if "no CUDA context" in n)
    assert note.endswith(
        "(explain(device=0) shows what NVML sees on cuda:0)"
        if nvml
        else "(explain(device=0) shows cuda:0 as torch sees it; NVML is unavailable)"
    )
    assert wrong_names(note) == []


def test_explain_without_a_gpu_says_so() -> None:
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        notes = explain(host=False).notes
    assert any(n.startswith("torch sees no CUDA device (") for n in notes), notes
    assert not any("pass device=" in n for n in notes)


def test_the_demo_summary_gives_each_skip_reason_with_its_count() -> None:
    one = "needs a CUDA GPU"
    two = "needs two CUDA GPUs (this machine has 0); the single-GPU variants run on cuda:0"
    results = [
        Experiment(f"k{i}", "t", "e", skipped=reason)
        for i, reason in enumerate([one, two, two, one, two])
    ]
    assert render_summary(results) == (
        "0/0 checks passed; 5 experiments skipped: 2 need a CUDA GPU, "
        "3 need two CUDA GPUs (this machine has 0)"
    )
    assert render_summary(results[:2]).endswith(
        "2 experiments skipped: 1 needs a CUDA GPU, 1 needs two CUDA GPUs (this machine has 0)"
    )


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("cudamem.integrations.lightning", ("lightning", "pytorch_lightning"), "lightning"),
        ("cudamem.integrations.transformers", ("transformers",), "transformers"),
    ],
)
def test_an_integration_without_its_framework_names_the_extra(
    module: str, blocked: tuple[str, ...], extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (module, *blocked):
        monkeypatch.delitem(sys.modules, name, raising=False)
    # a framework imported by an earlier test leaves its submodules (``lightning.pytorch``),
    # which an import finds without asking for the blocked parent
    for name in [m for m in sys.modules if m.startswith(tuple(f"{b}." for b in blocked))]:
        monkeypatch.delitem(sys.modules, name)
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` fails as if missing
    with pytest.raises(ModuleNotFoundError) as caught:
        importlib.import_module(module)
    assert str(caught.value) == f"{module} needs {blocked[0]}: pip install 'cudamem[{extra}]'"
    assert caught.value.name == blocked[0]
    assert wrong_names(str(caught.value)) == []


# -- counts agree with their nouns ---------------------------------------------------------

#: A count directly followed by a plural noun in an f-string: ``f"{n} storages"`` says
#: "1 storages". Counts go through ``cudamem.base.format.plural``.
_NOUN = re.compile(
    r"^ (?:[a-z]+ )?(storages|tensors|calls|values|objects|holders|items|events|rows|spans|"
    r"processes|bytes|steps|workers|modules|graphs|pools|references|ranks|devices|segments|"
    r"blocks|checks|entries|experiments|loaders|children|frames|threads|warnings|culprits|"
    r"allocations|records|nodes|probes|terms|cells|columns|snapshots|files|lines|groups|"
    r"keys|tests)\b"
)

#: (file, expression) pairs that are not a bare count before a plural noun.
_NOT_A_COUNT = {
    ("cudamem/demo/render.py", "len(checks)"),  # "3/4 checks passed": a ratio
    ("cudamem/render/holders.py", "holder.count"),  # written only when more than 1
    ("cudamem/render/holders.py", "tensors"),  # plural()'s text already
    ("pytest_cudamem.py", "device"),  # "cuda storages": a device, not a count
}


def test_counts_agree_with_their_nouns() -> None:
    found = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.JoinedStr):
                continue
            for a, b in zip(node.values, node.values[1:], strict=False):
                if not (isinstance(a, ast.FormattedValue) and isinstance(b, ast.Constant)):
                    continue
                expr = ast.unparse(a.value)
                if expr.startswith(("plural(", "format_bytes(")):
                    continue
                if _NOUN.match(str(b.value)) and (rel, expr) not in _NOT_A_COUNT:
                    found.append(f"{rel}:{node.lineno}: {{{expr}}}{b.value[:30]}")
    assert not found, "use cudamem.base.format.plural:\n" + "\n".join(found)


def test_a_census_of_one_storage_says_storage() -> None:
    assert str(census(live_storage())).splitlines()[-1] == "1 storage: cuda:0 4.0 MiB"
    two = str(census(live_storage(), live_storage()))
    assert two.splitlines()[-1] == "2 storages: cuda:0 8.0 MiB"
