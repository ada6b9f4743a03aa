"""The per-module profile's C++ gates (``_fastread.cpp``), built here against a stub allocator
(``CUDAMEM_STUB_ALLOCATOR``: counters set by hand, no CUDA headers) and run on CPU tensors.

The same models are profiled twice through one fake device whose counters live in the stub:
once with Python gates (spans opened and closed in the hooks) and once with C++ gates (a log
replayed at the backward's end). Every figure must agree. The H200 runs the real build:
``tests/gpu/test_modules_cuda.py``."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem import _backend
from cudamem import span as _span

from ..fakes import FakeAllocator
from ..unit.test_modules import AllocInBackward, FailInBackward

KiB = 1024

pytestmark = pytest.mark.usefixtures("span_path")


@pytest.fixture(scope="session")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The C++ reader built with the stub allocator (skips without a C++ toolchain)."""
    if shutil.which("ninja") is None and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("needs a C++ compiler and ninja to build the C++ gates")
    import torch.utils.cpp_extension as cpp_extension

    source = os.path.join(os.path.dirname(cudamem.__file__), "_fastread.cpp")
    with open(source, encoding="utf-8") as fh:
        text = fh.read()
    try:
        return cpp_extension.load_inline(  # type: ignore[no-untyped-call]
            name="cudamem_gates_stub",
            cpp_sources=[text],
            extra_cflags=["-O1", "-DCUDAMEM_STUB_ALLOCATOR"],
            build_directory=str(tmp_path_factory.mktemp("gates")),
            no_implicit_headers=True,
            is_python_module=True,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing
        pytest.skip(f"the C++ gates did not build here: {type(exc).__name__}: {exc}"[:300])


class StubDevice(FakeAllocator):
    """A fake device whose counters are the stub's, read through it as the C++ reader."""

    def __init__(self, stub: Any, gates: bool) -> None:
        super().__init__(devices=1, contexts=(0,))
        self.stub = stub
        stub.stub_set(0, 0)
        stub.counters_reset_peak(0)
        self.fast_counters = stub.counters
        self.fast_reset = stub.counters_reset_peak
        self.gates = stub if gates else None

    def alloc(self, nbytes: int, device: int = 0) -> None:
        super().alloc(nbytes, device)
        self.stub.stub_set(self.allocated[0], self.allocated[0])

    def free(self, nbytes: int, device: int = 0) -> None:
        super().free(nbytes, device)
        self.stub.stub_set(self.allocated[0], self.allocated[0])


@contextlib.contextmanager
def device(stub: Any, gates: bool) -> Iterator[StubDevice]:
    dev = StubDevice(stub, gates)
    with _backend.use(dev):
        yield dev


class Grad(nn.Module):
    def __init__(self, keep: int, temp: int, fwd: int = 0, weight: bool = False) -> None:
        super().__init__()
        self.keep, self.temp, self.fwd = keep, temp, fwd
        self.weight = nn.Parameter(torch.ones(4)) if weight else None
        self.dev: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dev.alloc(self.fwd)
        if self.weight is not None:
            x = x * self.weight
        return AllocInBackward.apply(x, self.dev, self.keep, self.temp)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.a = Grad(keep=(i + 1) * KiB, temp=(8 + 3 * i) * KiB, fwd=KiB)
        self.b = Grad(keep=2 * KiB, temp=(40 - 5 * i) * KiB, fwd=2 * KiB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """Nested blocks, a shared layer called twice, a layer whose input needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Grad(keep=KiB, temp=4 * KiB, weight=True)
        self.blocks = nn.Sequential(*(Block(i) for i in range(3)))
        self.shared = Grad(keep=3 * KiB, temp=20 * KiB)
        self.head = Grad(keep=KiB, temp=100 * KiB)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.first(x) * w  # x needs no grad: first's backward ends with the pass
        h = self.shared(self.blocks(h))
        return self.head(self.shared(h))  # type: ignore[no-any-return]


def _bind(model: nn.Module, dev: StubDevice) -> None:
    for m in model.modules():
        if isinstance(m, Grad):
            m.dev = dev


def _figures(prof: cudamem.ModuleProfiler) -> dict[str, tuple[Any, ...]]:
    p = prof.profile
    return {
        r.name: (
            r.calls,
            r.kept,
            r.forward_peak,
            r.backward_calls,
            r.backward_delta,
            r.backward_peak,
        )
        for r in p.modules
    }


def _run(stub: Any, gates: bool, steps: int = 3) -> tuple[dict[str, tuple[Any, ...]], bool]:
    torch.manual_seed(0)
    model = Net()
    w = torch.ones(4, requires_grad=True)
    with device(stub, gates) as dev:
        _bind(model, dev)
        with cudamem.track_modules(model) as prof:
            native = []
            for _ in range(steps):
                out = model(torch.ones(4), w)
                native.append(prof._native is not None)
                out.sum().backward()
                dev.free(dev.allocated[0])  # the step's bytes go, as a real step's do
        return _figures(prof), all(native)


def test_cpp_gates_give_the_figures_python_gates_give(stub: Any) -> None:
    python, used_python = _run(stub, gates=False)
    native, used_native = _run(stub, gates=True)
    assert not used_python and used_native
    assert native == python
    # And the figures are the model's: head's backward keeps 1 KiB, peaks at 101 KiB.
    head = native["Net.head"]
    assert head[3].max == 1 and head[4].max == KiB and head[5].max == 101 * KiB
    # shared runs twice a step, forward and backward; first ends with the pass.
    assert native["Net.shared"][0].max == 2 and native["Net.shared"][3].max == 2
    assert native["Net.first"][3].max == 1
    # The root's backward holds every call's: its peak is the largest temp on top of what
    # the calls before it kept.
    assert native["Net"][5].max >= 101 * KiB


def test_a_span_around_the_backward_keeps_the_peak_the_gates_reset(stub: Any) -> None:
    model = Net()
    w = torch.ones(4, requires_grad=True)
    peaks = []
    for gates in (False, True):
        with device(stub, gates) as dev:
            _bind(model, dev)
            with cudamem.track_modules(model):
                out = model(torch.ones(4), w)
                with cudamem.track("backward") as span:
                    out.sum().backward()
            peaks.append(span.peak_delta)
    assert peaks[0] == peaks[1]
    assert peaks[1] is not None and peaks[1] >= 100 * KiB


def test_the_log_merges_what_gates_reset_into_the_next_read(stub: Any) -> None:
    stub.stub_set(0, 0)
    stub.counters_reset_peak(0)
    owner = stub.log_start()
    try:
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        assert stub.gate(y.grad_fn, 7, owner, 0, 0) == 7
        assert stub.gate(y.grad_fn, 9, owner, 0, 0) == 7  # one gate per node and step
        assert stub.gate(x, 8, owner, 0, 0) == -1  # a tensor is no node
        stub.stub_set(10, 500)  # a peak of 500 before the gate resets it
        y.sum().backward()
        stub.stub_set(20, 20)
        # The read after the gate sees the 500 the gate's reset discarded.
        assert stub.counters_reset_peak(0) == (20, 0, 500)
        flat, dropped = stub.log_drain(owner)
        assert dropped == 0
        tags = flat[0::4]
        assert tags == (7, -1)  # the gate, then the read from Python (logged once armed)
        assert flat[2] == 500 and flat[6] == 20
        assert stub.log_drain(owner) == ((), 0)
        stub.counters_reset_peak(0)  # not armed since the drain: not logged
        assert stub.log_drain(owner) == ((), 0)
    finally:
        stub.log_stop(owner)
    # A gate of a stopped log does nothing, not even a reset.
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    assert stub.gate(y.grad_fn, 1, owner, 0, 0) == 1
    stub.stub_set(5, 900)
    y.sum().backward()
    assert stub.counters(0) == (5, 0, 900)
    with pytest.raises(ValueError, match=r"device must be in 0\.\.127"):
        stub.gate(y.grad_fn, 1, owner, 0, 128)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        stub.gate(y.grad_fn, 1)


def test_a_failed_backward_drops_the_open_calls_and_leaves_no_span_open(stub: Any) -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = Grad(keep=KiB, temp=0)
            self.second = Grad(keep=KiB, temp=0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(FailInBackward.apply(self.first(x)))  # type: ignore[no-any-return]

    model = Failing()
    x = torch.ones(3, requires_grad=True)
    with device(stub, True) as dev:
        _bind(model, dev)
        with cudamem.track_modules(model) as prof:
            with pytest.raises(RuntimeError, match="backward failed"):
                model(x).sum().backward()
            model(x)  # the next forward replays what the failed pass logged
            assert prof._native is not None and prof._native.open == []
        assert _span._open_peak == {}
    p = prof.profile
    assert p.module("Failing.second").backward_calls.max == 1  # finished before the failure
    assert p.module("Failing").backward_calls.max == 0  # never finished: not recorded


def test_one_cpp_gate_per_node_and_nothing_python_on_the_nodes(stub: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    x = torch.ones(2, 4, requires_grad=True)
    with device(stub, True), cudamem.track_modules(model) as prof:
        assert prof._native is not None
        out = model(x)
        # As with Python gates: 4 nodes bound the 9 call edges, one gate each.
        assert len(prof._pending) == 4
        node = out.grad_fn
        while node is not None:  # no metadata dict was made on any node
            assert node.metadata == {}
            node = node.next_functions[0][0] if node.next_functions else None
        out.sum().backward()
        model(x).sum().backward()
    p = prof.profile
    assert p.steps == 2
    assert [p.module(f"Sequential.{i}").backward_calls.max for i in range(4)] == [1] * 4
    assert p.module("Sequential").backward_calls == cudamem.module_profile.Spread(1.0, 1.0)
