"""The per-module memory profile as text (a tree table) and HTML (the same table)."""

from __future__ import annotations

from ..base.format import escape_html, escape_invisible, format_bytes, format_duration, plural
from ..base.present import renders
from ..modules.profile import ModuleProfile, ModuleStats, Spread
from ..modules.profiler import ModuleProfiler
from .text import render_table

__all__ = [
    "module_rows",
    "render_module_stats",
    "render_profile",
    "render_profile_html",
    "render_profiler",
    "render_profiler_html",
    "render_top_table",
    "top_line",
]

#: Rows a text table shows at most (``profile.modules`` has them all).
MAX_ROWS = 60

_HEADERS = (
    "module",
    "calls",
    "kept",
    "kept max",
    "self",
    "fwd peak",
    "bwd peak",
    "recomputed",
    "params",
    "grads",
    "optim",
    "fwd time",
    "bwd time",
)


def _short(row: ModuleStats) -> str:
    """The row's name below its parent's (``h.0.attn`` → ``attn``)."""
    if row.parent and row.name.startswith(row.parent + "."):
        return row.name[len(row.parent) + 1 :]
    return row.name


def _b(value: float) -> str:
    return "-" if value == 0 else format_bytes(round(value))


def _t(spread: Spread) -> str:
    return "-" if spread.mean == 0 else format_duration(spread.mean)


def _calls(row: ModuleStats) -> str:
    text = f"{row.calls.mean:g}"
    if row.recomputes.mean:
        text += f"+{row.recomputes.mean:g}r"
    return text


def _na(value: float) -> str:
    return "n/a"


def module_rows(profile: ModuleProfile, *, limit: int = MAX_ROWS) -> list[list[str]]:
    """The table's cells, one row per module (depth first), names indented by depth. The
    allocator's columns are ``n/a`` where nothing measured them (``-`` is a measured 0)."""
    alloc = _b if profile.unmeasured is None else _na
    return [
        [
            "  " * row.depth + escape_invisible(_short(row)),
            _calls(row),
            alloc(row.kept.mean),
            alloc(row.kept.max),
            alloc(row.self_kept.mean),
            alloc(row.forward_peak.max),
            alloc(row.backward_peak.max),
            alloc(row.recomputed.mean),
            _b(row.params),
            _b(row.grads),
            _b(row.optimizer),
            _t(row.forward_time),
            _t(row.backward_time),
        ]
        for row in profile.modules[:limit]
    ]


def top_line(profile: ModuleProfile, n: int = 3) -> str:
    """``top modules by kept activations: a 12 MiB, b 8 MiB`` (or why there is none)."""
    if profile.unmeasured:
        return f"top modules: bytes not measured ({profile.unmeasured})"
    top = profile.top(n)
    if not top:
        return "top modules: no module kept memory"
    items = ", ".join(
        f"{escape_invisible(r.name)} {format_bytes(round(r.self_kept.mean))}" for r in top
    )
    return f"top modules by activations kept (own code, mean per step): {items}"


def _notes(profile: ModuleProfile) -> list[str]:
    notes = [f"note: {escape_invisible(r.name)}: {n}" for r in profile.modules for n in r.notes]
    notes += [
        f"note: {r.name}: {plural(r.raised, 'forward call')} raised"
        for r in profile.modules
        if r.raised
    ]
    notes += [f"note: {escape_invisible(n)}" for n in profile.notes]
    return notes


#: What the columns mean, under the text table.
LEGEND = (
    "kept: allocated at the forward's exit minus at its entry (the activations kept for "
    "the backward, output included); self: less its submodules'; peaks: the highest "
    "above the call's entry level; calls 1+1r: once in forward, once re-run in backward"
)


@renders(ModuleProfile)
def render_profile(profile: ModuleProfile) -> str:
    """The profile's tree table, the top modules above it."""
    head = (
        f"module profile: {plural(profile.steps, 'step')}, "
        f"{plural(len(profile.modules), 'module')} (mean per step)"
    )
    if not profile.modules:
        return f"{head}\nno profiled module ran"
    lines = [head, top_line(profile)]
    rows = module_rows(profile)
    headers = list(_HEADERS)
    if profile.steps <= 1:  # the largest step is the only one
        del headers[3]
        rows = [r[:3] + r[4:] for r in rows]
    lines.append(render_table(headers, rows))
    hidden = len(profile.modules) - MAX_ROWS
    if hidden > 0:
        lines.append(f"... {plural(hidden, 'more module')} (profile.modules has every row)")
    lines.append(LEGEND)
    lines.extend(_notes(profile))
    return "\n".join(lines)


def render_top_table(profile: ModuleProfile, n: int = 10) -> str:
    """The ``n`` modules whose own code kept the most, as a table (``cudamem run
    --modules``'s end report), or the line saying why there are none."""
    top = profile.top(n)
    if profile.unmeasured or not top:
        return top_line(profile)
    rows = [
        [
            escape_invisible(r.name),
            _calls(r),
            _b(r.self_kept.mean),
            _b(r.kept.mean),
            _b(r.forward_peak.max),
            _b(r.backward_peak.max),
            _b(r.params),
        ]
        for r in top
    ]
    headers = ["module", "calls", "self kept", "kept", "fwd peak", "bwd peak", "params"]
    title = (
        f"top modules by activations kept by their own code (mean per step, "
        f"{plural(profile.steps, 'step')}):"
    )
    return render_table(headers, rows, title=title)


@renders(ModuleStats)
def render_module_stats(row: ModuleStats) -> str:
    """One module in a line (activation bytes ``not measured`` where nothing measured them,
    never ``0 B``)."""
    if row.unmeasured is not None:
        return (
            f"{row.name} ({row.type_name}): kept and peaks not measured ({row.unmeasured}), "
            f"params {format_bytes(row.params)}, grads {format_bytes(row.grads)}, "
            f"optimizer {format_bytes(row.optimizer)}"
        )
    text = (
        f"{row.name} ({row.type_name}): kept {format_bytes(round(row.kept.mean))} per step "
        f"({format_bytes(round(row.self_kept.mean))} by its own code), forward peak "
        f"+{format_bytes(round(row.forward_peak.max))}, backward peak "
        f"+{format_bytes(round(row.backward_peak.max))}, params {format_bytes(row.params)}, "
        f"grads {format_bytes(row.grads)}, optimizer {format_bytes(row.optimizer)}"
    )
    if row.recomputed.mean:
        text += f", re-run in backward keeping {format_bytes(round(row.recomputed.mean))}"
    return text


_STYLE = (
    "<style>.cm-mod td{padding:0.1rem 0.5rem;font-variant-numeric:tabular-nums}"
    ".cm-mod td.num{text-align:right}.cm-bar{background:#4c78a8;height:0.7rem}</style>"
)


@renders(ModuleProfile, "html")
def render_profile_html(profile: ModuleProfile) -> str:
    """The profile as an HTML table with a bar per module for the bytes it kept (the run
    report's section, a notebook cell)."""
    e = escape_html
    parts = [_STYLE, f"<p>{e(top_line(profile))}</p>"]
    head = "".join(f"<th>{e(h)}</th>" for h in (_HEADERS[0], "kept (bar)", *_HEADERS[1:]))
    widest = max((r.kept.mean for r in profile.modules), default=0.0)
    body = []
    every = module_rows(profile, limit=len(profile.modules))
    for row, cells in zip(profile.modules, every, strict=True):
        pad = f"padding-left:{0.5 + row.depth}rem"
        name = f'<td style="{pad}" title="{e(row.name)}">{e(_short(row))}</td>'
        width = 0 if widest <= 0 else max(0, round(160 * row.kept.mean / widest))
        bar = f'<td><div class="cm-bar" style="width:{width}px"></div></td>'
        nums = "".join(f'<td class="num">{e(c)}</td>' for c in cells[1:])
        body.append(f"<tr>{name}{bar}{nums}</tr>")
    parts.append(f'<table class="cm-mod"><tr>{head}</tr>{"".join(body)}</table>')
    parts.append(f"<p>{e(LEGEND)}</p>")
    parts.extend(f"<p>{e(n)}</p>" for n in _notes(profile))
    return "".join(parts)


def _profiler_state(profiler: ModuleProfiler) -> str:
    return f"<cudamem module profiler, {'running' if profiler.running else 'not started'}>"


@renders(ModuleProfiler)
def render_profiler(profiler: ModuleProfiler) -> str:
    """A live profiler: its profile once stopped, else its state."""
    profile = profiler.result
    return _profiler_state(profiler) if profile is None else render_profile(profile)


@renders(ModuleProfiler, "html")
def render_profiler_html(profiler: ModuleProfiler) -> str:
    """A live profiler in a notebook: its profile's table once stopped, else its state."""
    profile = profiler.result
    if profile is None:
        return f"<p>{escape_html(_profiler_state(profiler))}</p>"
    return render_profile_html(profile)
