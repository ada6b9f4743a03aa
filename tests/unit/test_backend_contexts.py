"""``TorchBackend.initialized_devices``: cached, never creating a context (a stand-in for
``torch._C``'s context probe counts what is asked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cudamem.allocator import torch_backend as _torch_backend


class Probe:
    def __init__(self, contexts: set[int]) -> None:
        self.contexts = contexts
        self.asked: list[int] = []

    def __call__(self, device: int) -> bool:
        self.asked.append(device)
        return device in self.contexts


def backend_with(probe: Probe, count: int) -> _torch_backend.TorchBackend:
    backend = _torch_backend.TorchBackend()
    backend._c = SimpleNamespace(_cuda_hasPrimaryContext=probe)  # type: ignore[assignment]
    backend._compiled = True
    backend._count = count
    backend._initialized = lambda: True  # type: ignore[method-assign]
    return backend


def test_devices_with_a_context_are_not_probed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_backend, "REPROBE_NS", 10**15)  # no time-based probe in this test
    probe = Probe({0})
    backend = backend_with(probe, 4)
    assert backend.initialized_devices() == (0,)
    assert probe.asked == [0, 1, 2, 3]
    for _ in range(100):  # the span edges that follow: no probe at all
        assert backend.initialized_devices() == (0,)
    assert probe.asked == [0, 1, 2, 3]


def test_devices_without_a_context_are_probed_again_after_the_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_torch_backend, "REPROBE_NS", 0)  # every call is past the interval
    probe = Probe({0})
    backend = backend_with(probe, 4)
    assert backend.initialized_devices() == (0,)
    probe.asked.clear()
    probe.contexts.add(2)  # the program gave cuda:2 its first context
    assert backend.initialized_devices() == (0, 2)
    assert probe.asked == [1, 2, 3]  # cuda:0 is known: never asked again
    probe.asked.clear()
    probe.contexts.update({1, 3})
    assert backend.initialized_devices() == (0, 1, 2, 3)
    probe.asked.clear()
    for _ in range(10):  # every device has a context: nothing is probed any more
        assert backend.initialized_devices() == (0, 1, 2, 3)
    assert probe.asked == []


def test_until_the_first_context_every_call_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_backend, "REPROBE_NS", 10**15)
    probe = Probe(set())
    backend = backend_with(probe, 2)
    assert backend.initialized_devices() == ()
    assert backend.initialized_devices() == ()
    assert probe.asked == [0, 1, 0, 1]
    probe.contexts.add(1)
    assert backend.initialized_devices() == (1,)  # seen at once, not after the interval
