"""A fake allocator at the ``_backend`` seam, for span logic without a GPU.

It models what spans rely on: per-device allocated/reserved counters, a peak counter that
``reset_peak`` sets back to the current allocated value, contexts that appear when a device is
first used, and call counts (to assert that nothing syncs or resets what it should not).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any, TypeVar

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.backend_base import Backend
from cudamem.allocator.stats import AllocatorStats
from cudamem.growth.settings import LeakWarning

_B = TypeVar("_B", bound=Backend)


class FakeAllocator(Backend):
    #: The torch device type whose storages the census looks for (``storage_device_type``):
    #: ``"cpu"`` where real CPU tensors stand for the fake GPU's.
    storages = "cuda"

    def __init__(self, devices: int = 1, contexts: tuple[int, ...] = (0,)) -> None:
        self.count = devices
        self.contexts = set(contexts)
        self.allocated = dict.fromkeys(range(devices), 0)
        self.reserved = dict.fromkeys(range(devices), 0)
        self.peak = dict.fromkeys(range(devices), 0)
        self.calls: Counter[str] = Counter()
        self.synced: list[int] = []
        self.lock = threading.Lock()
        self.clock = 0

    # -- what tests do to the "GPU" ------------------------------------------------------
    def alloc(self, nbytes: int, device: int = 0) -> None:
        with self.lock:
            self.contexts.add(device)
            self.allocated[device] += nbytes
            if self.allocated[device] > self.reserved[device]:
                self.reserved[device] = self.allocated[device]
            self.peak[device] = max(self.peak[device], self.allocated[device])

    def free(self, nbytes: int, device: int = 0) -> None:
        with self.lock:
            self.allocated[device] -= nbytes

    def empty_cache(self) -> None:
        # As torch.cuda.empty_cache(): every device's cache goes, not only the current one's.
        with self.lock:
            self.calls["empty_cache"] += 1
            for device in self.reserved:
                self.reserved[device] = self.allocated[device]

    # -- Backend -----------------------------------------------------------------------
    def storage_device_type(self) -> str:
        return self.storages

    def device_count(self) -> int:
        return self.count

    def initialized_devices(self) -> tuple[int, ...]:
        return tuple(sorted(self.contexts))

    @property  # type: ignore[override]
    def settled_devices(self) -> tuple[int, ...] | None:
        """As ``TorchBackend``'s: once every device has a context, the same tuple each time
        (spans then read the devices without asking, and the compiled span core serves);
        what a test sets stays."""
        if "_settled_set" in self.__dict__:
            return self.__dict__["_settled_set"]  # type: ignore[no-any-return]
        if len(self.contexts) < self.count:
            return None
        return self.__dict__.setdefault("_settled", tuple(sorted(self.contexts)))  # type: ignore[no-any-return]

    @settled_devices.setter
    def settled_devices(self, devices: tuple[int, ...] | None) -> None:
        self.__dict__["_settled_set"] = devices

    def has_context(self, device: int) -> bool:
        return device in self.contexts

    def current_device(self) -> int:
        return 0

    def read(self, device: int) -> AllocatorStats:
        with self.lock:
            self.calls["read"] += 1
            self.clock += 1
            if device not in self.contexts:
                return AllocatorStats.zero(device, self.clock)
            return AllocatorStats(
                device=device,
                allocated=self.allocated[device],
                reserved=self.reserved[device],
                active=self.allocated[device],
                requested=self.allocated[device],
                peak_allocated=self.peak[device],
                peak_reserved=self.reserved[device],
                inactive_split=0,
                alloc_count=0,
                free_count=0,
                segments=0,
                alloc_retries=0,
                ooms=0,
                timestamp_ns=self.clock,
            )

    def synchronize(self, device: int) -> None:
        with self.lock:
            self.calls["synchronize"] += 1
            self.synced.append(device)
            self.contexts.add(device)

    def reset_peak(self, device: int) -> None:
        with self.lock:
            self.calls["reset_peak"] += 1
            self.peak[device] = self.allocated[device]


class CpuStorageBackend(FakeAllocator):
    """A stand-in GPU whose counters are this process's live CPU tensors, as the census sees
    them: ``allocated`` is the bytes of every CPU storage alive at the read, so spans, growth
    detection and culprits follow real tensors on a machine without a GPU.

    Each read is a census (a heap walk): fine for a handful of spans, not for a hot loop.
    """

    storages = "cpu"

    def __init__(self) -> None:
        super().__init__(devices=1, contexts=(0,))

    def read(self, device: int) -> AllocatorStats:
        from cudamem.holders.census import live_storage_keys

        total = sum(live_storage_keys("cpu").values())
        with self.lock:
            self.allocated[device] = total
            self.reserved[device] = max(self.reserved[device], total)
            self.peak[device] = max(self.peak[device], total)
        return super().read(device)


@contextlib.contextmanager
def leak_detection(backend: _B, *lists: list[Any]) -> Iterator[_B]:
    """``backend`` in use with the default leak settings; ``lists`` (a test module's loss
    history, outputs, ...) emptied before and after."""
    cudamem.configure_leaks()
    for items in lists:
        items.clear()
    gc.collect()
    try:
        with _backend.use(backend):
            yield backend
    finally:
        cudamem.configure_leaks()
        for items in lists:
            items.clear()


def leak_warnings(record: list[warnings.WarningMessage]) -> list[LeakWarning]:
    """The ``LeakWarning``s among caught warnings."""
    return [w.message for w in record if isinstance(w.message, LeakWarning)]
