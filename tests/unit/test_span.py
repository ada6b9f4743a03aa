"""Span logic through the fake allocator at the ``_backend`` seam, plus the real no-CUDA path."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import weakref

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.stats import AllocatorStats
from cudamem.render.json import to_json

from ..fakes import FakeAllocator

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

MiB = 1024**2


@pytest.fixture
def fake() -> FakeAllocator:
    alloc = FakeAllocator(devices=2, contexts=(0,))
    with _backend.use(alloc):
        yield alloc


def test_deltas_and_peak(fake: FakeAllocator) -> None:
    fake.alloc(100 * MiB)
    wall = time.perf_counter()
    with cudamem.track("step") as span:
        fake.alloc(256 * MiB)
        fake.alloc(256 * MiB)
        fake.free(256 * MiB)
    wall = time.perf_counter() - wall
    assert span.allocated_delta == 256 * MiB
    assert span.reserved_delta == 512 * MiB
    assert span.peak == 612 * MiB
    assert span.peak_delta == 512 * MiB
    assert 0 <= span.duration <= wall  # inside the block as the caller timed it
    assert [d.device for d in span.devices] == [0]
    d0 = span.device(0)
    assert d0.before.allocated == 100 * MiB and d0.after.allocated == 356 * MiB
    assert str(span).startswith(
        "step: allocated +256.0 MiB, reserved +512.0 MiB, peak 612.0 MiB (+512.0 MiB) on cuda:0, "
    )


def test_peak_below_entry_level_is_entry_level(fake: FakeAllocator) -> None:
    fake.alloc(300 * MiB)
    fake.free(200 * MiB)  # the process peak (300) predates the span
    with cudamem.track("s") as span:
        fake.free(50 * MiB)
    assert span.peak == 100 * MiB
    assert span.peak_delta == 0
    assert cudamem.max_allocated(0) == 300 * MiB


def test_nested_peaks_fold_into_outer(fake: FakeAllocator) -> None:
    with cudamem.track("outer") as outer:
        fake.alloc(500 * MiB)
        fake.free(500 * MiB)  # outer's peak happens before inner resets the counter
        with cudamem.track("inner") as inner:
            fake.alloc(100 * MiB)
            fake.free(100 * MiB)
        with cudamem.track("inner2") as inner2:
            fake.alloc(10 * MiB)
    assert inner.peak == 100 * MiB
    assert inner2.peak == 10 * MiB
    assert outer.peak == 500 * MiB
    assert [c.name for c in outer.children] == ["inner", "inner2"]
    assert cudamem.max_allocated(0) == 500 * MiB
    # Only the outer span reaches the history; children hang below it.
    hist = cudamem.history()
    assert [r.name for r in hist.spans] == ["outer"]


def test_inner_peak_after_outer_sees_inner(fake: FakeAllocator) -> None:
    with cudamem.track("outer") as outer:
        with cudamem.track("inner"):
            fake.alloc(700 * MiB)
            fake.free(700 * MiB)
        fake.alloc(1 * MiB)
    assert outer.peak == 700 * MiB


def test_peak_false_leaves_counter_alone(fake: FakeAllocator) -> None:
    fake.alloc(50 * MiB)
    with cudamem.track("s", peak=False) as span:
        fake.alloc(10 * MiB)
    assert span.peak is None and span.peak_delta is None
    assert fake.calls["reset_peak"] == 0
    assert "peak" not in str(span).split(" on ")[0]


def test_sync_false_does_not_synchronize(fake: FakeAllocator) -> None:
    with cudamem.track("s", sync=False):
        fake.alloc(1)
    assert fake.calls["synchronize"] == 0
    with cudamem.track("s2", sync=True):
        fake.alloc(1)
    assert fake.calls["synchronize"] == 2  # entry and exit, device 0 only


def test_default_does_not_synchronize(fake: FakeAllocator) -> None:
    with cudamem.track("s") as span:
        fake.alloc(5)

    @cudamem.track
    def f() -> None:
        fake.alloc(1)

    f()
    with cudamem.MemorySpan("m"):
        pass
    assert fake.calls["synchronize"] == 0
    assert span.allocated_delta == 5
    assert not span.record.synced


def test_no_context_created_on_untouched_device(fake: FakeAllocator) -> None:
    with cudamem.track("s", sync=True) as span:
        fake.alloc(4 * MiB, device=0)
    assert fake.synced == [0, 0]
    assert 1 not in fake.contexts
    assert [d.device for d in span.devices] == [0]


def test_device_that_appears_during_span(fake: FakeAllocator) -> None:
    with cudamem.track("s") as span:
        fake.alloc(8 * MiB, device=1)
    assert [d.device for d in span.devices] == [0, 1]
    d1 = span.device("cuda:1")
    assert d1.before.allocated == 0 and d1.allocated_delta == 8 * MiB
    assert d1.peak == 8 * MiB


def test_named_device_only(fake: FakeAllocator) -> None:
    fake.alloc(1 * MiB, device=1)
    with cudamem.track("s", device="cuda:1") as span:
        fake.alloc(2 * MiB, device=0)
        fake.alloc(3 * MiB, device=1)
    assert [d.device for d in span.devices] == [1]
    assert span.allocated_delta == 3 * MiB
    assert 0 not in fake.synced


def test_exception_propagates_and_is_recorded(fake: FakeAllocator) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="bang"), cudamem.track("s") as span:
        fake.alloc(1 * MiB)
        raise Boom("bang")
    assert span.exception is not None
    assert span.exception.type_name.endswith("Boom")
    assert span.exception.message == "bang"
    assert not span.exception.is_oom
    assert "raised Boom (bang)" in str(span)


def test_oom_recorded_as_such(fake: FakeAllocator) -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as info, cudamem.track("s") as span:
        raise oom
    assert info.value is oom  # unchanged
    assert span.exception is not None and span.exception.is_oom
    assert "out of memory" in str(span)


def test_exception_object_not_kept(fake: FakeAllocator) -> None:
    class Holder:
        pass

    def run() -> weakref.ref[Holder]:
        h = Holder()
        ref = weakref.ref(h)
        try:
            with cudamem.track("s"):
                local = h  # noqa: F841 - referenced by the traceback's frame
                raise ValueError("x")
        except ValueError:
            pass
        return ref

    ref = run()
    gc.collect()
    assert ref() is None


def test_decorator_forms(fake: FakeAllocator) -> None:
    @cudamem.track
    def bare(n: int) -> int:
        fake.alloc(n)
        return n

    @cudamem.track("fwd", sync=False)
    def named(n: int) -> int:
        fake.alloc(n)
        return 2 * n

    assert bare(5) == 5 and bare(7) == 7
    assert named(3) == 6
    assert bare.__name__ == "bare"
    hist = cudamem.history()
    names = [r.name for r in hist.spans]
    assert names == [bare.__qualname__, bare.__qualname__, "fwd"]
    assert [r.allocated_delta for r in hist.spans] == [5, 7, 3]
    stats = hist.by_name("fwd")
    assert stats.calls == 1 and stats.max_allocated_delta == 3


def test_memoryspan_object_form(fake: FakeAllocator) -> None:
    span = cudamem.MemorySpan("x")
    with pytest.raises(RuntimeError, match="not entered yet"):
        span.allocated_delta
    with span:
        with pytest.raises(RuntimeError, match="still open"):
            span.peak
        fake.alloc(9)
    assert span.allocated_delta == 9
    assert span.closed


def test_async_decorator(fake: FakeAllocator) -> None:
    @cudamem.track("coro")
    async def work() -> int:
        fake.alloc(11)
        await asyncio.sleep(0)
        return 1

    assert asyncio.run(work()) == 1
    assert cudamem.history().spans[-1].allocated_delta == 11


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"non-callable|span name"):
        cudamem.track(42)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="non-callable"):
        cudamem.track("x")(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="span name"):
        cudamem.MemorySpan(3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device must be"):
        cudamem.track("x", device=1.0)  # type: ignore[arg-type]


def test_bad_devices(fake: FakeAllocator) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        cudamem.track("x", device=5)
    with pytest.raises(ValueError, match=">= 0"):
        cudamem.track("x", device=-1)
    with pytest.raises(ValueError, match="CUDA devices"):
        cudamem.track("x", device="cpu")
    with pytest.raises(ValueError, match="unknown device"):
        cudamem.track("x", device="tpu:0")


def test_reentry_is_an_error(fake: FakeAllocator) -> None:
    span = cudamem.track("x")
    with span, pytest.raises(RuntimeError, match="already open"), span:
        pass
    with pytest.raises(RuntimeError, match="already measured"), span:
        pass


def test_threads_keep_separate_stacks(fake: FakeAllocator) -> None:
    barrier = threading.Barrier(4)
    results: dict[int, cudamem.MemorySpan] = {}

    def worker(i: int) -> None:
        with cudamem.track(f"t{i}") as outer:
            barrier.wait()
            with cudamem.track(f"t{i}-inner"):
                barrier.wait()
            barrier.wait()
        results[i] = outer

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, span in results.items():
        assert [c.name for c in span.children] == [f"t{i}-inner"]
    assert sorted(r.name for r in cudamem.history().spans) == ["t0", "t1", "t2", "t3"]


def test_peak_folding_across_threads(fake: FakeAllocator) -> None:
    entered = threading.Event()
    go_on = threading.Event()
    out: list[cudamem.MemorySpan] = []

    def long_span() -> None:
        with cudamem.track("long") as span:
            fake.alloc(400 * MiB)
            fake.free(400 * MiB)
            entered.set()
            go_on.wait()
        out.append(span)

    t = threading.Thread(target=long_span)
    t.start()
    entered.wait()
    with cudamem.track("short"):  # resets the shared counter after the 400 MiB peak
        fake.alloc(1 * MiB)
    go_on.set()
    t.join()
    assert out[0].peak == 400 * MiB


def test_history_is_bounded_and_aggregates(fake: FakeAllocator) -> None:
    cudamem.set_history_size(10)
    try:

        @cudamem.track("loop", sync=False, peak=False)
        def step() -> None:
            fake.alloc(2)

        for _ in range(1000):
            step()
        hist = cudamem.history()
        assert len(hist.spans) == 10
        assert hist.dropped == 990
        stats = hist.by_name("loop")
        assert stats.calls == 1000
        assert stats.mean_allocated_delta == 2 and stats.max_allocated_delta == 2
        assert stats.max_peak is None
        table = str(hist)
        assert "loop" in table and "1000" in table and "990 older spans" in table
    finally:
        cudamem.set_history_size(1000)


@pytest.mark.parametrize("count", [3, 40])  # below and above the batch aggregation size
def test_history_table_says_n_a_for_spans_that_measured_no_device(count: int) -> None:
    from ..fakes import FakeAllocator as Fake

    cudamem.clear_history()
    idle = Fake(devices=1, contexts=())  # no CUDA device in use: nothing to measure
    with _backend.use(idle):
        for _ in range(count):
            with cudamem.track("cpu step"):
                pass
    busy = Fake(devices=1, contexts=(0,))
    with _backend.use(busy):
        for _ in range(count):
            with cudamem.track("gpu step"):
                busy.alloc(3 * MiB)
    hist = cudamem.history()
    cpu, gpu = hist.by_name("cpu step"), hist.by_name("gpu step")
    assert (cpu.calls, cpu.measured) == (count, 0)
    assert (gpu.calls, gpu.measured) == (count, count)
    assert gpu.mean_allocated_delta == 3 * MiB
    rows = {line.split("  ")[0]: line for line in str(hist).splitlines()}
    assert "+0 B" not in rows["cpu step"]
    assert rows["cpu step"].split()[3:8] == ["n/a"] * 5  # "cpu", "step", calls, ...
    assert "+3.0 MiB" in rows["gpu step"]


def test_history_name_cap(fake: FakeAllocator) -> None:
    from cudamem.spans import history as _history

    for i in range(_history.MAX_NAMES + 5):
        with cudamem.track(f"n{i}", sync=False, peak=False):
            pass
    stats = cudamem.history().stats
    assert len(stats) == _history.MAX_NAMES + 1
    assert cudamem.history().by_name("<other>").calls == 5


def test_bad_history_size() -> None:
    with pytest.raises(ValueError):
        cudamem.set_history_size(0)


def test_to_dict_is_json_ready(fake: FakeAllocator) -> None:
    with cudamem.track("outer") as span, cudamem.track("inner"):
        fake.alloc(3 * MiB)
    data = json.loads(to_json(span))
    assert data["name"] == "outer"
    assert data["allocated_delta"] == 3 * MiB
    assert data["devices"][0]["device"] == 0
    assert data["devices"][0]["allocated_delta"] == 3 * MiB
    assert data["children"][0]["name"] == "inner"
    assert json.loads(to_json(cudamem.history()))["stats"][0]["calls"] == 1


def test_bookkeeping_failure_never_reaches_user(fake: FakeAllocator) -> None:
    class Broken(FakeAllocator):
        def read(self, device: int) -> AllocatorStats:
            raise RuntimeError("driver went away")

    with (
        _backend.use(Broken()),
        pytest.warns(RuntimeWarning, match="measurement failed"),
        cudamem.track("s") as span,
    ):
        x = 1 + 1
    assert x == 2
    assert span.devices == ()
    assert any("driver went away" in n for n in span.record.notes)


def test_exit_hook_sees_every_span(fake: FakeAllocator) -> None:
    from cudamem.spans.raw import RawSpan
    from cudamem.spans.state import add_exit_hook, remove_exit_hook

    seen: list[tuple[str, bool]] = []

    def hook(span: RawSpan) -> None:
        seen.append((span.name, span.top_level))

    add_exit_hook(hook)
    try:
        with cudamem.track("a"), cudamem.track("b"):
            pass
    finally:
        remove_exit_hook(hook)
    assert seen == [("b", False), ("a", True)]


def test_children_are_bounded(fake: FakeAllocator) -> None:
    from cudamem.spans.state import MAX_CHILDREN

    with cudamem.track("outer") as outer:
        for _ in range(MAX_CHILDREN + 7):
            with cudamem.track("c", sync=False, peak=False):
                pass
    assert len(outer.children) == MAX_CHILDREN
    assert outer.record.dropped_children == 7


# -- the real backend on this machine -------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_real_backend_without_cuda() -> None:
    backend = _backend.get()
    assert backend.initialized_devices() == ()
    with cudamem.track("cpu only") as span:
        torch.ones(1000) * 2
    assert span.devices == ()
    # Nothing could be measured, and the span says so instead of showing +0 B.
    assert span.allocated_delta == 0 and span.peak is None and span.peak_delta is None
    assert span.record.unmeasured == "no CUDA device"
    assert str(span).startswith("cpu only: n/a (no CUDA device), ")
    assert "+0 B" not in str(span)
    with pytest.raises(ValueError, match="no CUDA device"):
        cudamem.track("x", device=0)
    with pytest.raises(ValueError, match=r"max_allocated\(device=0\): .*sees no CUDA device"):
        cudamem.max_allocated(0)


def test_step_span_measures_between_calls_detached_from_the_stack(fake: FakeAllocator) -> None:
    """What ``cudamem run``, the trainer callbacks and the pytest plugin use: a step opened
    and closed by calls; a span the code opens meanwhile stays top-level."""
    step = cudamem.StepSpan("train step")
    assert not step.running and step.stop() is None
    first = step.start()
    assert step.running
    with pytest.raises(RuntimeError, match="running; stop"):
        step.start()
    fake.alloc(10)
    with cudamem.track("inner"):
        fake.alloc(5)
    closed = step.stop()
    assert closed is first and closed.allocated_delta == 15 and not step.running
    assert closed.children == ()  # "inner" did not nest under the detached step
    spans = cudamem.history().spans
    assert [s.name for s in spans] == ["inner", "train step"]
    # The exception that ended a step is recorded on it.
    step.start()
    failed = step.stop(MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert failed is not None and failed.exception is not None
    assert failed.exception.type_name == "builtins.MemoryError"
    # drop(): forgotten, never recorded.
    step.start()
    step.drop()
    assert not step.running and len(cudamem.history().spans) == 3


def test_step_span_without_hooks_is_cudamems_own(fake: FakeAllocator) -> None:
    step = cudamem.StepSpan("cudamem test", hooks=False)
    step.start()
    fake.alloc(8)
    span = step.stop()
    assert span is not None and span.peak == 8
    assert cudamem.history().spans == ()  # no feature saw it: not in the history
    with pytest.raises(TypeError, match="must be a str"):
        cudamem.StepSpan(3)  # type: ignore[arg-type]
