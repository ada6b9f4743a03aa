"""Shared fixtures. Tests marked ``cuda`` skip cleanly on machines without a GPU."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _pytest.pytester import SysModulesSnapshot

import cudamem
from cudamem import _cext, _history, _spancore, _warn
from cudamem import span as _span


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


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle")
    return None if seed is None else f"cudamem: tests shuffled with seed {seed}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _clean_cudamem_state() -> Iterator[None]:
    """Every test starts with an empty history of the default size and no folded peaks."""
    cudamem.clear_history()
    _span._reset_state()
    yield
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
    the compiled span core (``_spancore.c``), which must agree on everything.

    Where a C compiler exists the compiled run must really use the core: a core that does
    not build or fails its check fails the test instead of skipping it. Each run warns
    afresh (a once-only warning of the other run does not hide this run's)."""
    monkeypatch.setattr(_warn, "_warned", set())
    module = compiled_span_core() if request.param == "compiled" else None
    with _span._serving(module):
        yield request.param
