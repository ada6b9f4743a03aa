"""``MemoryPlan`` as text (a table of the steps, the line, the answers) and HTML (the same
for notebooks); its predictions and checkpointing advice as one line each. JSON is
``render.json.to_json(plan)``: the plan's fields by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..base.format import escape_html, format_bytes, format_duration, plural
from ..base.present import renders
from ..fit._terms import HEADROOM, Line
from ..fit.memory_plan import CheckpointAdvice, LargestBatch, MemoryPlan, Prediction, Probe
from .text import render_table

__all__ = [
    "formula",
    "plan_lines",
    "render_advice",
    "render_largest",
    "render_plan",
    "render_plan_html",
    "render_prediction",
]

#: Module rows the text shows at most.
MAX_MODULES = 8

_HEADERS = ("step", "n", "length", "peak allocated", "peak reserved", "time", "")


def _mib(value: float) -> str:
    return format_bytes(round(value))


def formula(line: Line) -> str:
    """``1.5 GiB + 846.0 MiB × n``; with lengths ``a + n × (b + c·L + d·L²)``."""
    coefs = dict(zip(line.terms, line.coefs, strict=True))
    fixed = _mib(coefs.get("1", 0.0))
    if line.terms == ("1", "n"):
        return f"{fixed}{_signed(coefs['n'], _mib)} × n"
    inner = []
    if "n" in coefs:
        inner.append(("", coefs["n"], _mib))
    if "n*L" in coefs:
        inner.append(("·L", coefs["n*L"], _mib))
    if "n*L^2" in coefs:
        inner.append(("·L²", coefs["n*L^2"], _bytes_per))
    first, *rest = inner
    text = f"{'-' if first[1] < 0 else ''}{first[2](abs(first[1]))}{first[0]}"
    text += "".join(f"{_signed(c, f)}{unit}" for unit, c, f in rest)
    return f"{fixed} + n × ({text})"


def _bytes_per(value: float) -> str:
    return f"{value:.1f} B"


def _signed(value: float, fmt: Callable[[float], str]) -> str:
    """`` + 1.0 MiB`` or `` − 1.0 MiB``: a term after the first, its sign as the operator."""
    return f" − {fmt(-value)}" if value < 0 else f" + {fmt(value)}"


def _probe_row(p: Probe, plan: MemoryPlan) -> list[str]:
    length = "" if p.length is None else str(p.length)
    if p.oom:
        note = ""
        if p.oom_allocated:
            reserved = (
                f", {format_bytes(p.oom_reserved)} reserved" if p.oom_reserved is not None else ""
            )
            note = f"{format_bytes(p.oom_allocated)} allocated{reserved} when it failed"
            if p.oom_requested:
                note += f", asking for {format_bytes(p.oom_requested)}"
        return [p.role, str(p.n), length, "out of memory", "", format_duration(p.seconds), note]
    note = ""
    check = plan.check
    if p.role == "check" and check is not None:
        verdict = "on the line" if check.linear else "OFF the line"
        note = f"line said {format_bytes(check.predicted)}: {check.error:.2%} off, {verdict}"
    elif p.role == "confirm":
        note = "ran at the answer"
        if p.retries:
            note += f" (the allocator freed its cache {plural(p.retries, 'time')})"
    elif p.retries:
        note = f"allocator retried {plural(p.retries, 'time')}"
    return [
        p.role,
        str(p.n),
        length,
        format_bytes(p.allocated),
        format_bytes(p.reserved),
        format_duration(p.seconds),
        note,
    ]


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The lines below the table: the line, the answer, modules, restore, notes."""
    out: list[str] = []
    if plan.allocated_line is not None:
        out.append(f"peak allocated = {formula(plan.allocated_line)}")
        if plan.phase_lines:
            out.append(
                "  predicted as the larger of the step's phases "
                "(cut where the model's forward returns and the optimizer's step begins):"
            )
            out.extend(
                f"    phase {k + 1}: {formula(line)}" for k, line in enumerate(plan.phase_lines)
            )
        if plan.reserved_line is not None:
            out.append(
                f"peak reserved  = {formula(plan.reserved_line)} "
                f"(past the probes: the smaller of this and {plan.ratio:.3f} × allocated, "
                "the largest step's ratio, while memory is plentiful)"
            )
        confirmed = [p for p in plan.probes if p.role == "confirm" and not p.oom]
        basis = (
            f"measured at the confirming step at batch {confirmed[-1].n}"
            if confirmed
            else "before any confirming step measured it"
        )
        out.append(
            f"required near the limit = peak allocated × {1 + plan.allowance:.4f} + "
            f"{format_bytes(HEADROOM)} ({basis}: the allocator frees its cache before it "
            "fails; what it cannot give back is what limits the batch)"
        )
        if plan.resolved is False:
            out.append(
                "the per-sample bytes were too small a share of the peak to measure at the "
                "largest step: answers past the steps run are not to be trusted"
            )
    if plan.fixed_parts and plan.allocated_line is not None:
        listed = ", ".join(f"{what} {format_bytes(nbytes)}" for what, nbytes in plan.fixed_parts)
        out.append(
            f"fixed part {format_bytes(plan.fixed)}: {listed} (gradients only where alive at the "
            "peak; the rest: workspaces and the step's own)"
        )
    if plan.linear is False:
        out.append(
            f"NOT LINEAR in n: cudamem does not extrapolate past batch {plan.largest_measured}."
        )
        out.extend(f"  likely: {c}" for c in plan.causes)
    if plan.smallest_oom is not None:
        out.append(f"batch {plan.smallest_oom} ran out of memory: no answer reaches it")
    if plan.largest_now is not None and plan.available is not None:
        ran = (
            f"; a step ran at {plan.largest_measured}, the largest for margin 0"
            if plan.confirm
            else ""
        )
        out.append(
            f"largest batch that fits now: {plan.largest_now} "
            f"({format_bytes(plan.available)} usable by this process, 5% margin{ran})"
        )
    elif plan.available is not None:
        out.append(f"{format_bytes(plan.available)} usable by this process now")
    if plan.modules and plan.profiled is not None:
        n, length = plan.profiled
        at = f"n={n}" + ("" if length is None else f", L={length}")
        out.append(f"activations kept per sample, by module (profiled at {at}):")
        top = sorted(
            (m for m in plan.modules if m.depth >= 1), key=lambda m: (-m.kept, m.depth, m.name)
        )
        for m in top[:MAX_MODULES]:
            out.append(f"  {_mib(m.kept):>10}  {m.name}")
        for m in plan.modules:
            if m.depth == 0 and m.self_kept >= 1:
                out.append(f"  {_mib(m.self_kept):>10}  {m.name}'s own code (outside its modules)")
    if plan.fragmentation is not None:
        out.append(str(plan.fragmentation))
    if plan.restore is not None:
        out.append(
            f"restored the model and optimizer: {format_bytes(plan.restore.nbytes)} copied to "
            f"the host and back in {format_duration(plan.restore.seconds)}"
        )
    out.append(
        f"after the plan: {format_bytes(plan.kept_after, signed=True)} allocated "
        "(what the step itself keeps: optimizer state)"
    )
    out.extend(f"note: {n}" for n in plan.notes)
    return out


@renders(MemoryPlan)
def render_plan(plan: MemoryPlan) -> str:
    """The steps run, the fitted line, the largest batch, the modules per sample."""
    if plan.unmeasured is not None:
        return f"cudamem.plan: nothing measured ({plan.unmeasured})"
    runs = plural(len(plan.probes), "step")
    title = f"cudamem.plan on cuda:{plan.device}: {runs} run"
    rows = [_probe_row(p, plan) for p in plan.probes]
    table = render_table(_HEADERS, rows, align="lrrrrrl", title=title)
    return "\n".join([table, *plan_lines(plan)])


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    e = escape_html
    head = "".join(f'<th style="padding:0 0.6em">{e(h)}</th>' for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td style="padding:0 0.6em">{e(c)}</td>' for c in row) + "</tr>"
        for row in rows
    )
    return f'<table style="border-collapse:collapse;font-size:0.9em"><tr>{head}</tr>{body}</table>'


@renders(MemoryPlan, "html")
def render_plan_html(plan: MemoryPlan) -> str:
    """The plan in a notebook: the same table and lines."""
    e = escape_html
    if plan.unmeasured is not None:
        return f"<p>{e(render_plan(plan))}</p>"
    title = f"<p><b>cudamem.plan</b> on cuda:{plan.device}</p>"
    table = _html_table(_HEADERS, [_probe_row(p, plan) for p in plan.probes])
    lines = "".join(f"<li>{e(line)}</li>" for line in plan_lines(plan))
    return f"{title}{table}<ul>{lines}</ul>"


@renders(Prediction)
def render_prediction(p: Prediction) -> str:
    """``batch 64: peak allocated 54.3 GiB, reserved 56.0 GiB (predicted)``."""
    at = f"batch {p.n}" + ("" if p.length is None else f", length {p.length}")
    where = "" if p.measured_range else ", past the probes"
    return (
        f"{at}: peak allocated {format_bytes(p.allocated)}, reserved "
        f"{format_bytes(p.reserved)}, needs {format_bytes(p.required)} (predicted{where})"
    )


_TERRITORY = {
    "ran": "a step ran at this batch",
    "interpolated": "between steps that ran",
    "extrapolated": "past every step that ran: the line's word alone",
}


@renders(LargestBatch)
def render_largest(b: LargestBatch) -> str:
    """The batch, the memory it was held against, and what it assumed."""
    on = (
        f"a card of {format_bytes(b.capacity)} ({format_bytes(b.memory)} for the allocator)"
        if b.capacity is not None
        else f"{format_bytes(b.memory)} for the allocator"
    )
    head = (
        f"largest batch on {on}, {b.margin:.0%} margin: {b.n} (needs "
        f"{format_bytes(b.required)} of {format_bytes(b.budget)}; {_TERRITORY[b.territory]})"
    )
    return "\n".join([head, *(f"  assumes {a}" for a in b.assumptions)])


@renders(CheckpointAdvice)
def render_advice(a: CheckpointAdvice) -> str:
    """Which modules to checkpoint, and the peak then."""
    budget = "" if a.budget is None else f" of {format_bytes(a.budget)}"
    if not a.modules:
        head = f"batch {a.n}: {'fits' if a.fits else 'does not fit'}{budget} without checkpointing"
    else:
        names = ", ".join(a.modules)
        verdict = "fits" if a.fits else "still does not fit"
        head = (
            f"batch {a.n}: checkpoint {plural(len(a.modules), 'module')} ({names}): peak "
            f"{format_bytes(a.predicted.allocated)} allocated, "
            f"{format_bytes(a.predicted.reserved)} reserved, {verdict}{budget} "
            f"(without: {format_bytes(a.without.reserved)} reserved)"
        )
    return "\n".join([head, *(f"note: {n}" for n in a.notes)])
