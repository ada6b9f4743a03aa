"""HTML fragments for notebooks: the ``_repr_html_`` of spans, holders and the ledger.

Fragments, not documents: Jupyter puts them into the page as they are. Every string that
came from the user's program (span names, holder paths, exception messages, device names)
is escaped with ``_format.escape_html`` (invisible and bidi characters too); no script,
style sheet or font is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..base.format import escape_html, format_bytes, format_duration, plural
from ..base.present import renders
from ..holders.finder import Holders
from ..integrations.results import NotebookHolders
from ..ledger.device import DeviceLedger, Explanation
from ..spans.leftovers import LeakReport
from ..spans.record import SpanRecord
from ..spans.span import MemorySpan
from .fragmentation import fragmentation_html
from .holders import render_holder
from .host import render_host_ledger
from .leaks import render_leak_report
from .ledger import _title

__all__ = [
    "explanation_html",
    "holders_html",
    "leak_report_html",
    "ledger_html",
    "notebook_holders_html",
    "pre_html",
    "record_html",
    "render_notebook_holders",
    "span_html",
]

_TABLE = 'style="border-collapse:collapse;font-size:0.9em"'
_NUM = 'style="text-align:right;font-variant-numeric:tabular-nums;padding:0 0.6em"'
_CELL = 'style="text-align:left;padding:0 0.6em"'


_e = escape_html


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
    head = "".join(
        f"<th {_NUM if n else _CELL}>{_e(h)}</th>" for h, n in zip(headers, numeric, strict=True)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f"<td {_NUM if n else _CELL}>{_e(c)}</td>" for c, n in zip(row, numeric, strict=True)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table {_TABLE}><tr>{head}</tr>{body}</table>"


def pre_html(text: str) -> str:
    """Preformatted text, escaped."""
    return f"<pre>{_e(text)}</pre>"


@renders(LeakReport, "html")
def leak_report_html(report: LeakReport) -> str:
    """A span's left-behind storages as the text report, preformatted."""
    return pre_html(render_leak_report(report))


def _notes(notes: Sequence[str]) -> str:
    return "".join(f"<div><small>note: {_e(n)}</small></div>" for n in notes)


@renders(SpanRecord, "html")
def record_html(record: SpanRecord) -> str:
    """A span's devices as a table (allocated and reserved change, peak), its duration and
    exception."""
    title = (
        f"<div><b>{_e(record.name)}</b>: {_e(format_duration(record.duration))}"
        + (f", raised {_e(record.exception)}" if record.exception is not None else "")
        + "</div>"
    )
    if not record.devices:
        why = record.unmeasured or "no data"
        return f"<div>{title}<div>n/a ({_e(why)})</div>{_notes(record.notes)}</div>"
    rows = [
        [
            f"cuda:{d.device}",
            format_bytes(d.allocated_delta, signed=True),
            format_bytes(d.reserved_delta, signed=True),
            format_bytes(d.peak),
            format_bytes(d.peak_delta, signed=True) if d.peak_delta is not None else "n/a",
            format_bytes(d.after.allocated),
        ]
        for d in record.devices
    ]
    table = _table(
        ["device", "allocated", "reserved", "peak", "peak above start", "allocated now"],
        rows,
        [False, True, True, True, True, True],
    )
    return f"<div>{title}{table}{_notes(record.notes)}</div>"


@renders(MemorySpan, "html")
def span_html(span: MemorySpan) -> str:
    """``record_html`` of a closed span; one line while it is open or unused."""
    if not span.closed:
        return f"<div><b>{_e(span.name)}</b>: {_e(str(span).split(': ', 1)[-1])}</div>"
    return record_html(span.record)


@renders(Holders, "html")
def holders_html(holders: Holders) -> str:
    """The target, its bytes, one row per holder path (how it holds it), then notes."""
    size = "" if holders.nbytes is None else f", {format_bytes(holders.nbytes)}"
    title = f"<div><b>{_e(holders.target)}</b>{_e(size)}: {plural(len(holders), 'holder')}</div>"

    items = "".join(f"<li><code>{_e(render_holder(h))}</code></li>" for h in holders)
    if not holders.holders:
        items = "<li>nothing found: only the caller's temporaries hold it</li>"
    return f"<div>{title}<ul>{items}</ul>{_notes(holders.notes)}</div>"


@renders(DeviceLedger, "html")
def ledger_html(ledger: DeviceLedger) -> str:
    """One device's ledger lines (bytes, measured or inferred, what frees them)."""

    rows = [
        [line.label, format_bytes(line.nbytes), line.basis, line.frees] for line in ledger.lines
    ]
    rows.append(["total of the lines", format_bytes(ledger.accounted), "", ""])
    table = _table(["line", "bytes", "basis", "freed by"], rows, [False, True, False, False])
    frag = "" if ledger.fragmentation is None else fragmentation_html(ledger.fragmentation)
    return f"<div><b>{_e(_title(ledger))}</b>{table}{_notes(ledger.notes)}{frag}</div>"


@renders(Explanation, "html")
def explanation_html(explanation: Explanation) -> str:
    """Every device's ledger, then the notes."""
    parts = [ledger_html(d) for d in explanation.devices]
    if not explanation.nvml.available:
        parts.append(f"<div>NVML unavailable: {_e(explanation.nvml.reason)}</div>")
    host = ""
    if explanation.host is not None:
        host = f"<pre>{_e(render_host_ledger(explanation.host))}</pre>"
    return "<div>" + "".join(parts) + _notes(explanation.notes) + host + "</div>"


@renders(NotebookHolders, "html")
def notebook_holders_html(found: NotebookHolders) -> str:
    """``%who_holds``: your holders first, then what IPython keeps, each with its fix."""
    h = found.holders
    size = "" if h.nbytes is None else f", {format_bytes(h.nbytes)}"
    parts = [f"<div><b>{_e(h.target)}</b>{_e(size)}</div>"]
    if found.user:
        items = "".join(f"<li><code>{_e(p)}</code></li>" for p in found.user)
        parts.append(f"<div>held by:</div><ul>{items}</ul>")
    for kind in found.ipython:
        paths = ", ".join(f"<code>{_e(p)}</code>" for p in kind.paths[:3])
        more = f" (+{len(kind.paths) - 3} more)" if len(kind.paths) > 3 else ""
        parts.append(
            f"<div>{_e(kind.what)}: {paths}{_e(more)}<br>fix: <code>{_e(kind.fix)}</code></div>"
        )
    if not found.user and not found.ipython:
        parts.append("<div>nothing holds it but your own reference</div>")
    parts.append(_notes(h.notes))
    return "<div>" + "".join(parts) + "</div>"


@renders(NotebookHolders)
def render_notebook_holders(found: NotebookHolders) -> str:
    """The text of ``%who_holds``: your holders, then each IPython holder with its fix."""
    h = found.holders
    size = "" if h.nbytes is None else f", {format_bytes(h.nbytes)}"
    lines = [f"{h.target}{size}"]
    if found.user:
        lines.append("held by:")
        lines.extend(f"  {p}" for p in found.user)
    for kind in found.ipython:
        more = f" (+{len(kind.paths) - 3} more)" if len(kind.paths) > 3 else ""
        lines.append(f"{kind.what}: {', '.join(kind.paths[:3])}{more}")
        lines.append(f"  fix: {kind.fix}")
    if not found.user and not found.ipython:
        lines.append("nothing holds it but your own reference")
    lines.extend(f"note: {n}" for n in h.notes)
    return "\n".join(lines)
