"""Spans on a real GPU (H200): seed 000's table, allocator rounding, nested peaks, contexts."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch

import cudamem
from cudamem import _backend
from cudamem.demo import seed000_lifecycle

pytestmark = pytest.mark.cuda
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
    assert (create.allocated_delta, create.reserved_delta) == (256 * MiB, 256 * MiB)
    assert create.peak_delta == 256 * MiB
    assert (delete.allocated_delta, delete.reserved_delta) == (0, 0)
    assert (clear.allocated_delta, clear.reserved_delta) == (-256 * MiB, 0)
    assert (empty.allocated_delta, empty.reserved_delta) == (0, -256 * MiB)


def test_4mib_tensor_reserves_20mib_segment() -> None:
    # A fresh process: earlier tests leave small segments with free room behind, and a 4 MiB
    # request would be carved from one of them instead of getting its own 20 MiB segment.
    code = textwrap.dedent(
        """
        import gc, torch, cudamem
        from cudamem import _backend
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
    assert outer.peak is not None and cudamem.max_allocated(0) >= outer.peak
    assert outer.children[0].name == "inner"


def test_sync_false_matches_sync_true_for_allocations() -> None:
    _clean()
    with cudamem.track("nosync", sync=False) as span:
        x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda:0")
    assert span.allocated_delta == 32 * MiB
    del x


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
