"""Text rendering of growth findings and leak reports."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..growth.report import Growth
from ..growth.settings import LeakSettings
from ..holders.culprits import Culprit
from ..spans.leftovers import LeakReport
from .text import render_table

__all__ = ["render_culprit", "render_growth", "render_leak_report", "render_leak_settings"]


@renders(Culprit)
def render_culprit(c: Culprit) -> str:
    """``__main__.loss_history: 10 tensors, 40.0 MiB held through autograd graphs``.

    A container whose entries hold several tensors each says both:
    ``model.step_outputs: 30 items, 60 tensors, 12.0 MiB``.
    """
    count = plural(c.tensors, "tensor")
    if c.items > 1 and c.items != c.tensors:
        count = f"{plural(c.items, 'item')}, {count}"
    text = f"{c.holder}: {count}, {format_bytes(c.nbytes)}"
    if c.autograd_bytes and c.autograd_bytes * 2 >= c.nbytes:
        text += " held through autograd graphs"
    elif c.autograd_bytes:
        text += f" ({format_bytes(c.autograd_bytes)} through autograd graphs)"
    return text


def _hint(c: Culprit) -> str | None:
    """One concrete fix for the kind of holder."""
    if c.autograd_bytes * 2 >= c.nbytes and c.autograd_bytes:
        return (
            "each item keeps its autograd graph: store loss.item() or log through "
            "cudamem.ScalarLogger instead of the tensor"
        )
    if c.holder.startswith("("):
        return None
    if ": local " in c.holder or "local '" in c.holder:
        return "a local variable of a running function keeps it: del it or let the call return"
    if c.device_type == "cpu":
        return (
            "a container keeps CPU tensors: keep fewer, or only what you need of each "
            "(a number: .item(); a part: a slice's .clone())"
        )
    if c.device_type == "cuda":
        return (
            "a container keeps GPU tensors: keep fewer, or copies on the CPU "
            "(cudamem.to_host / .detach().cpu())"
        )
    return "a container keeps tensors: keep fewer, or only what you need of each"


def _inner_patterns(c: Culprit, limit: int = 3) -> list[str]:
    """The paths inside a container worth showing (``errors[*].__traceback__.tb_next``),
    not the container itself or its plain entries (``loss_history[*]``)."""
    plain = (c.holder, c.holder + "[*]")
    inner = [p for p in c.patterns if p not in plain]
    if len(inner) > limit:
        inner = [*inner[:limit], f"... {len(inner) - limit} more"]
    return inner


def _culprit_lines(c: Culprit) -> list[str]:
    """The culprit's line, then the paths inside it worth showing."""
    inner = _inner_patterns(c)
    return [f"  {render_culprit(c)}", *([f"    as {', '.join(inner)}"] if inner else [])]


@renders(Growth)
def render_growth(g: Growth) -> str:
    """The text of a ``cudamem.LeakWarning``: the rate, then one line per culprit."""
    lines = [
        f"{g.name} retains {format_bytes(g.per_call, signed=True)} per call "
        f"({plural(g.calls, 'call')})"
    ]
    for c in g.culprits:
        lines.extend(_culprit_lines(c))
        if c.example and c.example != c.holder:
            lines.append(f"    e.g. {c.example}")
        hint = _hint(c)
        if hint:
            lines.append(f"    fix: {hint}")
    lines.extend(f"  note: {n}" for n in g.notes)
    return "\n".join(lines)


def _holders_text(holders: tuple[str, ...]) -> str:
    if not holders:
        return "no holder reachable from Python"
    more = f" (+{len(holders) - 1} more)" if len(holders) > 1 else ""
    return holders[0] + more


@renders(LeakReport)
def render_leak_report(r: LeakReport) -> str:
    """Storages a span left behind: a summary line, culprits, the largest storages."""
    if not r.count:
        head = f"{r.span}: no storage created inside is alive {r.checked}"
        return "\n".join([head, *(f"  note: {n}" for n in r.notes)])
    lines = [
        f"{r.span}: {plural(r.count, 'storage')} created inside, "
        f"{format_bytes(r.nbytes)}, alive {r.checked}"
    ]
    for c in r.culprits:
        lines.extend(_culprit_lines(c))
    rows = [
        [
            format_bytes(s.nbytes),
            s.device,
            f"{s.dtype or '?'}[{'×'.join(map(str, s.shape or ())) or 'scalar'}]",
            _holders_text(s.paths),
        ]
        for s in r.storages
    ]
    table = render_table(["bytes", "device", "tensor", "held by"], rows, align="rlll")
    lines.extend("  " + line for line in table.splitlines())
    if r.count > len(r.storages):
        lines.append(f"  ... and {r.count - len(r.storages)} smaller")
    lines.extend(f"  note: {n}" for n in r.notes)
    return "\n".join(lines)


@renders(LeakSettings)
def render_leak_settings(s: LeakSettings) -> str:
    """``growth detection on: after 1 warm-up call, 3 of the last 8 calls rising by at
    least 64.0 KiB per call``."""
    return (
        f"growth detection {'on' if s.enabled else 'off'}: after "
        f"{plural(s.warmup, 'warm-up call')}, {s.min_rises} of the last {plural(s.window, 'call')} "
        "rising by at least "
        f"{format_bytes(s.min_bytes_per_call)} per call"
    )
