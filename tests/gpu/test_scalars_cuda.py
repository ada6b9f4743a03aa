"""Scalar logging on a real GPU (H200): seed 000's loss table through spans, no per-step sync,
``to_host`` leaving nothing on the device, no stray CUDA context."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend

pytestmark = pytest.mark.cuda
MiB = 1024**2
KiB = 1024


def _clean() -> None:
    gc.collect()
    _backend.get().empty_cache()


def _seed_loss(x: torch.Tensor) -> torch.Tensor:
    # Seed 000: sigmoid(x * 2).mean() on a 1024×1024 fp32 input with requires_grad; the
    # graph saves sigmoid's 4 MiB result, and no backward() runs.
    return torch.sigmoid(x * 2).mean()


@pytest.fixture
def x() -> Iterator[torch.Tensor]:
    _clean()
    t = torch.randn(1024, 1024, device="cuda:0", requires_grad=True)
    yield t
    del t
    _clean()


def test_seed000_losses_appended_as_tensors_keep_40mib(x: torch.Tensor) -> None:
    history: list[torch.Tensor] = []
    with cudamem.track("append(loss)", device=0) as span:
        for _ in range(10):
            loss = _seed_loss(x)
            history.append(loss)
        del loss
        gc.collect()
    # 10 × 4 MiB of saved sigmoid results, plus ten 0-d losses (512 B blocks).
    assert 40 * MiB <= span.allocated_delta <= 40 * MiB + 64 * KiB, str(span)


def test_seed000_item_keeps_nothing(x: torch.Tensor) -> None:
    history: list[float] = []
    with cudamem.track("append(loss.item())", device=0) as span:
        for _ in range(10):
            history.append(_seed_loss(x).item())
        gc.collect()
    assert span.allocated_delta == 0, str(span)


def test_seed000_through_scalar_logger_keeps_nothing(x: torch.Tensor) -> None:
    with cudamem.track("ScalarLogger", device=0) as span:
        log = cudamem.ScalarLogger()  # its 1 KiB device buffer is allocated in the span
        for _ in range(10):
            log.append(_seed_loss(x))
        gc.collect()
    assert abs(span.allocated_delta) <= 1 * KiB, str(span)
    with cudamem.track("close", device=0) as closing:
        log.close()
        gc.collect()
    assert span.allocated_delta + closing.allocated_delta == 0
    assert len(log) == 10
    expected = _seed_loss(x).item()
    assert log.last == pytest.approx(expected)


def test_scalar_logger_many_steps_stays_flat(x: torch.Tensor) -> None:
    log = cudamem.ScalarLogger(flush_every=64, name="loss")
    log.append(_seed_loss(x))  # allocate the buffer first
    with cudamem.track("1000 steps", device=0) as span:
        for step in range(1000):
            loss = _seed_loss(x)
            log.append(loss)
            log.log("half", loss / 2, step=step)
        del loss
        gc.collect()
    assert span.allocated_delta == 0, str(span)
    assert len(log) == 1001
    assert log["half"].values[0] == pytest.approx(log[1] / 2)
    assert log.stats.transfers <= 2001 // 64 + 3  # batches, not one transfer per value


def test_scalar_logger_does_not_sync_per_step(x: torch.Tensor) -> None:
    # CUDA's sync debug mode raises on any synchronizing call (.item(), .cpu(), synchronize);
    # waiting on an event recorded 64 values earlier does not count as one.
    log = cudamem.ScalarLogger(flush_every=16)
    log.append(_seed_loss(x))  # buffer and pinned memory are made outside the check
    log.flush()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(200):
            with torch.no_grad():
                log.append(_seed_loss(x))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    with pytest.raises(RuntimeError):
        torch.cuda.set_sync_debug_mode("error")
        try:
            _seed_loss(x).item()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    assert len(log) == 201


def test_scalar_logger_values_match_item(x: torch.Tensor) -> None:
    log = cudamem.ScalarLogger(flush_every=7)
    expected = []
    for i in range(50):
        loss = _seed_loss(x) + i
        log.append(loss)
        log.append(loss.to(torch.bfloat16))
        expected.extend([loss.item(), loss.to(torch.bfloat16).item()])
    assert list(log) == expected  # float64 buffer: exact for fp32 and bf16


def test_log_scalar_on_gpu(x: torch.Tensor) -> None:
    loss = _seed_loss(x)
    assert cudamem.log_scalar(loss) == loss.item()
    assert cudamem.log_scalar(x[3, 4]) == x[3, 4].item()
    with pytest.raises(ValueError, match=r"\(1024, 1024\)"):
        cudamem.log_scalar(x)


def test_to_host_leaves_nothing_on_the_gpu(x: torch.Tensor) -> None:
    outputs: list[torch.Tensor] = []
    with cudamem.track("to_host", device=0) as span:
        for _ in range(10):
            outputs.append(cudamem.to_host(torch.sigmoid(x * 2)))
        gc.collect()
    assert span.allocated_delta == 0, str(span)
    assert all(o.device.type == "cpu" and o.grad_fn is None for o in outputs)
    assert not outputs[0].is_pinned()

    detached: list[torch.Tensor] = []
    with cudamem.track("detach", device=0) as kept:
        for _ in range(10):
            detached.append(torch.sigmoid(x * 2).detach())
    assert kept.allocated_delta == 40 * MiB, str(kept)


def test_to_host_non_blocking(x: torch.Tensor) -> None:
    with cudamem.track("to_host non_blocking", device=0) as span:
        handle = cudamem.to_host({"out": torch.sigmoid(x * 2), "n": 3}, non_blocking=True)
        gc.collect()
    assert span.allocated_delta == 0, str(span)
    result = handle.wait()
    assert handle.done()
    assert result["n"] == 3
    assert result["out"].is_pinned()
    torch.testing.assert_close(result["out"], torch.sigmoid(x * 2).detach().cpu())
    pinned = cudamem.to_host(x, pin=True)
    assert pinned.is_pinned() and pinned.grad_fn is None


@pytest.mark.multigpu
def test_logging_on_cuda1_creates_no_context_on_cuda0() -> None:
    code = textwrap.dedent(
        """
        import torch, cudamem
        log = cudamem.ScalarLogger(flush_every=4)
        x = torch.randn(16, device="cuda:1", requires_grad=True)
        for _ in range(10):
            log.append((x * 2).sum())
        assert len(log) == 10
        out = cudamem.to_host(x * 2, non_blocking=True).wait()
        assert out.is_pinned()
        print("ctx0", torch._C._cuda_hasPrimaryContext(0))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "ctx0 False" in done.stdout, done.stdout
