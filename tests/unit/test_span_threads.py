"""Spans across threads and tasks: nothing stranded on a stack, no span lost, exact counts,
peaks folded across threads (fake allocator)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.spans import state as _spans_state

from ..fakes import FakeAllocator

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

MiB = 1024**2


class AtomicFake(FakeAllocator):
    """Reads and resets the peak in one step, and remembers the true maximum ever allocated,
    so that nothing a reset discards can hide from ``max_allocated``."""

    def __init__(self) -> None:
        super().__init__(devices=1, contexts=(0,))
        self.true_max = 0

    def alloc(self, nbytes: int, device: int = 0) -> None:
        with self.lock:
            self.allocated[device] += nbytes
            self.reserved[device] = max(self.reserved[device], self.allocated[device])
            self.peak[device] = max(self.peak[device], self.allocated[device])
            self.true_max = max(self.true_max, self.allocated[device])

    def counters(self, device: int) -> tuple[int, int, int]:
        with self.lock:
            return (self.allocated[device], self.reserved[device], self.peak[device])

    def counters_reset_peak(self, device: int) -> tuple[int, int, int]:
        with self.lock:
            values = (self.allocated[device], self.reserved[device], self.peak[device])
            self.peak[device] = self.allocated[device]
            return values


@pytest.fixture
def fake() -> Iterator[AtomicFake]:
    alloc = AtomicFake()
    with _backend.use(alloc):
        yield alloc


def test_span_exited_on_another_thread_leaves_no_trace_on_the_first(fake: AtomicFake) -> None:
    s = cudamem.track("a")
    s.__enter__()
    t = threading.Thread(target=s.__exit__, args=(None,) * 3)
    t.start()
    t.join()
    with cudamem.track("b") as b:
        pass
    hist = cudamem.history()
    assert [r.name for r in hist.spans] == ["a", "b"]
    assert s.record.children == ()  # b did not become a's child
    assert s.record.thread == t.name and b.record.thread == threading.current_thread().name
    assert _spans_state._top.get() is None
    assert _spans_state._open_peak == {}


def test_child_of_a_span_closed_elsewhere_goes_to_the_grandparent(fake: AtomicFake) -> None:
    with cudamem.track("outer") as outer:
        middle = cudamem.track("middle")
        middle.__enter__()
        inner = cudamem.track("inner")
        inner.__enter__()
        t = threading.Thread(target=middle.__exit__, args=(None,) * 3)
        t.start()
        t.join()
        inner.__exit__(None, None, None)  # its parent closed meanwhile
        with cudamem.track("next"):
            pass
    assert [c.name for c in outer.children] == ["middle", "inner", "next"]
    assert middle.record.children == ()


def test_out_of_order_close_on_one_thread(fake: AtomicFake) -> None:
    a, b = cudamem.track("a"), cudamem.track("b")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    with cudamem.track("c"):
        pass  # b is still open: c is b's child
    b.__exit__(None, None, None)  # a closed first, so b is top-level
    with cudamem.track("d"):
        pass
    assert [r.name for r in cudamem.history().spans] == ["a", "b", "d"]
    assert [c.name for c in b.children] == ["c"] and a.children == ()


THREADS = 8
PER_THREAD = 10_000


def test_eight_threads_ten_thousand_spans_each_lose_nothing(fake: AtomicFake) -> None:
    """Per thread: 4000 flat spans, 1000 nested pairs, 2000 spans exited by a closer thread,
    1000 pairs whose inner span a closer thread exits: 10,000 spans, 8000 of them top-level."""
    cudamem.set_history_size(8000 * THREADS)  # every top-level span stays in the history
    handoff: queue.Queue[tuple[cudamem.MemorySpan, threading.Event] | None] = queue.Queue()
    errors: list[BaseException] = []
    outers: list[cudamem.MemorySpan] = []
    handed: list[cudamem.MemorySpan] = []
    start = threading.Barrier(THREADS)

    def closer() -> None:
        while (item := handoff.get()) is not None:
            span, done = item
            fake.alloc(1 * MiB)
            fake.free(1 * MiB)
            span.__exit__(None, None, None)
            done.set()

    def close_elsewhere(span: cudamem.MemorySpan) -> None:
        done = threading.Event()
        handoff.put((span, done))
        done.wait()

    def worker() -> None:
        try:
            start.wait()
            for _ in range(1000):
                for _ in range(4):
                    with cudamem.track("flat"):
                        fake.alloc(4096)
                        fake.free(4096)
                with cudamem.track("outer") as outer, cudamem.track("inner"):
                    fake.alloc(2 * MiB)
                    fake.free(2 * MiB)
                for _ in range(2):
                    span = cudamem.track("handoff")
                    span.__enter__()
                    close_elsewhere(span)
                    handed.append(span)
                with cudamem.track("outer2") as outer2:
                    inner = cudamem.track("inner2")
                    inner.__enter__()
                    close_elsewhere(inner)
                outers.extend((outer, outer2))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    closers = [threading.Thread(target=closer) for _ in range(2)]
    workers = [threading.Thread(target=worker) for _ in range(THREADS)]
    try:
        for th in closers + workers:
            th.start()
        for th in workers:
            th.join()
        for _ in closers:
            handoff.put(None)
        for th in closers:
            th.join()
        assert errors == []
        hist = cudamem.history()
        calls = {s.name: s.calls for s in hist.stats}
        assert calls == {
            "flat": 4000 * THREADS,
            "outer": 1000 * THREADS,
            "handoff": 2000 * THREADS,
            "outer2": 1000 * THREADS,
        }
        assert len(hist.spans) == 8000 * THREADS and hist.dropped == 0
        # Each worker closed its own 6000 top-level spans (flat, outer, outer2) and the
        # closers the 2000 handed over by each: recorded, not counted by the loop itself.
        by_thread = Counter(r.thread for r in hist.spans)
        assert {by_thread[th.name] for th in workers} == {6000}
        assert sum(by_thread[th.name] for th in closers) == 2000 * THREADS
        assert Counter(r.name for r in hist.spans if r.thread in {th.name for th in closers}) == {
            "handoff": 2000 * THREADS
        }
        # A nested pair is one record with its child: 10 spans per round, 10,000 per thread.
        recorded = sum(1 + len(r.children) for r in hist.spans)
        assert recorded == PER_THREAD * THREADS
        # Every child is where it belongs, including those closed by another thread.
        assert all(len(o.children) == 1 for o in outers)
        assert Counter(o.children[0].name for o in outers) == Counter(
            {"inner": 1000 * THREADS, "inner2": 1000 * THREADS}
        )
        assert all(s.closed and s.children == () for s in handed)
        closer_names = {th.name for th in closers}
        assert {s.record.thread for s in handed} <= closer_names
        # No span was left open or on a stack; the open-peak registry is empty.
        assert _spans_state._open_peak == {}
        for r in hist.spans:
            for d in r.devices:
                assert d.peak is not None
                assert d.peak >= max(d.before.allocated, d.after.allocated)
        # Every peak any reset discarded reached the process-wide maximum.
        assert cudamem.max_allocated(0) == fake.true_max
        assert fake.true_max >= 2 * MiB
    finally:
        cudamem.set_history_size(1000)


def test_peak_folds_into_a_span_of_another_thread(fake: AtomicFake) -> None:
    inside = threading.Event()
    resume = threading.Event()
    results: dict[str, cudamem.MemorySpan] = {}

    def long_running() -> None:
        with cudamem.track("long") as span, cudamem.track("long-inner") as inner:
            fake.alloc(300 * MiB)
            fake.free(300 * MiB)
            inside.set()
            resume.wait()
        results["long"], results["inner"] = span, inner

    t = threading.Thread(target=long_running)
    t.start()
    inside.wait()
    with cudamem.track("short") as short:  # resets the counter under the fold lock
        fake.alloc(10 * MiB)
        fake.free(10 * MiB)
    resume.set()
    t.join()
    assert results["long"].peak == 300 * MiB
    assert results["inner"].peak == 300 * MiB
    assert short.peak == 10 * MiB
    assert cudamem.max_allocated(0) == 300 * MiB


def test_tasks_keep_their_own_stacks(fake: AtomicFake) -> None:
    async def task(name: str) -> cudamem.MemorySpan:
        with cudamem.track(name) as outer:
            for i in range(3):
                await asyncio.sleep(0)
                with cudamem.track(f"{name}.{i}"):
                    await asyncio.sleep(0)
        return outer

    async def main() -> list[cudamem.MemorySpan]:
        return list(await asyncio.gather(task("a"), task("b")))

    a, b = asyncio.run(main())
    assert [c.name for c in a.children] == ["a.0", "a.1", "a.2"]
    assert [c.name for c in b.children] == ["b.0", "b.1", "b.2"]
    assert sorted(r.name for r in cudamem.history().spans) == ["a", "b"]
