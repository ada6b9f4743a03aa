"""``cudamem.plot`` and the SVG chart draw the same points from the history."""

from __future__ import annotations

import re
import warnings

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.render.series import nothing_to_plot, points
from cudamem.render.svg import memory_chart
from cudamem.spans.history import History

from ... import extras
from ...fakes import FakeAllocator

MiB = 1024**2


def _history() -> History:
    fake = FakeAllocator()
    with _backend.use(fake), warnings.catch_warnings():
        warnings.simplefilter("ignore", cudamem.LeakWarning)  # this history does grow
        for _ in range(5):
            with cudamem.track("step"):
                fake.alloc(4 * MiB)
        with cudamem.track("<b>val</b>"):
            fake.alloc(1 * MiB)
            fake.free(1 * MiB)
    return cudamem.history()


def test_points_follow_levels_and_mark_leaks() -> None:
    pts = points(_history().spans, ["step"])
    assert [p.allocated for p in pts] == [4 * MiB, 8 * MiB, 12 * MiB, 16 * MiB, 20 * MiB, 20 * MiB]
    assert [p.leak for p in pts] == [True] * 5 + [False]
    assert pts[0].t <= pts[-1].t


def test_svg_escapes_names_and_draws_three_series() -> None:
    svg = memory_chart(points(_history().spans, ["<b>val</b>"]))
    assert svg.count("<polyline") == 3
    assert "<b>" not in svg and "&lt;b&gt;val&lt;/b&gt;: leak warning" in svg
    assert memory_chart([]).startswith("<p")


def test_plot_draws_with_matplotlib() -> None:
    matplotlib = extras.need("matplotlib")
    matplotlib.use("Agg")
    hist = _history()

    class Warn:
        class growth:  # mimics LeakWarning.growth
            name = "step"

    ax = cudamem.plot(hist, leaks=[Warn()])
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["allocated", "reserved", "peak"]
    assert ax.get_lines()[0].get_ydata()[-1] == 20.0  # MiB
    assert len(ax.collections) == 1  # the leak markers
    assert ax.collections[0].get_offsets().shape == (5, 2)


def _cpu_history() -> History:
    """Spans on a machine without a CUDA device: they finish, but measure no device."""
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        for _ in range(3):
            with cudamem.track("step"):
                pass
    return cudamem.history()


def test_spans_without_a_device_are_not_drawn_at_zero() -> None:
    hist = _cpu_history()
    assert len(hist.spans) == 3 and all(not r.devices for r in hist.spans)
    assert points(hist.spans) == []
    reason = nothing_to_plot(hist.spans)
    assert reason == (
        "3 spans finished, but none measured CUDA memory: spans measure the CUDA allocator, "
        "and no CUDA device was in use"
    )
    assert nothing_to_plot(()) is not None and "no span has finished" in str(nothing_to_plot(()))
    assert nothing_to_plot(_history().spans) is None


def test_svg_without_points_says_why_instead_of_an_empty_chart() -> None:
    hist = _cpu_history()
    html = memory_chart(points(hist.spans), empty=nothing_to_plot(hist.spans))
    assert "<svg" not in html and "0 B" not in html
    assert html == (
        '<p class="empty">Nothing to plot: 3 spans finished, but none measured CUDA memory: '
        "spans measure the CUDA allocator, and no CUDA device was in use.</p>"
    )


def test_svg_never_repeats_an_axis_label() -> None:
    fake = FakeAllocator()
    with _backend.use(fake):
        for _ in range(2):
            with cudamem.track("flat"):
                pass
    svg = memory_chart(points(cudamem.history().spans))
    labels = re.findall(r'text-anchor="end">([^<]*)</text>', svg)
    assert labels == sorted(set(labels), key=labels.index)  # no duplicates
    assert labels == ["0 B", "1 B"]


def test_plot_without_points_says_nothing_to_plot() -> None:
    matplotlib = extras.need("matplotlib")
    matplotlib.use("Agg")
    ax = cudamem.plot(_cpu_history())
    assert ax.get_lines() == [] and len(ax.collections) == 0
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 1 and texts[0].startswith("Nothing to plot:\n3 spans finished")
    assert not ax.axison
    cudamem.clear_history()
    empty = cudamem.plot()
    assert "no span has finished" in empty.texts[0].get_text()
