"""The span hot path's shortcuts give what the long way gives: the history's batch fold, exit
hooks that run only for spans that raised, settled devices, fields stored only when needed
(fake allocator)."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import pytest

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import torch_backend as _torch_backend
from cudamem.spans import history as _history
from cudamem.spans import state as _spans_state
from cudamem.spans.raw import RawSpan
from cudamem.spans.state import add_exit_hook, remove_exit_hook

from ..fakes import FakeAllocator
from .test_backend_contexts import Probe, backend_with

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

MiB = 1024**2


@pytest.fixture
def fake() -> Iterator[FakeAllocator]:
    alloc = FakeAllocator(devices=2, contexts=(0,))
    with _backend.use(alloc):
        yield alloc


def _varied_spans(fake: FakeAllocator, n: int, seed: int) -> list[RawSpan]:
    """``n`` closed top-level spans of one name: random growth, some raising, some with
    ``peak=False``, some on a second device that appears during the span."""
    rng = random.Random(seed)
    out: list[RawSpan] = []
    for i in range(n):
        span = cudamem.track("s", peak=rng.random() > 0.2)
        grow, spike = rng.randrange(-4, 9) * MiB, rng.randrange(0, 5) * MiB
        try:
            with span:
                fake.alloc(spike + max(grow, 0))
                fake.free(spike)
                if grow < 0 and fake.allocated[0] >= -grow:
                    fake.free(-grow)
                if i % 37 == 5:
                    fake.alloc(1 * MiB, device=1)
                if rng.random() < 0.1:
                    raise KeyError(i)
        except KeyError:
            pass
        assert span._raw is not None
        out.append(span._raw)
    return out


def _stats(agg: _history._Aggregate) -> _history.SpanStats:
    return agg.freeze("s")


@pytest.mark.parametrize("n", [1, 11, 12, 13, 256, 700])
def test_batch_fold_equals_the_span_by_span_fold(fake: FakeAllocator, n: int) -> None:
    spans = _varied_spans(fake, n, seed=n)
    assert any(s.exception is not None for s in spans) or n < 12
    assert any(s.peak_total is None for s in spans) or n < 12
    batch, one = _history._Aggregate(), _history._Aggregate()
    batch.add(spans)
    for s in spans:
        one.add_one(s)
    b, o = _stats(batch), _stats(one)
    assert b.mean_duration == pytest.approx(o.mean_duration)
    assert b.max_duration == o.max_duration
    exact = ("calls", "errors", "measured", "total_allocated_delta", "max_allocated_delta")
    exact += ("max_reserved_delta", "max_peak", "max_peak_delta")
    assert {k: getattr(b, k) for k in exact} == {k: getattr(o, k) for k in exact}
    for k in ("mean_allocated_delta", "mean_reserved_delta", "mean_peak", "mean_peak_delta"):
        assert getattr(b, k) == pytest.approx(getattr(o, k)), k
    # And both against the records themselves.
    records = [s.record() for s in spans]
    assert b.calls == n and b.errors == sum(r.exception is not None for r in records)
    assert b.total_allocated_delta == sum(r.allocated_delta for r in records)
    peaks = [r.peak for r in records if r.peak is not None]
    assert b.max_peak == (max(peaks) if peaks else None)


def test_batch_fold_of_spans_that_all_lack_a_peak(fake: FakeAllocator) -> None:
    spans = []
    for i in range(40):
        with cudamem.track("s", peak=False) as span:
            fake.alloc(i * MiB)
        spans.append(span._raw)
    agg = _history._Aggregate()
    agg.add(spans)
    stats = _stats(agg)
    assert stats.max_peak is None and stats.mean_peak is None and stats.max_peak_delta is None
    assert stats.max_allocated_delta == 39 * MiB and stats.calls == 40


@pytest.fixture
def no_growth_detection() -> Iterator[None]:
    """Growth detection off: a level that only rises would have it investigate (a census of
    the test process's heap) every few spans, which is not what these tests are about."""
    cudamem.configure_leaks(enabled=False)
    try:
        yield
    finally:
        cudamem.configure_leaks()


@pytest.mark.usefixtures("no_growth_detection")
def test_history_aggregates_are_exact_over_ring_wrap_around(fake: FakeAllocator) -> None:
    cudamem.set_history_size(7)
    expected: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    errors = dict.fromkeys(expected, 0)
    for i in range(3 * _history.DRAIN_AT + 41):
        name = "abc"[i % 3]
        grow = (i % 5) * MiB
        try:
            with cudamem.track(name):
                fake.alloc(grow)
                if i % 11 == 0:
                    raise ValueError(i)
        except ValueError:
            errors[name] += 1
        expected[name].append(grow)
        if i == 500:  # a read in the middle drains a partial inbox
            assert cudamem.history().by_name("a").calls == len(expected["a"])
    hist = cudamem.history()
    total = sum(len(v) for v in expected.values())
    assert len(hist.spans) == 7 and hist.dropped == total - 7
    assert [r.name for r in hist.spans] == ["abc"[i % 3] for i in range(total - 7, total)]
    for name, grows in expected.items():
        stats = hist.by_name(name)
        assert stats.calls == len(grows) and stats.errors == errors[name]
        assert stats.total_allocated_delta == sum(grows)
        assert stats.max_allocated_delta == max(grows)
        assert stats.mean_allocated_delta == pytest.approx(sum(grows) / len(grows))
        assert stats.measured == len(grows)


def test_history_counts_every_span_of_eight_threads(fake: FakeAllocator) -> None:
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(1000):
                try:
                    with cudamem.track(f"t{k % 2}"):
                        if i % 10 == 0:
                            raise KeyError(i)
                except KeyError:
                    pass
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    hist = cudamem.history()
    for name in ("t0", "t1"):
        stats = hist.by_name(name)
        assert (stats.calls, stats.errors, stats.measured) == (4000, 400, 4000)
    assert hist.dropped == 8000 - len(hist.spans)


def test_errors_only_exit_hooks_run_for_spans_that_raised(fake: FakeAllocator) -> None:
    calls: list[tuple[str, str]] = []

    def first(span: RawSpan) -> None:
        calls.append(("first", span.name))

    def on_error(span: RawSpan) -> None:
        assert span.exception is not None
        calls.append(("on_error", span.name))

    def last(span: RawSpan) -> None:
        calls.append(("last", span.name))

    add_exit_hook(first)
    add_exit_hook(on_error, errors_only=True)
    add_exit_hook(last)
    try:
        with cudamem.track("fine"):
            pass
        with pytest.raises(KeyError), cudamem.track("bad"):
            raise KeyError("x")
        remove_exit_hook(on_error)
        with pytest.raises(KeyError), cudamem.track("bad again"):
            raise KeyError("x")
    finally:
        for hook in (first, on_error, last):
            remove_exit_hook(hook)
    assert calls == [
        ("first", "fine"),
        ("last", "fine"),
        ("first", "bad"),
        ("on_error", "bad"),  # registration order, also among errors-only hooks
        ("last", "bad"),
        ("first", "bad again"),
        ("last", "bad again"),
    ]
    assert on_error not in _spans_state._errors_only


def test_the_oom_hook_is_skipped_only_for_spans_that_did_not_raise() -> None:
    oom = sys.modules["cudamem.ledger.oom_guard"]
    assert oom._on_span_exit in _spans_state.STATE.exit_calls
    assert oom._on_span_exit not in _spans_state.STATE.exit_calls_ok
    calls = _spans_state.STATE.exit_calls
    assert _spans_state.STATE.exit_calls_ok == tuple(h for h in calls if h is not oom._on_span_exit)


class SettledFake(FakeAllocator):
    """A fake whose devices can be declared settled, counting the probes spans make."""

    def __init__(self) -> None:
        super().__init__(devices=2, contexts=(0,))
        self.probes = 0

    def initialized_devices(self) -> tuple[int, ...]:
        self.probes += 1
        return super().initialized_devices()


def test_settled_devices_are_not_probed_and_measure_alike() -> None:
    fake = SettledFake()
    with _backend.use(fake):
        fake.alloc(1 * MiB)
        with cudamem.track("probed") as probed:
            fake.alloc(3 * MiB)
        assert fake.probes == 2  # entry and exit
        fake.contexts.add(1)
        fake.settled_devices = (0, 1)
        with cudamem.track("settled") as settled:
            fake.alloc(2 * MiB)
            fake.alloc(5 * MiB, device=1)
        assert fake.probes == 2  # neither edge asked
    assert probed.allocated_delta == 3 * MiB and [d.device for d in probed.devices] == [0]
    assert [d.device for d in settled.devices] == [0, 1]
    assert settled.device(0).allocated_delta == 2 * MiB
    assert settled.device(1).allocated_delta == 5 * MiB
    assert settled.peak == 6 * MiB + 5 * MiB


def test_a_span_opened_before_the_devices_settled_still_sees_new_ones() -> None:
    fake = SettledFake()
    with _backend.use(fake), cudamem.track("s") as span:
        fake.alloc(4 * MiB, device=1)  # a new context during the span
        fake.settled_devices = (0, 1)
    assert [d.device for d in span.devices] == [0, 1]
    assert span.device(1).allocated_delta == 4 * MiB


def test_torch_backend_settles_once_every_device_has_a_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_torch_backend, "REPROBE_NS", 0)
    probe = Probe({0})
    backend = backend_with(probe, 2)
    assert backend.initialized_devices() == (0,)
    assert backend.settled_devices is None  # cuda:1 may still get a context
    probe.contexts.add(1)
    found = backend.initialized_devices()
    assert found == (0, 1) and backend.settled_devices is found
    probe.asked.clear()
    assert backend.initialized_devices() is found and probe.asked == []
    none = backend_with(Probe(set()), 0)
    assert none.initialized_devices() == () and none.settled_devices is None


def test_fields_left_unstored_read_as_their_defaults(fake: FakeAllocator) -> None:
    fake.alloc(2 * MiB)
    with cudamem.track("s") as span:
        fake.alloc(6 * MiB)
        fake.free(4 * MiB)
    raw = span._raw
    assert raw is not None
    for field in ("peaks", "dropped", "notes", "unmeasured"):
        assert not hasattr(raw, field), field  # the hot path never stored them
    record = raw.record()
    assert record.devices[0].peak == raw.peak_total == 8 * MiB
    assert (record.dropped_children, record.notes, record.unmeasured) == (0, (), None)
    assert (raw.top_level, raw.exception, raw.peak_delta) == (True, None, 6 * MiB)


def test_the_seams_c_level_reads_are_called_directly_and_fall_back_when_they_raise() -> None:
    """``Backend.fast_counters``/``fast_reset`` (the C++ reader's calls) serve a span on one
    device without the methods; one that raises leaves the span to the methods, which
    measure it all the same."""

    class Fast(FakeAllocator):
        def __init__(self) -> None:
            super().__init__(devices=1, contexts=(0,))
            self.fast_reads: list[str] = []
            self.broken = False

        def _fast(self, name: str, reset: bool) -> tuple[int, int, int]:
            if self.broken:
                raise RuntimeError("reader gone")
            self.fast_reads.append(name)
            return self.counters_reset_peak(0) if reset else self.counters(0)

    fake = Fast()
    fake.fast_reset = lambda d: fake._fast("reset", True)
    fake.fast_counters = lambda d: fake._fast("read", False)
    with _backend.use(fake):
        with cudamem.track("fast") as span:
            fake.alloc(3 * MiB)
        assert fake.fast_reads == ["reset", "read"]
        assert span.allocated_delta == 3 * MiB and span.peak_delta == 3 * MiB
        fake.broken = True
        with cudamem.track("fallback") as span:
            fake.alloc(2 * MiB)
            fake.free(2 * MiB)
        assert fake.fast_reads == ["reset", "read"]  # the methods answered this one
        assert span.allocated_delta == 0 and span.peak_delta == 2 * MiB
        assert span.record.notes == ()  # no "measurement failed"
