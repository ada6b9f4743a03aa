"""``cudamem.plot`` and the SVG chart draw the same points from the history."""

from __future__ import annotations

import warnings

import pytest

import cudamem
from cudamem import _backend
from cudamem.render.series import points
from cudamem.render.svg import memory_chart

from .fakes import FakeAllocator

MiB = 1024**2


def _history() -> cudamem.History:
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
    matplotlib = pytest.importorskip("matplotlib")
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
