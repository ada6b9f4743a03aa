"""Growth detection on a real GPU: seed 000's two leaking loops and a clean one.

Run on an H200 (``pytest -m cuda tests/test_leaks_cuda.py``). Each loop runs inside
``cudamem.track`` with the default settings; the losses/outputs are kept in module globals,
as in the seed's script, so the census names them ``tests.test_leaks_cuda.<name>``.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest
import torch

import cudamem
from cudamem import LeakWarning

pytestmark = pytest.mark.cuda

MiB = 1024**2

loss_history: list[torch.Tensor] = []
outputs: list[torch.Tensor] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    cudamem.configure_leaks()
    loss_history.clear()
    outputs.clear()
    gc.collect()
    torch.cuda.empty_cache()
    yield
    loss_history.clear()
    outputs.clear()
    cudamem.configure_leaks()
    gc.collect()
    torch.cuda.empty_cache()


def _leak_warnings(record: list[warnings.WarningMessage]) -> list[LeakWarning]:
    return [w.message for w in record if isinstance(w.message, LeakWarning)]


def test_loss_history_caught_within_five_calls() -> None:
    """Seed 000: ``loss_history.append(loss)`` keeps sigmoid's 4 MiB output per call."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("train_step"):
                loss = torch.sigmoid(x * 2).mean()
                loss_history.append(loss)
    found = _leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None and growth.calls <= 5
    # 4 MiB saved by SigmoidBackward0 + one 512 B block for the loss scalar.
    assert abs(growth.per_call - 4 * MiB) <= 4096
    top = growth.culprits[0]
    assert top.holder == "tests.test_leaks_cuda.loss_history"
    assert top.tensors == len(loss_history)
    assert top.autograd_bytes >= 4 * MiB * len(loss_history)
    assert "SigmoidBackward0 saved result" in top.example
    assert str(found[0]).startswith("train_step retains +4.0 MiB per call")
    assert "held through autograd graphs" in str(found[0])


def test_detached_outputs_caught_within_five_calls() -> None:
    """Seed 000: ``outputs.append(output.detach())`` keeps the 4 MiB output, no graph."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("val_step"):
                output = torch.sigmoid(x * 2)
                outputs.append(output.detach())
    found = _leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None
    assert abs(growth.per_call - 4 * MiB) <= 4096
    top = growth.culprits[0]
    assert top.holder == "tests.test_leaks_cuda.outputs"
    assert top.nbytes == 4 * MiB * len(outputs)
    assert top.autograd_bytes == 0


def test_clean_loop_with_scalar_logger_never_warns() -> None:
    """A real training step logging through ``ScalarLogger``: 200 steps, no warning."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device="cuda")
    logger = cudamem.ScalarLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(200):
            with cudamem.track("clean_step"):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                logger.append(loss)
    assert _leak_warnings(record) == []
    assert len(logger) == 200


def test_leaks_true_names_what_a_span_left() -> None:
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with cudamem.track("val", leaks=True) as span:
        outputs.append(torch.sigmoid(x * 2).detach())
    report = span.leaks
    assert report.nbytes == 4 * MiB
    assert report.culprits[0].holder == "tests.test_leaks_cuda.outputs"
    outputs.clear()
    assert cudamem.leaks(since=span).count == 0
