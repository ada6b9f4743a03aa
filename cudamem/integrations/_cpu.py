"""The CPU as the allocator: a backend whose counters are the bytes of live CPU storages.

PyTorch keeps no allocation counters for the CPU. The integrations' CPU mode (for CPU-only
runs and for testing them in CI) swaps this backend in at the ``_backend`` seam, so spans,
growth detection and culprit naming run unchanged on CPU tensors: "allocated" is the sum of
``untyped_storage().nbytes()`` over every live CPU storage, counted by the census.

What it cannot measure it does not pretend to: there is no CPU cache, so ``reserved`` equals
``allocated``, and no peak counter, so ``peak_allocated`` is the highest value cudamem itself
read. The callbacks therefore log neither reserved nor peak in CPU mode. Each read is one
census pass (a heap scan plus an autograd walk): for small runs and tests, not for every step
of a large CPU job.
"""

from __future__ import annotations

import time

from ..allocator.backend_base import Backend, Counters
from ..allocator.stats import AllocatorStats
from ..holders.census import live_storage_keys

__all__ = ["CpuStorageBackend"]


def _live_cpu_bytes() -> int:
    return sum(live_storage_keys("cpu").values())


class CpuStorageBackend(Backend):
    """Device 0 is the CPU; its ``allocated`` is the bytes of live CPU storages."""

    def __init__(self) -> None:
        self._peak = 0

    def device_count(self) -> int:
        return 1

    def initialized_devices(self) -> tuple[int, ...]:
        return (0,)

    def has_context(self, device: int) -> bool:
        return device == 0

    def read(self, device: int) -> AllocatorStats:
        now = time.perf_counter_ns()
        if device != 0:
            return AllocatorStats.zero(device, now)
        total, _, peak = self.counters(0)
        return AllocatorStats(0, total, total, total, total, peak, peak, 0, 0, 0, 0, 0, 0, now)

    def counters(self, device: int) -> Counters:
        """One census: ``(allocated, allocated, the highest allocated read so far)``."""
        if device != 0:
            return (0, 0, 0)
        total = _live_cpu_bytes()
        if total > self._peak:
            self._peak = total
        return (total, total, self._peak)

    def counters_reset_peak(self, device: int) -> Counters:
        """``counters`` and ``reset_peak`` from one census (each census is a heap scan)."""
        values = self.counters(device)
        if device == 0:
            self._peak = values[0]
        return values

    def synchronize(self, device: int) -> None:
        """CPU work is synchronous: nothing to wait for."""

    def reset_peak(self, device: int) -> None:
        """As CUDA's: the peak starts again from what is allocated now, never below it."""
        self._peak = _live_cpu_bytes()

    def storage_device_type(self) -> str:
        return "cpu"
