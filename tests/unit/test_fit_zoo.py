"""``benchmarks/fit.py``'s zoo on the CPU: every model builds at tiny sizes and one training
step at n=2 runs (a finite loss, every parameter updated), and the true-largest search finds
the exact limit in few steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ..benchmark_import import benchmark

NAMES = ("decoder", "encoder", "resnet50", "convnext", "vit", "lstm", "unet", "mlp", "checkpointed")


@pytest.fixture(scope="module")
def fit() -> Iterator[Any]:
    """``benchmarks/fit.py``, imported by path (``tests/benchmark_import.py``)."""
    with benchmark("fit.py") as module:
        yield module


def test_the_zoo_is_the_nine_models(fit: Any) -> None:
    assert tuple(fit.MODELS) == NAMES
    assert set(fit.QUICK) <= set(NAMES) and set(fit.PEERS) <= set(NAMES)


HELD_OUT = (
    "gpt2",
    "t5",
    "efficientnet",
    "swin",
    "gru",
    "moe",
    "wav2vec2",
    "mobilenetv3",
    "compiled",
)


@pytest.mark.parametrize("name", NAMES + HELD_OUT)
def test_one_tiny_step_of_each_model_runs_on_the_cpu(fit: Any, name: str) -> None:
    for package in fit.spec(name).needs:
        pytest.importorskip(package)
    result = fit.smoke(name)
    assert result["finite"], result
    assert result["params"] > 0 and result["changed"] == result["params"], result


def test_the_held_out_models_are_apart_from_the_zoo(fit: Any) -> None:
    assert tuple(fit.HELD_OUT) == HELD_OUT
    assert not set(HELD_OUT) & set(fit.MODELS)
    assert fit.spec("gpt2") is fit.HELD_OUT["gpt2"] and fit.spec("unet") is fit.MODELS["unet"]


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


def test_lightning_runs_again_where_its_default_max_val_stops_it_short(fit: Any) -> None:
    # the decoder (115) and ResNet-50 (961) lie well inside 8192: the default answers
    assert fit.lightning_max_val(115) is None and fit.lightning_max_val(4096) is None
    assert fit.lightning_max_val(None) is None
    # the MLP (457,472 on an H100): the power of two past twice it
    assert fit.lightning_max_val(457_472) == 1 << 20
    assert fit.lightning_max_val(4097) == 16384
