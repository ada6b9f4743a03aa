"""One self-contained HTML file for a ``cudamem run`` report.

No external resources (no scripts, fonts or stylesheets fetched), and every string that came
from the user's program (script name, argv, span names, holder paths, exception messages) is
escaped with ``html.escape`` before it reaches the page, after invisible and bidi characters
(U+202E, zero-width spaces, controls, lone surrogates of a non-UTF-8 file name) are written
as ``\u202e``-style escapes, so that no name can pose as another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..base.format import escape_html, format_bytes, format_duration, plural
from ..holders.culprits import direct_first
from .modules import render_profile_html
from .report import command_line, leak_line, steps_line, unmeasured
from .series import nothing_to_plot, points
from .svg import memory_chart

if TYPE_CHECKING:
    from ..run.runner import RunReport

__all__ = ["render_html"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; max-width: 70rem; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
table { border-collapse: collapse; font-size: 0.9rem; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f8fa; padding: 0.8rem; overflow-x: auto; font-size: 0.85rem; }
.bad { color: #b00020; } .ok { color: #1b7f3b; }
"""


_e = escape_html


def _pre(text: str) -> str:
    return f"<pre>{escape_html(text, keep=chr(10))}</pre>"


def _groups_table(report: RunReport) -> str:
    rows = []
    for g in report.groups:
        example = g.example if g.example != g.holder else ""
        via = _e(format_bytes(g.autograd_bytes)) if g.autograd_bytes else ""
        rows.append(
            f'<tr><td>{_e(g.holder)}</td><td class="num">{g.storages}</td>'
            f'<td class="num">{_e(format_bytes(g.nbytes))}</td><td class="num">{via}</td>'
            f"<td>{_e(example)}</td></tr>"
        )
    head = (
        "<tr><th>held by</th><th>storages</th><th>bytes</th><th>via autograd</th><th>e.g.</th></tr>"
    )
    table = f"<table>{head}{''.join(rows)}</table>" if rows else ""
    count, nbytes = report.unlisted
    listed = len(report.live) if report.live is not None else 0
    summary = f"{plural(listed, 'storage')} listed"
    if count:
        summary += f"; {plural(count, 'smaller storage')} "
        summary += f"({format_bytes(nbytes)}) not listed"
    return f"{table}<p>{_e(summary)}</p>"


def _live_table(live: Any) -> str:
    rows = []
    for s in live:
        paths = [h.path for h in direct_first(s.holders or ())]
        held = "<br>".join(_e(p) for p in paths[:5]) or "<em>no holder found</em>"
        if len(paths) > 5:
            held += f"<br>… and {len(paths) - 5} more"
        shape = "×".join(str(d) for d in s.shape) or "()"
        rows.append(
            f'<tr><td class="num">{_e(format_bytes(s.nbytes))}</td><td>{_e(s.device)}</td>'
            f"<td>{_e(s.dtype)}</td><td>{_e(shape)}</td>"
            f"<td>{'yes' if s.saved_by_autograd else ''}</td><td>{held}</td></tr>"
        )
    head = (
        "<tr><th>bytes</th><th>device</th><th>dtype</th><th>shape</th>"
        "<th>autograd</th><th>held by</th></tr>"
    )
    notes = "".join(f"<p>{_e(n)}</p>" for n in getattr(live, "notes", ()))
    return f"<table>{head}{''.join(rows)}</table>{notes}"


def render_html(report: RunReport, *, leak_names: tuple[str, ...] | None = None) -> str:
    """The whole report as one HTML document (a string)."""
    title = command_line(report)
    status_class = "ok" if report.exit_code == 0 else "bad"
    outcome = f"exit code {report.exit_code} after {format_duration(report.duration)}"
    if report.exception is not None:
        outcome += f", raised {report.exception}"
    names = leak_names if leak_names is not None else report.leak_names
    body = [
        f"<h1>cudamem run: <code>{_e(title)}</code></h1>",
        f'<p class="{status_class}">{_e(outcome)}</p>',
        f"<p>{_e(steps_line(report))}</p>",
    ]
    if report.peaks:
        items = "".join(f"<li>cuda:{d}: {_e(format_bytes(b))}</li>" for d, b in report.peaks)
        body.append(f"<h2>Peak allocated</h2><ul>{items}</ul>")
    if report.modules is not None:
        body.append("<h2>Memory per module</h2>" + render_profile_html(report.modules))
    body.append("<h2>Memory per span</h2>")
    spans = report.history.spans if report.history is not None else ()
    body.append(memory_chart(points(spans, names), empty=nothing_to_plot(spans)))
    body.append("<h2>Leak warnings</h2>")
    if report.leak_warnings:
        body.append("".join(_pre(w) for w in report.leak_warnings))
    elif unmeasured(report) is not None:
        body.append(f'<p class="bad">{_e(leak_line(report))}</p>')
    else:
        body.append("<p>None.</p>")
    if report.oom is not None:
        body.append("<h2>Out-of-memory post-mortem</h2>" + _pre(str(report.oom)))
    if report.traceback:
        body.append("<h2>Uncaught exception</h2>" + _pre(report.traceback))
    if report.live is not None:
        body.append(
            "<h2>Storages still alive at exit, by holder</h2>"
            + _groups_table(report)
            + "<h2>The largest storages</h2>"
            + _live_table(report.live)
        )
    if report.ledger is not None:
        body.append("<h2>Where the memory is (explain)</h2>" + _pre(str(report.ledger)))
    if report.host is not None:
        body.append("<h2>Host memory</h2>" + _pre(str(report.host)))
    if report.history is not None and len(report.history):
        body.append("<h2>Spans</h2>" + _pre(str(report.history)))
    if report.notes:
        body.append("<h2>Notes</h2>" + "".join(f"<p>{_e(n)}</p>" for n in report.notes))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>cudamem: {_e(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
