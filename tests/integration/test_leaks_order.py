"""The GPU suite's two "caught within five calls" loops on the CPU, written as
``tests/gpu/test_leaks_cuda.py`` writes them, alone and after what earlier tests leave behind.

``x`` is a local of the test (as on the GPU; ``tests/integration/test_leaks.py`` keeps its
input in a
module global, which hid a culprit-rule slip that only the GPU run showed: the loss
history's example path went through ``x``'s ``AccumulateGrad``). The fake allocator plays
the GPU's level; the survivors and their holders are real CPU tensors.

State an earlier test can leave in a long process, and that must not change the answer:
the other loop's series and warnings; other storages alive on the device, held through
structures large enough that a holder search over every storage of the device stops at its
node limit before it has named the leak (a test module's list of 250,000 rows, a failed
test's traceback kept in ``sys.last_traceback``).
"""

from __future__ import annotations

import gc
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import cudamem
from cudamem.growth.report import Growth
from cudamem.growth.settings import LeakWarning

from ..fakes import FakeAllocator, leak_detection, leak_warnings

MiB = 1024**2
M = __name__

loss_history: list[torch.Tensor] = []
outputs: list[torch.Tensor] = []
#: What another test module left behind (see ``_leftovers``).
left: list[Any] = []


class CpuFake(FakeAllocator):
    """The fake GPU, whose storages the census looks for on the CPU."""

    storages = "cpu"


@pytest.fixture
def fake() -> Iterator[CpuFake]:
    with leak_detection(CpuFake(devices=1, contexts=(0,)), loss_history, outputs, left) as alloc:
        yield alloc


def _loss_history_loop(fake: CpuFake) -> tuple[list[LeakWarning], torch.Tensor]:
    """``test_loss_history_caught_within_five_calls``: sigmoid's 1 MiB output is kept by each
    loss's graph, the losses by a module global."""
    x = torch.randn(256, 1024, requires_grad=True)  # a local, as on the GPU
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("train_step", sync=False):
                loss = torch.sigmoid(x * 2).mean()
                loss_history.append(loss)
                fake.alloc(MiB + 512)  # what the GPU shows: the output and the loss's block
    return leak_warnings(record), x


def _detached_outputs_loop(fake: CpuFake) -> tuple[list[LeakWarning], torch.Tensor]:
    """``test_detached_outputs_caught_within_five_calls``: each output kept detached."""
    x = torch.randn(256, 1024, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("val_step", sync=False):
                output = torch.sigmoid(x * 2)
                outputs.append(output.detach())
                fake.alloc(MiB)
    assert output.grad_fn is not None  # the last output's graph is alive, as on the GPU
    return leak_warnings(record), x


def _check_loss_history(found: list[LeakWarning]) -> None:
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert isinstance(growth, Growth)
    assert growth.calls <= 5
    assert abs(growth.per_call - MiB) <= 4096
    top = growth.culprits[0]
    assert top.holder == f"{M}.loss_history"
    assert top.tensors == len(loss_history) == 5
    # the five saved outputs and a few bytes per call (the losses, the saved scalar 2); not
    # x's 1 MiB: the test's own leaf, which every graph reaches, is the frame's
    assert 5 * MiB <= top.autograd_bytes <= top.nbytes < 5 * MiB + 1024
    assert top.example.endswith("→ grad_fn MeanBackward0 → SigmoidBackward0 saved result")
    assert "AccumulateGrad" not in top.example
    assert str(found[0]).startswith("train_step retains +1.0 MiB per call")
    assert "held through autograd graphs" in str(found[0])


def _check_detached_outputs(found: list[LeakWarning]) -> None:
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert isinstance(growth, Growth)
    assert growth.calls <= 5
    assert growth.per_call == MiB
    top = growth.culprits[0]
    assert top.holder == f"{M}.outputs"
    assert (top.tensors, top.nbytes, top.autograd_bytes) == (5, 5 * MiB, 0)
    assert re.fullmatch(rf"{M}\.outputs\[[0-4]\]", top.example), top.example


Loop = Callable[[CpuFake], tuple[list[LeakWarning], torch.Tensor]]
Check = Callable[[list[LeakWarning]], None]
LOOPS: dict[str, tuple[Loop, Check]] = {
    "loss_history": (_loss_history_loop, _check_loss_history),
    "detached_outputs": (_detached_outputs_loop, _check_detached_outputs),
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_caught_within_five_calls_alone(fake: CpuFake, loop: str) -> None:
    run, check = LOOPS[loop]
    found, _x = run(fake)
    check(found)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_caught_within_five_calls_after_the_other_loop(fake: CpuFake, loop: str) -> None:
    """As in the GPU file: the other loop ran first in the same process (its series, its
    warning, its freed storages), then the fixture's clean-up."""
    (other,) = [name for name in LOOPS if name != loop]
    LOOPS[other][0](fake)
    loss_history.clear()
    outputs.clear()
    cudamem.configure_leaks()
    gc.collect()
    run, check = LOOPS[loop]
    found, _x = run(fake)
    check(found)


def _rows(t: torch.Tensor, n: int) -> list[dict[str, torch.Tensor]]:
    return [{"t": t} for _ in range(n)]


class _Failed(Exception):
    pass


def _failed_test_traceback(t: torch.Tensor) -> None:
    """What pytest keeps of a failed test: ``sys.last_traceback``, whose frame holds ``t``
    through 250,000 rows."""
    rows = _rows(t, 250_000)
    try:
        raise _Failed(len(rows))
    except _Failed as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        del exc


def _leftovers(kind: str) -> None:
    t = torch.ones(3, 5)  # a storage alive on the device the detector watches
    if kind == "module_rows":
        left.append(_rows(t, 250_000))
    else:
        _failed_test_traceback(t)


@pytest.mark.parametrize("kind", ["module_rows", "failed_test_traceback"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_caught_within_five_calls_beside_storages_other_tests_left(
    fake: CpuFake, loop: str, kind: str
) -> None:
    """Another storage held through more objects than a holder search explores
    (``max_nodes``): naming the leak's culprit must not depend on searching it (it did: the
    one search over every storage stopped before it reached the leak, whose culprit came
    out as "(no holder reachable from Python)")."""
    _leftovers(kind)
    try:
        run, _check = LOOPS[loop]
        found, _x = run(fake)
        assert len(found) == 1, [str(w) for w in found]
        growth = found[0].growth
        assert isinstance(growth, Growth)
        assert growth.calls <= 5
        top = growth.culprits[0]
        holder = f"{M}.{loop if loop == 'loss_history' else 'outputs'}"
        assert top.holder == holder
        assert [c.holder for c in growth.culprits] == [holder]
        assert top.nbytes >= MiB  # at least what the captured call left
        assert "AccumulateGrad" not in top.example
        # The totals' search over every storage stopped at its node limit (the leftover's
        # 250,000 rows): the culprit says it counts the captured call's storages only.
        assert any(
            n.startswith(f"{holder}: the storages this call left only") for n in growth.notes
        )
        assert "max_nodes" in " ".join(growth.notes)
    finally:
        for name in ("last_type", "last_value", "last_traceback"):
            if hasattr(sys, name):
                delattr(sys, name)
