"""``benchmarks/fit.py``'s zoo on the CPU: every model builds at tiny sizes and one training
step at n=2 runs (a finite loss, every parameter updated), and the true-largest search finds
the exact limit in few steps."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

NAMES = ("decoder", "encoder", "resnet50", "convnext", "vit", "lstm", "unet", "mlp", "checkpointed")


@pytest.fixture(scope="module")
def fit() -> Iterator[Any]:
    """``benchmarks/fit.py``, imported by path (the benchmarks are no package); the import
    path and the modules it loaded are put back after the tests."""
    path = os.path.abspath(
        os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "fit.py")
    )
    saved_path, saved_names = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("_bench_fit", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved_path
        bench_dir = os.path.dirname(path)
        for name in set(sys.modules) - saved_names:  # the benchmarks' own modules only
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if name == spec.name or os.path.dirname(os.path.abspath(origin)) == bench_dir:
                del sys.modules[name]


def test_the_zoo_is_the_nine_models(fit: Any) -> None:
    assert tuple(fit.MODELS) == NAMES
    assert set(fit.QUICK) <= set(NAMES) and set(fit.PEERS) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_one_tiny_step_of_each_model_runs_on_the_cpu(fit: Any, name: str) -> None:
    for package in fit.MODELS[name].needs:
        pytest.importorskip(package)
    result = fit.smoke(name)
    assert result["finite"], result
    assert result["params"] > 0 and result["changed"] == result["params"], result


@pytest.mark.parametrize(("limit", "start"), [(1000, 1000), (1000, 970), (1000, 1200), (17, 3)])
def test_the_true_largest_is_exact_and_takes_few_steps(fit: Any, limit: int, start: int) -> None:
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= limit

    assert fit.true_largest(fits, start) == limit
    assert len(tried) == len(set(tried))
    if abs(start - limit) <= 0.03 * limit:
        assert len(tried) <= 8, tried


def test_nothing_fits(fit: Any) -> None:
    assert fit.true_largest(lambda n: False, 40) == 0
