"""Tensors without memory of their own (FakeTensors left by torch.compile, meta and
functional tensors) are skipped by every scan without a warning; a compiled module is one
unit of the per-module profile.

In a process of its own (``tests/integration/test_frameworks.py``): torch.compile and
FakeTensorMode import dynamo, inductor and sympy, which would more than double the heap that
every later census and holder search of the other tests walks."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.holders import census
from cudamem.modules.profiler import COMPILED_NOTE

from ...fakes import FakeAllocator
from ...module_globals import Globals, added_globals

M = __name__


@pytest.fixture
def g() -> Iterator[Globals]:
    """Module globals for a test; every name it adds is removed afterwards."""
    yield from added_globals(__name__)


def _fakes() -> tuple[Any, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(13, 17)
    return mode, fake


def test_fake_meta_and_functional_tensors_are_skipped_without_warning(g: Globals) -> None:
    mode, fake = _fakes()
    g["fakes"] = [fake, torch.empty(19, 23, device="meta")]
    g["functional"] = torch._to_functional_tensor(torch.ones(29, 31))
    g["real"] = torch.ones(37, 41)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = cudamem.live_tensors(holders=True)
        shapes = {s.shape for s in c}
        assert (37, 41) in shapes
        assert not shapes & {(13, 17), (19, 23)}
        # the functional wrapper has no memory of its own; the tensor it wraps has
        assert [s.tensors for s in c if s.shape == (29, 31)] == [1]
        assert cudamem.who_holds(g["functional"]).nbytes is None
        keys = census.live_storage_keys()
        assert all(ptr != 0 for _dev, ptr in keys)
        assert f"{M}.real" in cudamem.who_holds(g["real"]).paths
        by_identity = cudamem.who_holds(fake)
        assert by_identity.nbytes is None and f"{M}.fakes[0]" in by_identity.paths
        cudamem.who_holds(g["fakes"][1])
        cudamem.find_graph_holders()
    del mode


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_after_torch_compile_no_scan_touches_fake_tensors(g: Globals, backend: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    g["model"] = model
    x = torch.randn(4, 8, requires_grad=True)
    try:
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()
    except Exception as exc:  # no compiler on this machine, or an unsupported setup
        torch._dynamo.reset()
        pytest.skip(f"torch.compile({backend!r}) does not run here: {exc!r}")
    try:
        g["out"] = compiled(x)
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = cudamem.live_tensors(holders=True)
            census.live_storage_keys()
            assert f"{M}.model[0].weight" in cudamem.who_holds(model[0].weight).paths
            cudamem.find_graph_holders()
            with cudamem.track("compiled-step", leaks=True):
                compiled(x).sum()
        assert any(s.shape == (8, 8) for s in c)
    finally:
        torch._dynamo.reset()


@pytest.fixture
def fake() -> Iterator[FakeAllocator]:
    alloc = FakeAllocator(devices=1, contexts=(0,))
    with _backend.use(alloc):
        yield alloc


def test_a_compiled_module_is_one_unit(fake: FakeAllocator) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model = nn.Sequential(torch.compile(inner, backend="eager"), nn.Linear(4, 2))
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    names = [r.name for r in prof.profile.modules]
    assert names == ["Sequential", "Sequential.0", "Sequential.1"]
    unit = prof.profile.module("Sequential.0")
    assert unit.type_name == "OptimizedModule"
    assert unit.notes == (COMPILED_NOTE,)
    assert unit.calls.max == 2
    assert "compiled (torch.compile)" in str(prof.profile)
