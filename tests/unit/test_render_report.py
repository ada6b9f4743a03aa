"""The ``cudamem run`` report as text and as one HTML file, from hand-built results."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from cudamem.base.format import escape_html
from cudamem.render.html import render_html
from cudamem.render.report import render_report
from cudamem.run.runner import RunReport, Unlisted

from ..built import (
    T0,
    MiB,
    census,
    culprit,
    explanation,
    history,
    holder,
    holders,
    live_storage,
    oom_exception,
    oom_report,
    run_report,
    span,
    span_stats,
    utc,  # noqa: F401  (the fixture)
)

HOSTILE = "<script>alert('x')</script>&"


pytestmark = pytest.mark.usefixtures("utc")


def _full() -> RunReport:
    return run_report(
        argv=("--name", HOSTILE),
        exit_code=1,
        exception=oom_exception(),
        traceback=f"Traceback (most recent call last):\n  {HOSTILE}",
        peaks=((0, 512 * MiB), (1, 4 * MiB)),
        leak_warnings=("step retains +4.0 MiB per call", HOSTILE),
        leak_names=(HOSTILE,),
        live=census(live_storage(holders=holders(holder(f"__main__.d[{HOSTILE!r}]")))),
        ledger=explanation(),
        oom=oom_report(),
        history=history(
            span_stats(),
            spans=(span(HOSTILE), span(HOSTILE, started_at=T0 + 1)),
        ),
        groups=(
            culprit(f"__main__.d[{HOSTILE!r}]"),
            culprit(
                "__main__.x", tensors=1, storages=1, nbytes=4 * MiB, autograd_bytes=0, example=""
            ),
        ),
        unlisted=Unlisted(3, 3 * 1024),
        notes=("a note",),
    )


def test_minimal_report_text() -> None:
    r = run_report()
    assert render_report(r) == str(r)
    assert str(r).splitlines() == [
        "== cudamem run: train.py --lr 3",
        "exit code 0 after 2.50 s",
        "training steps seen (optimizer.step() calls): 10",
        "peak allocated: cuda:0 512.0 MiB",
        "",
        "leak warnings: none",
    ]
    cpu_only = str(run_report(peaks=())).splitlines()
    assert cpu_only[3] == "peak allocated: no CUDA device was used"
    # No CUDA device: growth detection measured nothing, which must not read as "none".
    assert cpu_only[5] == (
        "leak warnings: not measured: growth detection needs a CUDA device (this machine has none)"
    )


def test_full_report_text_has_every_part_in_order() -> None:
    r = _full()
    text = str(r)
    lines = text.splitlines()
    assert lines[:8] == [
        f"== cudamem run: train.py --name {HOSTILE}",
        "exit code 1 after 2.50 s, raised OutOfMemoryError (out of memory: CUDA out of memory. "
        "Tried to allocate 2.00 GiB.)",
        "training steps seen (optimizer.step() calls): 10; the 'training step' span runs from "
        "one call to the next: 0 spans",
        "peak allocated: cuda:0 512.0 MiB, cuda:1 4.0 MiB",
        "",
        "leak warnings (2):",
        "  step retains +4.0 MiB per call",
        f"  {HOSTILE}",
    ]
    groups = lines.index("storages still alive at exit, by holder (largest first):")
    assert lines[groups + 1].split() == [
        "held",
        "by",
        "storages",
        "bytes",
        "via",
        "autograd",
        "e.g.",
    ]
    assert lines[groups + 3].split()[:5] == [
        f"__main__.d[{HOSTILE!r}]",
        "10",
        "40.0",
        "MiB",
        "40.0",
    ]
    assert lines[groups + 4].split() == ["__main__.x", "1", "4.0", "MiB"]
    assert lines[groups + 5] == (
        "1 storage listed (cuda:0 4.0 MiB); 3 smaller storages (3.0 KiB) not listed"
    )
    order = [
        "=== cudamem OOM post-mortem",
        "storages still alive at exit, by holder (largest first):",
        "nothing to explain",
        "spans:",
        "note: a note",
    ]
    positions = [text.index(part) for part in order]
    assert positions == sorted(positions)


def test_steps_line_says_why_the_step_span_has_one_call_fewer() -> None:
    """The ``training step`` span runs from one optimizer.step() to the next: 12 steps make
    11 spans, and the report says so beside the count rather than leaving 12 against 11."""
    r = run_report(steps=12, history=history(span_stats("training step", calls=11)))
    line = str(r).splitlines()[2]
    assert line == (
        "training steps seen (optimizer.step() calls): 12; the 'training step' span runs "
        "from one call to the next: 11 spans"
    )
    assert f"<p>{escape_html(line)}</p>" in render_html(r)


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_html_escapes_every_user_string() -> None:
    page = render_html(_full())
    assert "<script" not in page
    # title, h1, warning, traceback, group, storage's holder, the chart's marks
    assert page.count("&lt;script&gt;") >= 7
    parser = _Collect()
    parser.feed(page)
    assert "script" not in parser.tags
    text = "".join(parser.text)
    # Unescaped, the page shows the user's strings as they were.
    assert f"cudamem run: train.py --name {HOSTILE}" in text
    assert f"{HOSTILE}: leak warning" in text  # the leak marks in the chart
    assert f"__main__.d[{HOSTILE!r}]" in text


def test_html_sections_and_status() -> None:
    page = render_html(_full())
    h2 = re.findall(r"<h2>(.*?)</h2>", page)
    assert h2 == [
        "Peak allocated",
        "Memory per span",
        "Leak warnings",
        "Out-of-memory post-mortem",
        "Uncaught exception",
        "Storages still alive at exit, by holder",
        "The largest storages",
        "Where the memory is (explain)",
        "Spans",
        "Notes",
    ]
    assert '<p class="bad">exit code 1 after 2.50 s' in page
    assert "<li>cuda:0: 512.0 MiB</li><li>cuda:1: 4.0 MiB</li>" in page
    assert page.count('fill="#d62728"') == 2  # both spans carry the warned name
    assert '<td class="num">4.0 MiB</td><td>cuda:0</td><td>float32</td><td>1024×1024</td>' in page
    assert "<p>1 storage listed; 3 smaller storages (3.0 KiB) not listed</p>" in page
    # Self-contained: nothing is fetched.
    assert not re.search(r"""(src|href)=["']?https?:""", page)


def test_html_of_a_clean_run() -> None:
    page = render_html(run_report())
    h2 = re.findall(r"<h2>(.*?)</h2>", page)
    assert h2 == ["Peak allocated", "Memory per span", "Leak warnings"]
    assert '<p class="ok">exit code 0 after 2.50 s</p>' in page
    assert (
        '<p class="empty">Nothing to plot: no span has finished yet (cudamem.track, or '
        "optimizer steps under cudamem run).</p>"
    ) in page
    assert "<h2>Leak warnings</h2><p>None.</p>" in page
    assert page.startswith('<!DOCTYPE html>\n<html lang="en">') and page.endswith("</html>\n")


def test_html_leak_names_argument_overrides_the_report() -> None:
    r = run_report(history=history(span_stats(), spans=(span("step"),)), leak_names=("step",))
    assert render_html(r).count('fill="#d62728"') == 1
    assert render_html(r, leak_names=()).count('fill="#d62728"') == 0
