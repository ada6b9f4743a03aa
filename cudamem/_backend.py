"""The seam to PyTorch's CUDA caching allocator.

This is the only module in cudamem that calls ``torch.cuda`` memory APIs. It reads the
allocator's raw counters (``torch._C._cuda_memoryStats``, ~11 µs a device) rather than the
public accessors (``torch.cuda.memory_allocated()`` flattens the whole stats dict, ~81 µs),
and it never creates a CUDA context as a side effect: only devices that already have a primary
context are read or synchronized, unless the caller names a device explicitly.

Tests swap the active backend with :func:`use` to drive span logic through a fake allocator.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from .stats import AllocatorStats

__all__ = [
    "Backend",
    "TorchBackend",
    "get",
    "use",
]


def _raw_get(raw: dict[str, Any], key: str, metric: str = "current") -> int:
    """Read ``raw[key]['all'][metric]`` from the nested stats dict, 0 when absent."""
    entry = raw.get(key)
    if not isinstance(entry, dict):
        return 0
    pool = entry.get("all")
    if not isinstance(pool, dict):
        return 0
    value = pool.get(metric, 0)
    return int(value) if isinstance(value, int) else 0


def stats_from_raw(device: int, raw: dict[str, Any], timestamp_ns: int) -> AllocatorStats:
    """Build :class:`AllocatorStats` from the nested dict of ``_cuda_memoryStats``."""
    retries = raw.get("num_alloc_retries", 0)
    ooms = raw.get("num_ooms", 0)
    return AllocatorStats(
        device=device,
        allocated=_raw_get(raw, "allocated_bytes"),
        reserved=_raw_get(raw, "reserved_bytes"),
        active=_raw_get(raw, "active_bytes"),
        requested=_raw_get(raw, "requested_bytes"),
        peak_allocated=_raw_get(raw, "allocated_bytes", "peak"),
        peak_reserved=_raw_get(raw, "reserved_bytes", "peak"),
        inactive_split=_raw_get(raw, "inactive_split_bytes"),
        alloc_count=_raw_get(raw, "allocation", "allocated"),
        free_count=_raw_get(raw, "allocation", "freed"),
        segments=_raw_get(raw, "segment"),
        alloc_retries=int(retries) if isinstance(retries, int) else 0,
        ooms=int(ooms) if isinstance(ooms, int) else 0,
        timestamp_ns=timestamp_ns,
    )


class Backend:
    """What cudamem needs from the allocator. :class:`TorchBackend` is the real one."""

    def device_count(self) -> int:
        """Number of CUDA devices visible to torch (0 without CUDA)."""
        raise NotImplementedError

    def initialized_devices(self) -> tuple[int, ...]:
        """Indices of devices that already have a CUDA primary context."""
        raise NotImplementedError

    def has_context(self, device: int) -> bool:
        """Whether ``device`` already has a primary context."""
        raise NotImplementedError

    def current_device(self) -> int:
        """The current device if CUDA is initialised, else 0 (never initialises CUDA)."""
        return 0

    def read(self, device: int) -> AllocatorStats:
        """The allocator's counters for ``device`` (zeros when CUDA is not initialised)."""
        raise NotImplementedError

    def synchronize(self, device: int) -> None:
        """Wait for all streams of ``device``."""
        raise NotImplementedError

    def reset_peak(self, device: int) -> None:
        """Reset the process-wide peak counters of ``device``."""
        raise NotImplementedError

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a CUDA out-of-memory error."""
        return _is_oom_exception(exc)


def _is_oom_exception(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    if isinstance(oom_type, type) and isinstance(exc, oom_type):
        return True
    # Older releases raised a plain RuntimeError with this text.
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


class TorchBackend(Backend):
    """The real allocator, through ``torch._C``'s raw entry points."""

    def __init__(self) -> None:
        self._c = torch._C
        self._compiled = bool(getattr(self._c, "_cuda_getDeviceCount", None))
        self._count: int | None = None

    def device_count(self) -> int:
        if not self._compiled:
            return 0
        if self._count is None:
            try:
                self._count = int(torch.cuda.device_count())
            except Exception:  # a broken driver reads as "no devices"
                self._count = 0
        return self._count

    def _initialized(self) -> bool:
        try:
            return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
        except Exception:
            return False

    def has_context(self, device: int) -> bool:
        if not self._compiled or not self._initialized():
            return False
        probe = getattr(self._c, "_cuda_hasPrimaryContext", None)
        if probe is None:
            return device == torch.cuda.current_device()
        try:
            return bool(probe(device))
        except Exception:
            return False

    def current_device(self) -> int:
        if not self._compiled or not self._initialized():
            return 0
        return int(torch.cuda.current_device())

    def initialized_devices(self) -> tuple[int, ...]:
        if not self._compiled or not self._initialized():
            return ()
        return tuple(i for i in range(self.device_count()) if self.has_context(i))

    def read(self, device: int) -> AllocatorStats:
        now = time.perf_counter_ns()
        if not self._compiled or not self._initialized():
            return AllocatorStats.zero(device, now)
        raw = self._c._cuda_memoryStats(device)
        return stats_from_raw(device, raw, now)

    def synchronize(self, device: int) -> None:
        if self._compiled and self._initialized():
            # torch.cuda.device() restores the previous device only if it has a context
            # (MaybeExchangeDevice), so this creates no context on the current device.
            torch.cuda.synchronize(device)

    def reset_peak(self, device: int) -> None:
        if self._compiled and self._initialized():
            self._c._cuda_resetPeakMemoryStats(device)


_lock = threading.Lock()
_active: Backend = TorchBackend()


def get() -> Backend:
    """The backend in use."""
    return _active


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
    """Swap the backend for the duration of the block (tests use a fake allocator)."""
    global _active
    with _lock:
        previous = _active
        _active = backend
    try:
        yield backend
    finally:
        with _lock:
            _active = previous
