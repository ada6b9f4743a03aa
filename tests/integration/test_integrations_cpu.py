"""The integrations' CPU mode: a backend whose "allocated" is the bytes of live CPU storages."""

from __future__ import annotations

import torch

from cudamem.holders.census import live_storage_keys
from cudamem.integrations._cpu import CpuStorageBackend


def test_a_peak_reset_starts_from_what_is_allocated_now() -> None:
    backend = CpuStorageBackend()
    held = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB alive at the reset
    level = sum(live_storage_keys("cpu").values())
    backend.reset_peak(0)
    del held
    after = backend.read(0)  # the first read since the reset: 1 MiB less is alive
    assert after.allocated <= level - (1 << 20)
    assert after.peak_allocated >= level  # as CUDA's: the level at the reset is a peak
