"""A finished span's frozen result: ``SpanRecord`` with a ``DeviceSpan`` per device and the
``ExceptionInfo`` of the exception that left it, if any. Plain values: the span machinery
makes them (``RawSpan.record``), renderers draw them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..allocator.device_arg import DeviceLike, resolve_device
from ..allocator.stats import DeviceCounters, device_name
from ..base.present import Presented, PresentedHtml

__all__ = ["DeviceSpan", "ExceptionInfo", "SpanRecord"]


@dataclass(frozen=True, slots=True)
class DeviceSpan(Presented):
    """What one span did on one device. Bytes are ints."""

    json_properties: ClassVar[tuple[str, ...]] = ("allocated_delta", "reserved_delta", "peak_delta")

    device: int
    #: The counters at entry (zeros for a device that appeared during the span).
    before: DeviceCounters
    #: The counters at exit.
    after: DeviceCounters
    #: Highest ``allocated`` during the span, or ``None`` when the span ran with ``peak=False``.
    peak: int | None

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes at exit minus at entry."""
        return self.after.allocated - self.before.allocated

    @property
    def reserved_delta(self) -> int:
        """Reserved bytes at exit minus at entry."""
        return self.after.reserved - self.before.reserved

    @property
    def peak_delta(self) -> int | None:
        """Peak during the span minus allocated at entry."""
        return None if self.peak is None else self.peak - self.before.allocated


@dataclass(frozen=True, slots=True)
class ExceptionInfo(Presented):
    """An exception that left a span: its type and message, not the object.

    The exception itself is not kept: its traceback references the frames, and through them
    the tensors, that the user is trying to free.
    """

    type_name: str
    message: str
    is_oom: bool

    @classmethod
    def from_exception(cls, exc: BaseException, *, is_oom: bool) -> ExceptionInfo:
        """Describe ``exc`` without keeping it."""
        tp = type(exc)
        try:
            message = str(exc)
        except Exception:
            message = "<message unavailable>"
        return cls(f"{tp.__module__}.{tp.__qualname__}", message[:2000], is_oom)


@dataclass(frozen=True, slots=True)
class SpanRecord(PresentedHtml):
    """The frozen result of one finished span.

    ``allocated_delta``, ``reserved_delta``, ``peak`` and ``peak_delta`` sum over devices
    (``peak`` is then the sum of per-device peaks; see ``devices`` for each one). ``peak``
    and ``peak_delta`` are ``None`` for spans run with ``peak=False`` and for spans that
    measured no device (``unmeasured`` then says why; the byte deltas are then 0).
    """

    name: str
    devices: tuple[DeviceSpan, ...]
    #: Wall-clock seconds between entry and exit (cudamem's own reads excluded; with
    #: ``sync=True`` the wait for the block's GPU work is included).
    duration: float
    #: ``time.time()`` at entry.
    started_at: float
    exception: ExceptionInfo | None
    children: tuple[SpanRecord, ...]
    #: Name of the thread that closed the span.
    thread: str
    synced: bool
    peak_tracked: bool
    allocated_delta: int
    reserved_delta: int
    peak: int | None
    peak_delta: int | None
    dropped_children: int = 0
    #: Problems of cudamem's own bookkeeping (never raised into the user's code).
    notes: tuple[str, ...] = ()
    #: Why nothing was measured (``'no CUDA device'``, ``'no CUDA device in use'``), or
    #: ``None`` when ``devices`` were read.
    unmeasured: str | None = None

    @classmethod
    def build(
        cls,
        name: str,
        devices: tuple[DeviceSpan, ...],
        *,
        duration: float,
        started_at: float = 0.0,
        exception: ExceptionInfo | None = None,
        children: tuple[SpanRecord, ...] = (),
        thread: str = "MainThread",
        synced: bool = False,
        peak_tracked: bool = True,
        dropped_children: int = 0,
        notes: tuple[str, ...] = (),
        unmeasured: str | None = None,
    ) -> SpanRecord:
        """A record whose totals are computed from ``devices``."""
        alloc = res = peak = peakd = 0
        for d in devices:
            before = d.before.allocated
            alloc += d.after.allocated - before
            res += d.after.reserved - d.before.reserved
            if d.peak is not None:
                peak += d.peak
                peakd += d.peak - before
        has_peak = peak_tracked and bool(devices)
        return cls(
            name,
            devices,
            duration,
            started_at,
            exception,
            children,
            thread,
            synced,
            peak_tracked,
            alloc,
            res,
            peak if has_peak else None,
            peakd if has_peak else None,
            dropped_children,
            notes,
            unmeasured,
        )

    def device(self, device: DeviceLike) -> DeviceSpan:
        """The result for one device (``KeyError`` if the span did not see it)."""
        index = device if isinstance(device, int) else resolve_device(device)
        for d in self.devices:
            if d.device == index:
                return d
        seen = ", ".join(device_name(d.device) for d in self.devices) or "none"
        raise KeyError(f"span {self.name!r} saw no {device_name(index)} (devices: {seen})")
