"""Shared fixtures. Tests marked ``cuda`` skip cleanly on machines without a GPU."""

from __future__ import annotations

import contextlib
import importlib
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _pytest.pytester import SysModulesSnapshot

import cudamem
from cudamem.base import warn as _warn
from cudamem.native import cext as _cext
from cudamem.native import spancore as _spancore
from cudamem.spans import history as _history
from cudamem.spans import span as _span
from cudamem.spans import state as _spans_state

from . import own_process

#: The module (``cudamem.leaks`` is also the package's function of that name).
_leaks = importlib.import_module("cudamem.growth.detector")


def _has_cuda() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


HAS_CUDA = _has_cuda()
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0


def _keep_imported(name: str) -> bool:
    """Modules an in-process ``pytester`` run imports that stay imported after it.

    Pytester restores ``sys.modules`` after each inner run, so a module first imported
    there is imported a second time by a later test. For torch's that is wrong twice over:
    ``torch._inductor.test_operators`` then registers its ``TORCH_LIBRARY`` again (an error
    in whichever later test imports it), and a second copy of ``torch._dynamo`` and its
    kin added ~117 k objects to the heap every later census and holder search walks. A
    second copy of a cudamem module would be a second class of its results. (``zope`` and
    ``readline``: what pytester itself keeps.)"""
    return name.startswith(("torch", "cudamem", "zope", "readline"))


def _take_sys_modules_snapshot(self: pytest.Pytester) -> SysModulesSnapshot:
    return SysModulesSnapshot(preserve=_keep_imported)


# Pytester's own hook for this (private, name-mangled): patched before any pytester exists.
pytest.Pytester._Pytester__take_sys_modules_snapshot = _take_sys_modules_snapshot  # type: ignore[attr-defined]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run the tests in a random order drawn from SEED (no test may depend on order)",
    )


def _named(config: pytest.Config, path: Path) -> bool:
    """Whether ``path`` (or a test in it) is named on the command line."""
    here = config.invocation_params.dir
    return any((here / arg.split("::")[0]).resolve() == path for arg in config.args)


def _own_process(config: pytest.Config) -> bool:
    """Whether ``tests/own_process.py``'s files run in processes of their own in this run:
    not inside one of those processes, and no ``-m`` or ``-k`` that may pick their tests."""
    return (
        os.environ.get(own_process.ENV) != "1"
        and not config.option.markexpr
        and not config.option.keyword
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (
        collection_path in own_process.PATHS
        and _own_process(config)
        and not _named(config, collection_path)
    ):
        return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle")
    return None if seed is None else f"cudamem: tests shuffled with seed {seed}"


#: Seconds (roughly, on two CPU cores) of the suite's longest tests: each a subprocess or a
#: module fixture's subprocess (``tests/integration/test_distributed.py``'s torchrun).
_OWN = "tests/integration/test_own_process.py::test_file_in_its_own_process"
_FRAMEWORK = "tests/integration/test_frameworks.py::test_framework_file"
_DOCS = "tests/integration/test_cli_docs.py"
SLOW = {
    f"{_OWN}[test_deep_paths.py]": 40,
    f"{_FRAMEWORK}[test_transformers.py]": 30,
    f"{_OWN}[test_leaks.py]": 30,
    f"{_OWN}[test_leaks_order.py]": 28,
    f"{_FRAMEWORK}[test_compile.py]": 25,
    f"{_FRAMEWORK}[test_lightning.py]": 22,
    f"{_OWN}[test_integration_pytest.py]": 20,
    f"{_DOCS}::modules": 20,
    f"{_DOCS}::distributed_report": 15,
    "tests/integration/test_distributed.py::test_rank0_gets_every_rank_and_the_others_none": 15,
    f"{_FRAMEWORK}[test_modules_gpt2.py]": 13,
    f"{_OWN}[test_oom.py]": 10,
    f"{_OWN}[test_culprits.py]": 10,
    f"{_OWN}[test_integration_memviz.py]": 10,
    f"{_FRAMEWORK}[test_notebook.py]": 10,
    f"{_DOCS}::scalars": 9,
    f"{_FRAMEWORK}[test_plot.py]": 8,
}
_DOCS_EXAMPLES = ("test_example_runs_on_the_cpu", "test_committed_cpu_output_matches_a_fresh_run")


def _group(item: pytest.Item) -> str:
    """The test's own id, or one per docs example: its two tests share one run of the example
    in a process (``tests/integration/test_cli_docs.py``'s ``cpu_run``)."""
    if item.path.name == "test_cli_docs.py" and item.originalname in _DOCS_EXAMPLES:
        return f"{_DOCS}::{item.callspec.params['name']}"
    return item.nodeid


def _weight(group: str) -> int:
    """``SLOW``'s seconds; 5 for any other docs example (a subprocess), else 0."""
    if group in SLOW:
        return SLOW[group]
    return 5 if group.startswith(f"{_DOCS}::") and "::test_" not in group else 0


def _slow_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` reordered so that xdist's first split (``--dist worksteal`` sends each of
    ``workers`` workers one contiguous share, then moves tests from the end of a share to a
    worker that ran out) starts every share with its part of the longest tests, balanced
    longest first. Only the order changes, never which tests run; no test depends on it."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_group(item), []).append(item)
    slow = sorted((g for g in groups if _weight(g)), key=lambda g: -_weight(g))
    if workers < 2 or not slow:
        return items
    taken = {id(item) for g in slow for item in groups[g]}
    rest = [item for item in items if id(item) not in taken]
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for g in slow:
        k = loads.index(min(loads))
        heads[k] += groups[g]
        loads[k] += _weight(g)
    # The sizes xdist gives: each worker len(pending) // workers left, in turn.
    out: list[pytest.Item] = []
    left = len(items)
    for k, head in enumerate(heads):
        size = left // (workers - k)
        fill = max(0, size - len(head))
        out += head + rest[:fill]
        rest = rest[fill:]
        left -= len(head) + fill
    return out + rest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A file of tests/own_process.py collected here (named on the command line) runs here,
    # not a second time in a process of its own.
    here = {item.path for item in items}
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        again = (
            item.path.name == "test_own_process.py"
            and own_process.ROOT / item.callspec.params["name"] in here
        )
        (dropped if again else kept).append(item)
    if dropped:
        items[:] = kept
        config.hook.pytest_deselected(items=dropped)
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)
    elif hasattr(config, "workerinput"):  # an xdist worker: the controller keeps its order
        items[:] = _slow_first(items, int(config.workerinput["workercount"]))
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _clean_cudamem_state() -> Iterator[None]:
    """Every test starts with an empty history of the default size, no folded peaks and a
    growth detector that has seen no span (a test's rising spans arm it for their names;
    left armed, every later span of that name would be captured and judged)."""
    cudamem.clear_history()
    _spans_state._reset_state()
    _leaks._detector.reset()
    yield
    _leaks._detector.reset()
    cudamem.set_history_size(_history.DEFAULT_SIZE)
    cudamem.clear_history()


def compiled_span_core() -> Any:
    """The compiled span core, built and active; where a C compiler exists and it is not,
    the test fails (it does not skip); where none exists, it skips."""
    status = _spancore.EXTENSION.wait()
    module = _spancore.EXTENSION.native()
    if module is None:
        if _cext.compiler() is not None:
            pytest.fail(f"the compiled span core is not active: {status.reason}")
        pytest.skip(f"no compiled span core here: {status.reason}")
    return module


@pytest.fixture(params=["python", "compiled"])
def span_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test once with spans opened and closed by the Python functions and once by
    the compiled span core (``native/src/spancore/``), which must agree on everything.

    Where a C compiler exists the compiled run must really use the core: a core that does
    not build or fails its check fails the test instead of skipping it. Each run warns
    afresh (a once-only warning of the other run does not hide this run's)."""
    monkeypatch.setattr(_warn, "_warned", set())
    module = compiled_span_core() if request.param == "compiled" else None
    with _span._serving(module):
        yield request.param


@contextlib.contextmanager
def python_edges() -> Iterator[list[str]]:
    """The calls of the Python open and close within the block, in order (``"open"``,
    ``"close"``): none for a span the compiled span core serves itself."""
    calls: list[str] = []
    state = _spans_state.STATE
    saved = state.py_open, state.py_close

    def spy(edge: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(edge)
            return real(*args, **kwargs)

        return call

    state.py_open, state.py_close = spy("open", saved[0]), spy("close", saved[1])
    try:
        yield calls
    finally:
        state.py_open, state.py_close = saved
