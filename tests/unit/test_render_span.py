"""Spans and the span history rendered from hand-built results."""

from __future__ import annotations

from cudamem.render.history import render_history

from ..built import MiB, device_span, history, oom_exception, span, span_stats


def test_device_span_text() -> None:
    assert str(device_span()) == (
        "allocated +256.0 MiB, reserved +512.0 MiB, peak 612.0 MiB (+512.0 MiB) on cuda:0"
    )


def test_device_span_freed_memory_is_signed() -> None:
    d = device_span(device=1, before=(8 * MiB, 20 * MiB), after=(0, 20 * MiB), peak=None)
    assert str(d) == "allocated -8.0 MiB, reserved +0 B on cuda:1"


def test_span_text_sums_devices_and_names_the_exception() -> None:
    assert str(span()) == (
        "step: allocated +256.0 MiB, reserved +512.0 MiB, peak 612.0 MiB (+512.0 MiB) on cuda:0, "
        "3.2 ms"
    )
    raised = span("train", exception=oom_exception(), duration=2.5)
    # Only the message's first line: a multi-line OOM message stays one line here.
    assert str(raised).endswith(
        ", 2.50 s, raised OutOfMemoryError (out of memory: CUDA out of memory. "
        "Tried to allocate 2.00 GiB.)"
    )
    assert str(raised).startswith("train: allocated +256.0 MiB")


def test_span_on_two_devices_and_on_none() -> None:
    two = span(devices=(device_span(), device_span(1, (0, 0), (MiB, 2 * MiB), peak=None)))
    assert str(two) == (
        "step: allocated +256.0 MiB, reserved +512.0 MiB, peak 612.0 MiB (+512.0 MiB) on cuda:0; "
        "allocated +1.0 MiB, reserved +2.0 MiB on cuda:1, 3.2 ms"
    )
    assert str(span(devices=(), unmeasured="no CUDA device in use")) == (
        "step: n/a (no CUDA device in use), 3.2 ms"
    )
    assert str(span(devices=())) == "step: n/a (no data), 3.2 ms"


def test_history_table() -> None:
    no_peak = dict(mean_peak=None, max_peak=None, mean_peak_delta=None, max_peak_delta=None)
    h = history(
        span_stats(),
        span_stats("eval", calls=3, errors=1, max_allocated_delta=-2 * MiB, **no_peak),
        dropped=5,
    )
    assert render_history(h) == str(h)
    assert str(h).splitlines() == [
        "span  calls  alloc Δ mean  alloc Δ max  reserved Δ mean   peak max  peak Δ max  time mean"
        "  errors",
        "----  -----  ------------  -----------  ---------------  ---------  ----------  ---------"
        "  ------",
        "step     10      +4.0 MiB     +8.0 MiB         +2.0 MiB  512.0 MiB  +256.0 MiB     1.5 ms"
        "       0",
        "eval      3      +4.0 MiB     -2.0 MiB         +2.0 MiB        n/a         n/a     1.5 ms"
        "       1",
        "(5 older spans left the ring; aggregates count them)",
    ]


def test_empty_history() -> None:
    assert str(history()) == "no finished spans"


def test_history_of_calls_that_measured_no_device() -> None:
    # CPU only: the byte figures say nothing, so they read n/a, never +0 B.
    row = str(history(span_stats("cpu", measured=0))).splitlines()[2]
    assert row.split()[:5] == ["cpu", "10", "n/a", "n/a", "n/a"]
