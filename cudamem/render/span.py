"""Text rendering of spans and of the allocator counters they read."""

from __future__ import annotations

from ..allocator.stats import AllocatorStats, device_name
from ..base.format import format_bytes, format_duration
from ..base.present import renders
from ..spans.record import DeviceSpan, ExceptionInfo, SpanRecord

__all__ = [
    "render_allocator_stats",
    "render_device_span",
    "render_exception",
    "render_span_record",
]


@renders(AllocatorStats)
def render_allocator_stats(stats: AllocatorStats) -> str:
    """``cuda:0: allocated 1.0 MiB, reserved 2.0 MiB, peak 1.5 MiB``."""
    return (
        f"{device_name(stats.device)}: allocated {format_bytes(stats.allocated)}, "
        f"reserved {format_bytes(stats.reserved)}, "
        f"peak {format_bytes(stats.peak_allocated)}"
    )


@renders(DeviceSpan)
def render_device_span(d: DeviceSpan) -> str:
    """``allocated +1.0 MiB, reserved +2.0 MiB, peak 3.0 MiB (+1.5 MiB) on cuda:0``."""
    text = (
        f"allocated {format_bytes(d.allocated_delta, signed=True)}, "
        f"reserved {format_bytes(d.reserved_delta, signed=True)}"
    )
    if d.peak is not None:
        text += f", peak {format_bytes(d.peak)} ({format_bytes(d.peak_delta, signed=True)})"
    return f"{text} on {device_name(d.device)}"


@renders(ExceptionInfo)
def render_exception(e: ExceptionInfo) -> str:
    """``OutOfMemoryError (out of memory: CUDA out of memory. ...)``: the short type name
    and the message's first line (120 characters at most)."""
    kind = "out of memory: " if e.is_oom else ""
    short = e.type_name.rsplit(".", 1)[-1]
    first = e.message.splitlines()[0] if e.message else ""
    return f"{short} ({kind}{first[:120]})" if first or kind else short


@renders(SpanRecord)
def render_span_record(record: SpanRecord) -> str:
    """``step: <each device>, 1.2 ms``, then the exception that left the span."""
    body = "; ".join(render_device_span(d) for d in record.devices) or (
        f"n/a ({record.unmeasured or 'no data'})"
    )
    text = f"{record.name}: {body}, {format_duration(record.duration)}"
    if record.exception is not None:
        text += f", raised {render_exception(record.exception)}"
    return text
