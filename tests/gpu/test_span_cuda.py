"""Spans on a real GPU (H200): seed 000's table, allocator rounding, nested peaks, contexts;
each test on the Python path and on the compiled span core."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.demo import seed000_lifecycle

from ..conftest import python_edges

#: Every test runs with spans through the Python functions and through the compiled span
#: core (``span_path``), on the real allocator.
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("span_path")]
MiB = 1024**2


def _clean() -> None:
    gc.collect()
    _backend.get().empty_cache()


def test_seed000_table_through_spans() -> None:
    _clean()
    exp = seed000_lifecycle()
    assert exp.skipped is None
    failed = [f"{c.name}: {c.detail}" for c in exp.checks if not c.passed]
    assert not failed, failed
    assert len(exp.checks) == 5


def test_create_del_clear_empty_cache_bytes() -> None:
    _clean()
    with cudamem.track("create", device=0) as create:
        x = torch.ones((8192, 8192), device="cuda:0")
    saved = [x]
    with cudamem.track("del", device=0) as delete:
        del x
        gc.collect()
    with cudamem.track("clear", device=0) as clear:
        saved.clear()
    with cudamem.track("empty", device=0) as empty:
        _backend.get().empty_cache()
    res = _backend.reserved_for(256 * MiB)  # 260 MiB under expandable segments
    assert (create.allocated_delta, create.reserved_delta) == (256 * MiB, res)
    assert create.peak_delta == 256 * MiB
    assert (delete.allocated_delta, delete.reserved_delta) == (0, 0)
    assert (clear.allocated_delta, clear.reserved_delta) == (-256 * MiB, 0)
    assert (empty.allocated_delta, empty.reserved_delta) == (0, -res)


def test_4mib_tensor_reserves_20mib_segment() -> None:
    # A fresh process: earlier tests leave small segments with free room behind, and a 4 MiB
    # request would be carved from one of them instead of getting its own 20 MiB segment.
    code = textwrap.dedent(
        """
        import gc, torch, cudamem
        from cudamem.allocator import backend as _backend
        torch.cuda.init()
        with cudamem.track("4 MiB") as span:
            x = torch.zeros(1024, 1024, device="cuda:0")
        del x
        gc.collect()
        with cudamem.track("free") as freed:
            _backend.get().empty_cache()
        print(span.allocated_delta, span.reserved_delta, freed.reserved_delta)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    alloc, reserved, freed = map(int, out.stdout.split())
    assert alloc == 4 * MiB
    assert reserved == 20 * MiB
    assert freed == -20 * MiB


def test_nested_peaks_on_gpu() -> None:
    _clean()
    with cudamem.track("outer") as outer:
        big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
        del big
        with cudamem.track("inner") as inner:
            small = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
            del small
    assert inner.peak_delta == 64 * MiB
    assert outer.peak_delta == 512 * MiB
    assert outer.peak is not None
    assert cudamem.max_allocated(0) >= outer.peak >= outer.device(0).before.allocated + 512 * MiB
    assert outer.children[0].name == "inner"


def test_sync_false_matches_sync_true_for_allocations() -> None:
    _clean()
    with cudamem.track("nosync", sync=False) as span:
        x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda:0")
    assert span.allocated_delta == 32 * MiB
    del x


# -- reads without synchronize ----------------------------------------------------------
#
# The caching allocator changes its counters when the host queues an allocation or a free
# (c10/cuda/CUDACachingAllocator.cpp: free() decreases allocated_bytes at once, whatever
# the block's stream uses), not when the GPU runs the kernels. So a span's exit read
# without synchronize must equal the read right after one, even while the GPU is busy.
# Each case checks that the GPU really was busy at the read (else it proves nothing).

N = 8192  # one fp32 matrix: 256 MiB; a matmul of two: ~20 ms of GPU time on an H200
QUEUED = 20


def _matrices(count: int = 2) -> list[torch.Tensor]:
    out = [torch.randn(N, N, device="cuda:0") for _ in range(count)]
    out[0] @ out[-1]  # the cuBLAS workspace now exists: later matmuls allocate only outputs
    torch.cuda.synchronize()
    _backend.get().empty_cache()  # and the warm-up's output is not cached for reuse
    return out


def _busy(stream: torch.cuda.Stream | None = None) -> bool:
    """Whether work queued on ``stream`` (default: the current one) is still running."""
    event = torch.cuda.Event()
    event.record(stream)
    return not event.query()


def _settled() -> tuple[int, int]:
    torch.cuda.synchronize()
    allocated, reserved, _ = _backend.get().counters(0)
    return allocated, reserved


def _exit_read(span: cudamem.MemorySpan) -> tuple[int, int]:
    after = span.device(0).after
    return after.allocated, after.reserved


def test_no_sync_read_while_allocating_with_matmuls_queued() -> None:
    _clean()
    a, b = _matrices()
    with cudamem.track("queue and allocate") as span:
        outs = [a @ b for _ in range(QUEUED)]
        extra = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    busy = _busy()
    assert busy, "the matmuls finished before the exit read: nothing was tested"
    assert _exit_read(span) == _settled()
    assert span.allocated_delta == QUEUED * 256 * MiB + 64 * MiB
    assert not span.record.synced
    del outs, extra


def test_no_sync_read_after_freeing_tensors_queued_kernels_use() -> None:
    _clean()
    a, b = _matrices()
    outs = [a @ b for _ in range(QUEUED)]
    with cudamem.track("free while queued") as span:
        del a, b  # the queued matmuls still read them
        outs.clear()  # and still write these
    busy = _busy()
    assert busy
    assert _exit_read(span) == _settled()
    assert span.allocated_delta == -(QUEUED + 2) * 256 * MiB
    assert span.reserved_delta == 0  # freed to the cache, not to CUDA


def _record_stream_free() -> tuple[cudamem.MemorySpan, torch.cuda.Stream, list[torch.Tensor]]:
    """A 256 MiB tensor used by 20 matmuls queued on a side stream, then freed."""
    (x,) = _matrices(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [x @ x for _ in range(QUEUED)]
    x.record_stream(side)
    with cudamem.track("record_stream free") as span:
        del x  # its block waits for the side stream's work before it can be reused
    return span, side, outs


def test_no_sync_read_after_record_stream_free() -> None:
    _clean()
    span, side, outs = _record_stream_free()
    assert _busy(side)
    assert _exit_read(span) == _settled()
    assert span.allocated_delta == -256 * MiB
    assert span.reserved_delta == 0
    del outs


def test_no_sync_read_of_a_new_allocation_after_a_record_stream_free() -> None:
    _clean()
    _, side, outs = _record_stream_free()
    with cudamem.track("allocate after") as span:
        y = torch.empty(N, N, device="cuda:0")  # the freed block's size, default stream
    assert _busy(side)
    assert _exit_read(span) == _settled()
    assert span.allocated_delta == 256 * MiB
    # The freed block still waits for the side stream: the allocator took a new segment
    # (under expandable segments: new pages, as much as the request needs beyond free ones).
    if not _backend.expandable_segments():
        assert span.reserved_delta == 256 * MiB
    del y, outs


def test_no_sync_read_after_empty_cache_with_kernels_queued() -> None:
    _clean()
    a, b = _matrices()
    outs = [a @ b for _ in range(QUEUED)]
    del outs[: QUEUED // 2]  # cached blocks whose kernels are still queued
    assert _busy()
    with cudamem.track("empty_cache") as span:
        _backend.get().empty_cache()
    assert _exit_read(span) == _settled()
    assert span.allocated_delta == 0
    if not _backend.expandable_segments():  # else whole free pages, not whole segments
        assert span.reserved_delta == -(QUEUED // 2) * 256 * MiB
    else:
        assert span.reserved_delta < 0
    del outs, a, b


def test_sync_true_puts_gpu_time_in_the_duration() -> None:
    """Each span is compared with the GPU time of its own kernels (events inside it): the
    groups run side by side, so two runs of the same kernels can take different times."""
    _clean()
    a, b = _matrices()

    def events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    start, end = events()
    with cudamem.track("no sync") as fast:
        start.record()
        outs = [a @ b for _ in range(QUEUED)]
        end.record()
    torch.cuda.synchronize()
    fast_gpu_s = start.elapsed_time(end) / 1e3
    outs.clear()
    start, end = events()
    with cudamem.track("sync", sync=True) as slow:
        start.record()
        outs = [a @ b for _ in range(QUEUED)]
        end.record()
    slow_gpu_s = start.elapsed_time(end) / 1e3
    assert slow.record.synced and not fast.record.synced
    # Without sync the span ends when the launches are queued, long before they ran ...
    assert fast.duration < fast_gpu_s / 2
    # ... with it, after they ran: the span opened before the first event and waited for all.
    assert slow.duration >= 0.98 * slow_gpu_s
    del outs


def test_counters_match_torch() -> None:
    _clean()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    backend = _backend.get()
    allocated, reserved, peak = backend.counters(0)
    assert allocated == torch.cuda.memory_allocated(0)
    assert reserved == torch.cuda.memory_reserved(0)
    assert peak == torch.cuda.max_memory_allocated(0)
    del x
    before = backend.counters_reset_peak(0)
    assert before[2] == peak  # the value read before the reset
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)


def test_oom_recorded() -> None:
    _clean()
    with pytest.raises(torch.OutOfMemoryError), cudamem.track("oom") as span:
        torch.empty(1024**4, dtype=torch.uint8, device="cuda:0")  # 1 TiB
    assert span.exception is not None and span.exception.is_oom


@pytest.mark.multigpu
def test_spans_on_device0_create_no_context_on_device1() -> None:
    code = textwrap.dedent(
        """
        import torch, cudamem
        x = torch.ones(1024, 1024, device="cuda:0")
        had1 = torch._C._cuda_hasPrimaryContext(1)
        with cudamem.track("d0") as s:
            y = torch.ones(1024, 1024, device="cuda:0")
        with cudamem.track("d0 named", device=0) as s2:
            z = x * 2
        print(cudamem.history())
        assert [d.device for d in s.devices] == [0], s.devices
        assert s.allocated_delta == 4 * 1024**2
        assert torch._C._cuda_hasPrimaryContext(0)
        assert torch._C._cuda_hasPrimaryContext(1) == had1, "cudamem created a context on cuda:1"
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


@pytest.mark.multigpu
def test_model_on_device1_only() -> None:
    code = textwrap.dedent(
        """
        import torch, cudamem
        w = torch.ones(16, device="cuda:1")
        had0 = torch._C._cuda_hasPrimaryContext(0)
        print("torch itself created a context on cuda:0:", had0)
        with cudamem.track("d1") as s:
            x = torch.ones(1024, 1024, device="cuda:1")
        assert [d.device for d in s.devices] == ([0, 1] if had0 else [1]), s.devices
        assert s.device(1).allocated_delta == 4 * 1024**2
        assert torch._C._cuda_hasPrimaryContext(0) == had0, "cudamem created a context on cuda:0"
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


def test_the_compiled_core_serves_a_gpu_span_itself(span_path: str) -> None:
    """Once CUDA runs on a one-GPU machine, the device is settled: a span opens and closes
    in C, with the bytes the allocator counts (no call of the Python open or close)."""
    if span_path != "compiled":
        pytest.skip("the compiled core's own case")
    _clean()
    keep = torch.empty(1, device="cuda:0")  # a context: with one GPU, the device settles
    # With more GPUs than contexts the devices are not settled: name the device.
    device = None if _backend.get().settled_devices is not None else 0
    with python_edges() as calls, cudamem.track("gpu", device=device) as span:
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:0")
    assert calls == []
    assert span.allocated_delta == 3 * MiB and span.peak_delta == 3 * MiB
    del x, keep
