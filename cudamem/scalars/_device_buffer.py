"""The device side of ``ScalarLogger``: values copied into a preallocated device buffer, and every
``flush_every`` values the buffer goes to pinned host memory with one non-blocking copy and an
event, so the GPU's queue never drains because of logging.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..allocator import backend as _backend
from .series import _Record


def _wants_async(device: torch.device) -> bool:
    """CUDA buffers go to pinned memory with a non-blocking copy and an event; other devices
    (CPU, MPS, XPU) are read with a plain copy when a batch completes."""
    return device.type == "cuda"


class _DeviceBuffer:
    """Two banks of ``capacity`` float64 slots on one device, used in turn.

    Logging copies into the next slot of the active bank. When it is full (or on flush) the
    bank is *launched*: on CUDA a non-blocking copy into pinned memory plus an event; the
    other bank becomes active. A launched bank *completes* (its floats are read) before it is
    written again, at the next launch or on read; by then its event has usually passed, so
    waiting for it costs nothing and never drains the GPU's queue.
    """

    __slots__ = (
        "active",
        "banks",
        "capacity",
        "device",
        "device_index",
        "events",
        "hosts",
        "in_flight",
        "is_async",
        "records",
        "slots",
        "used",
    )

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.device_index = device.index if device.index is not None else -1
        self.is_async = _wants_async(device)
        # MPS has no float64; float32 holds every fp16/bf16/fp32 value exactly.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        # Allocate outside inference mode: an inference tensor cannot be written to later.
        with torch.inference_mode(False), torch.no_grad():
            store = torch.zeros(2, capacity, dtype=dtype, device=device)
            self.banks = (store[0], store[1])
            # 0-d views made once: a log is then one copy_, without creating a view per step.
            self.slots = (tuple(store[0].unbind(0)), tuple(store[1].unbind(0)))
            # The CUDA caching host allocator picks a device that already has a context,
            # so pinning here creates none.
            pin = device.type == "cuda"
            self.hosts: tuple[torch.Tensor, ...] = ()
            if self.is_async:
                self.hosts = tuple(
                    torch.empty(capacity, dtype=dtype, pin_memory=pin) for _ in range(2)
                )
        self.events: list[Any] = [None, None]
        self.active = 0
        self.used = 0
        self.records: list[list[_Record]] = [[], []]
        self.in_flight: tuple[int, int] | None = None  # (bank, n)

    @property
    def nbytes(self) -> int:
        return 2 * self.capacity * self.banks[0].element_size()

    def write(self, value: torch.Tensor, record: _Record) -> bool:
        """Copy ``value`` (detached, 0-d) into the next slot; True when the bank is full."""
        used, active = self.used, self.active
        self.slots[active][used].copy_(value)
        self.records[active].append(record)
        self.used = used = used + 1
        return used >= self.capacity

    def launch(self) -> bool:
        """Start moving the active bank to the host; True if a transfer was started."""
        if self.used == 0:
            return False
        self.complete()  # frees the other bank before it becomes active
        bank, n = self.active, self.used
        if self.is_async:
            with torch.no_grad():
                self.hosts[bank][:n].copy_(self.banks[bank][:n], non_blocking=True)
            self.events[bank] = _backend.get().record_event(self.device_index, self.events[bank])
        self.in_flight = (bank, n)
        self.active, self.used = 1 - bank, 0
        return True

    def complete(self) -> None:
        """Read the launched bank's floats into its records (waits for its event if needed)."""
        if self.in_flight is None:
            return
        bank, n = self.in_flight
        if self.is_async:
            _backend.get().wait_event(self.events[bank])
            values = self.hosts[bank][:n].tolist()
        else:
            values = self.banks[bank][:n].tolist()
        records = self.records[bank]
        for record, value in zip(records, values, strict=True):
            record.value = float(value)
            record.ready = True
        self.records[bank] = []
        self.in_flight = None

    def abandon(self) -> None:
        """After a failed copy: resolve every record of this buffer as NaN so that values
        logged after them still reach the host in order."""
        for records in self.records:
            for record in records:
                record.value = math.nan
                record.ready = True
        self.records = [[], []]
        self.in_flight = None
        self.used = 0
