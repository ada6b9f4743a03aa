"""Span hooks (entry/exit, order, errors, ``-W error``), lazy results, the backend seam and
bounded bookkeeping, through the fake allocator."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Iterator

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import torch_backend as _torch_backend
from cudamem.allocator.stats import DeviceCounters
from cudamem.base import warn as _warn
from cudamem.base.data import to_data
from cudamem.spans import state as _spans_state
from cudamem.spans.raw import RawSpan
from cudamem.spans.record import DeviceSpan, SpanRecord
from cudamem.spans.state import add_entry_hook, add_exit_hook, remove_entry_hook, remove_exit_hook

from ..fakes import FakeAllocator

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

MiB = 1024**2
_history = sys.modules["cudamem.spans.history"]
_leaks = sys.modules["cudamem.growth.detector"]


@pytest.fixture
def fake() -> Iterator[FakeAllocator]:
    alloc = FakeAllocator(devices=2, contexts=(0,))
    cudamem.configure_leaks()
    with _backend.use(alloc):
        yield alloc
    cudamem.configure_leaks()


class KeepingFake(FakeAllocator):
    """A fake GPU whose growth real CPU storages explain (a warning needs survivors)."""

    storages = "cpu"

    def __init__(self) -> None:
        super().__init__(devices=2, contexts=(0,))
        self.kept: list[torch.Tensor] = []

    def keep(self, nbytes: int) -> None:
        self.alloc(nbytes)
        self.kept.append(torch.empty(nbytes, dtype=torch.uint8))  # pages never touched


@pytest.fixture
def keeping() -> Iterator[KeepingFake]:
    alloc = KeepingFake()
    cudamem.configure_leaks()
    with _backend.use(alloc):
        yield alloc
    cudamem.configure_leaks()


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """cudamem warns once per problem per process; let this test see its own."""
    monkeypatch.setattr(_warn, "_warned", set())


# --------------------------------------------------------------------------- hooks


def test_hooks_fire_in_order_with_entry_counters_and_totals(fake: FakeAllocator) -> None:
    events: list[tuple[str, ...]] = []

    def enter_a(span: RawSpan) -> None:
        events.append(("enter-a", span.name, str(span.before[0][0])))

    def enter_b(span: RawSpan) -> None:
        events.append(("enter-b", span.name))

    def exit_a(span: RawSpan) -> None:
        events.append(("exit-a", span.name, str(span.top_level), str(span.alloc_delta)))

    def exit_b(span: RawSpan) -> None:
        events.append(("exit-b", span.name))

    for hook in (enter_a, enter_b):
        add_entry_hook(hook)
    for hook in (exit_a, exit_b):
        add_exit_hook(hook)
    try:
        fake.alloc(7)
        with cudamem.track("outer"):
            fake.alloc(5)
            with cudamem.track("inner"):
                fake.alloc(3)
    finally:
        for hook in (enter_a, enter_b):
            remove_entry_hook(hook)
        for hook in (exit_a, exit_b):
            remove_exit_hook(hook)
    assert events == [
        ("enter-a", "outer", "7"),  # entry counters are read before the block runs
        ("enter-b", "outer"),
        ("enter-a", "inner", "12"),
        ("enter-b", "inner"),
        ("exit-a", "inner", "False", "3"),  # children close first
        ("exit-b", "inner"),
        ("exit-a", "outer", "True", "8"),
        ("exit-b", "outer"),
    ]
    with cudamem.track("after removal"):
        pass
    assert len(events) == 8


def test_features_attach_as_hooks_in_import_order() -> None:
    oom = sys.modules["cudamem.ledger.oom_guard"]
    exits = [hook for hook, _ in _spans_state._exit_hooks]
    assert exits[:2] == [_leaks._on_span_exit, oom._on_span_exit]
    # The history takes top-level spans from the spans' own queue, not through a hook.
    assert _spans_state.STATE.finished_sink is _history._drain_soon
    assert _history._ring.inbox is _spans_state.finished
    # Growth detection's entry hook runs for leaks=True spans alone while nothing is armed.
    assert _spans_state._entry_registry[:1] == ((_leaks._on_span_enter, True),)
    assert _leaks._on_span_enter not in _spans_state.STATE.entry_hooks
    assert _spans_state.STATE.entry_hooks_leaks[:1] == (_leaks._on_span_enter,)
    # Only growth detection's own warning may leave a span's exit.
    assert dict(_spans_state._exit_hooks)[_leaks._on_span_exit] == (cudamem.LeakWarning,)


def test_hook_totals_equal_the_record(fake: FakeAllocator) -> None:
    seen: list[tuple[int, int, int | None, int | None, int]] = []

    def hook(span: RawSpan) -> None:
        seen.append(
            (span.alloc_delta, span.res_delta, span.peak_total, span.peak_delta, span.level)
        )

    add_exit_hook(hook)
    try:
        fake.alloc(10 * MiB)
        with cudamem.track("s") as span:
            fake.alloc(30 * MiB)
            fake.free(20 * MiB)
            fake.alloc(2 * MiB, device=1)  # a device that appears during the span
    finally:
        remove_exit_hook(hook)
    r = span.record
    assert seen == [(r.allocated_delta, r.reserved_delta, r.peak, r.peak_delta, 22 * MiB)]
    assert (r.allocated_delta, r.peak) == (12 * MiB, 40 * MiB + 2 * MiB)


def test_extras_stay_with_the_span_object_not_the_history(fake: FakeAllocator) -> None:
    def enter(span: RawSpan) -> None:
        span.extras = {"mine": [span.name]}

    seen: list[object] = []

    def leave(span: RawSpan) -> None:
        seen.append(span.extras)

    add_entry_hook(enter)
    add_exit_hook(leave)
    try:
        with cudamem.track("x") as span:
            pass
    finally:
        remove_entry_hook(enter)
        remove_exit_hook(leave)
    assert seen == [{"mine": ["x"]}]
    assert span._extras == {"mine": ["x"]}
    raw = _history._ring.inbox[-1]
    assert raw.name == "x" and raw.extras is None


def test_failing_hooks_are_swallowed_and_the_rest_still_run(
    fake: FakeAllocator, fresh_warnings: None
) -> None:
    ran: list[str] = []

    def bad_enter(span: RawSpan) -> None:
        raise KeyError("entry hook bug")

    def bad_exit(span: RawSpan) -> None:
        raise ZeroDivisionError("exit hook bug")

    def good_exit(span: RawSpan) -> None:
        ran.append(span.name)

    add_entry_hook(bad_enter)
    add_exit_hook(bad_exit)
    add_exit_hook(good_exit)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with cudamem.track("s") as span:
                    fake.alloc(1)
    finally:
        remove_entry_hook(bad_enter)
        remove_exit_hook(bad_exit)
        remove_exit_hook(good_exit)
    assert ran == ["s", "s", "s"]
    assert span.allocated_delta == 1
    assert cudamem.history().by_name("s").calls == 3
    messages = [str(w.message) for w in caught]
    # Once per hook, not once per span.
    assert sum("span entry hook failed: KeyError('entry hook bug')" in m for m in messages) == 1
    assert sum("span exit hook failed: ZeroDivisionError" in m for m in messages) == 1


class HookSignal(UserWarning):
    pass


def test_propagated_warning_leaves_after_every_hook_ran(fake: FakeAllocator) -> None:
    ran: list[str] = []

    def signal(span: RawSpan) -> None:
        raise HookSignal(f"about {span.name}")

    def later(span: RawSpan) -> None:
        ran.append(span.name)

    add_exit_hook(signal, propagate=(HookSignal,))
    add_exit_hook(later)
    try:
        with pytest.raises(HookSignal, match="about s"), cudamem.track("s"):
            pass
        assert ran == ["s"]
        assert cudamem.history().spans[-1].name == "s"
        # The block's own exception wins: the signal never replaces it.
        with pytest.raises(ValueError, match="user error"), cudamem.track("t"):
            raise ValueError("user error")
        assert ran == ["s", "t"]
    finally:
        remove_exit_hook(signal)
        remove_exit_hook(later)


# --------------------------------------------------------------------------- -W error


def test_leak_warning_as_error_reaches_the_user_as_itself(keeping: KeepingFake) -> None:
    fake = keeping
    caught: list[tuple[int, cudamem.LeakWarning]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10):
            try:
                with cudamem.track("leaky"):
                    fake.keep(4 * MiB)  # kept: +4 MiB per call
            except cudamem.LeakWarning as w:
                caught.append((i, w))
                break
    assert len(caught) == 1
    call, warning = caught[0]
    assert call == 4  # the fifth call, as without -W error
    assert type(warning) is cudamem.LeakWarning
    assert warning.growth is not None and warning.growth.per_call == 4 * MiB
    # The span that raised was recorded, and spans go on working.
    assert cudamem.history().by_name("leaky").calls == 5
    with cudamem.track("after"):
        fake.alloc(1)
    assert cudamem.history().spans[-1].name == "after"


def test_leak_warning_as_error_from_a_decorated_function(keeping: KeepingFake) -> None:
    @cudamem.track("step")
    def step() -> int:
        keeping.keep(4 * MiB)
        return 1

    with warnings.catch_warnings():
        warnings.simplefilter("error", cudamem.LeakWarning)
        results = [step() for _ in range(4)]
        with pytest.raises(cudamem.LeakWarning, match=r"step retains \+4\.0 MiB per call"):
            step()
    assert results == [1, 1, 1, 1]


def test_no_bookkeeping_failure_reaches_user_code_under_w_error(
    fake: FakeAllocator, fresh_warnings: None
) -> None:
    class Broken(FakeAllocator):
        def counters(self, device: int) -> tuple[int, int, int]:
            raise RuntimeError("driver went away")

        def counters_reset_peak(self, device: int) -> tuple[int, int, int]:
            raise RuntimeError("driver went away")

    def bad(span: RawSpan) -> None:
        warnings.warn("a hook's own warning", RuntimeWarning, stacklevel=1)

    add_exit_hook(bad)
    try:
        with warnings.catch_warnings(), _backend.use(Broken()):
            warnings.simplefilter("error")
            with cudamem.track("s") as span:
                result = 6 * 7
            with cudamem.track("nested") as outer, cudamem.track("in"):
                pass
    finally:
        remove_exit_hook(bad)
    assert result == 42
    notes = span.record.notes
    assert any("entry measurement failed: RuntimeError: driver went away" in n for n in notes)
    assert any("exit measurement failed" in n for n in notes)
    assert span.devices == () and span.peak is None
    assert str(span).startswith("s: n/a (measurement failed), ")
    assert [c.name for c in outer.children] == ["in"]


# --------------------------------------------------------------------------- lazy results


def test_lazy_record_equals_the_eager_one(fake: FakeAllocator) -> None:
    fake.alloc(1 * MiB)
    with cudamem.track("outer") as outer:
        fake.alloc(3 * MiB)
        with cudamem.track("inner", peak=False) as inner:
            fake.alloc(6 * MiB)
            fake.free(6 * MiB)
        with cudamem.track("inner2") as inner2:
            fake.alloc(2 * MiB)
            fake.free(2 * MiB)
    raw = outer._raw
    assert raw is not None and raw._record is None  # nothing built until read
    c = DeviceCounters
    expected_inner = SpanRecord.build(
        "inner",
        (DeviceSpan(0, c(0, 4 * MiB, 4 * MiB, 4 * MiB), c(0, 4 * MiB, 10 * MiB, 10 * MiB), None),),
        duration=inner.duration,
        started_at=inner.record.started_at,
        peak_tracked=False,
    )
    expected_inner2 = SpanRecord.build(
        "inner2",
        (
            DeviceSpan(
                0, c(0, 4 * MiB, 10 * MiB, 10 * MiB), c(0, 4 * MiB, 10 * MiB, 6 * MiB), 6 * MiB
            ),
        ),
        duration=inner2.duration,
        started_at=inner2.record.started_at,
    )
    expected = SpanRecord.build(
        "outer",
        # The inner span with peak=False left the counter alone (10 MiB); inner2 reset it,
        # folding 10 MiB into outer.
        (
            DeviceSpan(
                0, c(0, 1 * MiB, 1 * MiB, 1 * MiB), c(0, 4 * MiB, 10 * MiB, 6 * MiB), 10 * MiB
            ),
        ),
        duration=outer.duration,
        started_at=outer.record.started_at,
        children=(expected_inner, expected_inner2),
    )
    assert outer.record == expected
    assert outer.to_dict() == to_data(expected)
    assert str(outer) == str(expected)
    assert cudamem.history().spans[-1] is outer.record  # built once, shared


def test_started_at_is_wall_clock(fake: FakeAllocator) -> None:
    import time

    before = time.time()
    with cudamem.track("s") as span:
        pass
    after = time.time()
    assert before - 0.01 <= span.record.started_at <= after + 0.01


# --------------------------------------------------------------------------- seam, bounds


def test_backend_counters_default_to_read(fake: FakeAllocator) -> None:
    fake.alloc(5 * MiB)
    fake.free(2 * MiB)
    assert fake.counters(0) == (3 * MiB, 5 * MiB, 5 * MiB)
    assert fake.calls["reset_peak"] == 0
    assert fake.counters_reset_peak(0) == (3 * MiB, 5 * MiB, 5 * MiB)  # read before reset
    assert fake.calls["reset_peak"] == 1
    assert fake.counters(0) == (3 * MiB, 5 * MiB, 3 * MiB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_torch_backend_counters_without_cuda() -> None:
    backend = _torch_backend.TorchBackend()
    assert backend.counters(0) == (0, 0, 0)
    assert backend.counters_reset_peak(0) == (0, 0, 0)


def test_no_context_says_what_was_not_measured() -> None:
    with _backend.use(FakeAllocator(devices=1, contexts=())), cudamem.track("idle") as span:
        pass
    assert span.devices == () and span.peak is None and span.peak_delta is None
    assert span.record.unmeasured == "no CUDA device in use"
    assert str(span).startswith("idle: n/a (no CUDA device in use), ")
    stats = cudamem.history().by_name("idle")
    assert stats.max_peak is None and stats.calls == 1


def test_bookkeeping_stays_bounded(fake: FakeAllocator) -> None:
    @cudamem.track("decorated", leaks=False)
    def step() -> None:
        fake.alloc(1)
        fake.free(1)

    for i in range(3000):
        step()
        with cudamem.track(f"name{i % 7}"), cudamem.track("inner"):
            pass
    assert _spans_state._open_peak == {}
    assert len(_spans_state._peak_inbox) <= _spans_state._PEAK_INBOX + 1
    assert len(_history._ring.inbox) < _history.DRAIN_AT
    hist = cudamem.history()
    assert len(hist.spans) == 1000 and hist.dropped == 6000 - 1000
    assert sum(s.calls for s in hist.stats) == 6000
    assert _spans_state._top.get() is None


def test_span_objects_are_not_kept(fake: FakeAllocator) -> None:
    with cudamem.track("s", leaks=True) as span:
        pass
    ref = weakref.ref(span)
    record = span.record
    del span
    gc.collect()
    assert ref() is None  # neither the history nor the stack holds the MemorySpan
    assert cudamem.history().spans[-1] is record


def test_max_allocated_sees_every_folded_peak(fake: FakeAllocator) -> None:
    for size in (30, 10, 70, 20):
        with cudamem.track("s"):
            fake.alloc(size * MiB)
            fake.free(size * MiB)
    for _ in range(_spans_state._PEAK_INBOX * 2):  # enough resets to merge the inbox on the way
        with cudamem.track("t"):
            pass
    assert cudamem.max_allocated(0) == 70 * MiB
    assert fake.peak[0] < 70 * MiB  # PyTorch's own counter was reset meanwhile


def test_nested_spans_leave_no_reference_cycles(fake: FakeAllocator) -> None:
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector frees lands in gc.garbage
    try:
        for _ in range(3):
            with cudamem.track("outer"), cudamem.track("inner"), cudamem.track("deep"):
                pass
        cudamem.clear_history()
        gc.collect()
        cycles = [o for o in gc.garbage if isinstance(o, RawSpan)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cycles == []  # freed by reference counting alone


def test_arming_a_name_widens_the_leak_entry_hook_to_every_span_and_disarming_narrows_it() -> None:
    detector = _leaks._detector
    series = _leaks._Series(4)
    try:
        detector._arm("step", series)
        assert (
            _leaks._on_span_enter in _spans_state.STATE.entry_hooks
        )  # a leaks=False span asks too
        detector._arm("eval", _leaks._Series(4))
        detector._disarm("step", series)
        assert _leaks._on_span_enter in _spans_state.STATE.entry_hooks  # "eval" is still armed
        detector._disarm("eval", series)
        assert _leaks._on_span_enter not in _spans_state.STATE.entry_hooks
        assert _spans_state.STATE.entry_hooks_leaks[:1] == (_leaks._on_span_enter,)
    finally:
        detector.reset()
    assert (
        _leaks._armed == frozenset() and _leaks._on_span_enter not in _spans_state.STATE.entry_hooks
    )
