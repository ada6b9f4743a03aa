"""Text and HTML of ``cudamem.fragmentation()`` (and the fragmentation section of a ledger)."""

from __future__ import annotations

from ..base.format import escape_html, format_bytes, plural
from ..base.present import renders
from ..ledger.free_space import (
    CERTAIN,
    FITS_NOW,
    FRAGMENTATION,
    LIKELY,
    LIKELY_RATIO,
    NOT_FRAGMENTATION,
    Fragmentation,
    OomJudgement,
    OomVerdict,
    PoolFragmentation,
)
from .text import render_table

__all__ = [
    "fragmentation_html",
    "fragmentation_lines",
    "render_fragmentation",
    "render_oom_judgement",
    "render_oom_verdict",
    "verdict_lines",
]

_HEADERS = (
    "pool",
    "segments",
    "reserved",
    "allocated",
    "free",
    "stranded",
    "empty_cache() returns",
    "largest free block",
)

_EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "0%"


def _pool_label(p: PoolFragmentation) -> str:
    if p.kind == "default":
        return "default"
    return f"private {p.pool_id} {p.kind}" + (", held" if p.held else "")


def _row(p: PoolFragmentation) -> list[str]:
    return [
        _pool_label(p),
        str(p.segments),
        format_bytes(p.reserved),
        format_bytes(p.allocated),
        format_bytes(p.free),
        format_bytes(p.stranded),
        format_bytes(p.empty_cache_returns),
        format_bytes(p.largest_free),
    ]


_FITS = "fits in the free bytes together, in no single free block"
_ON_ALREADY = (
    "expandable segments are on already: the free bytes sit beside live blocks "
    "(partial pages) or on other streams"
)
_NOT = (
    "the request is more than every free byte together; expandable segments would not have helped"
)
_FREED = (
    "a free block holds the request now: memory was freed after the OOM (or the request "
    "was on another stream or in a private pool)"
)
_UNKNOWN = "more than the cache holds, and the device's free memory is unknown"


def _verdict(j: OomJudgement) -> str:
    if j.verdict == FRAGMENTATION:
        if j.expandable:
            return f"fragmentation: it {_FITS}; {_ON_ALREADY}"
        return f"fragmentation: it {_FITS}; {_EXPANDABLE} would have avoided it"
    if j.verdict == NOT_FRAGMENTATION:
        return f"not fragmentation: {_NOT}"
    if j.verdict == FITS_NOW:
        return _FREED
    return f"unknown: {_UNKNOWN}"


def _cause(v: OomVerdict) -> str:
    if v.cause == FRAGMENTATION:
        return "fragmentation"
    if v.cause == NOT_FRAGMENTATION:
        return "not fragmentation"
    return "cause unknown"


def verdict_lines(v: OomVerdict) -> list[str]:
    """The verdict as text lines: the cause and how sure, the evidence, the fix."""
    lines = [f"out-of-memory verdict on cuda:{v.device}: {_cause(v)} ({v.confidence})"]
    if v.requested is not None:
        head = f"the last OOM asked for {format_bytes(v.requested)} ({v.source})"
        if v.cause == FRAGMENTATION:
            lines.append(
                f"{head}: it {_FITS} (largest {format_bytes(v.largest_free)}; "
                f"{format_bytes(v.stranded)} stranded beside live blocks)"
            )
        elif v.cause == NOT_FRAGMENTATION:
            lines.append(f"{head}: {_NOT}")
        elif v.cause == FITS_NOW:
            lines.append(f"{head}: {_FREED}")
        else:
            lines.append(f"{head}: {_UNKNOWN}")
    else:
        lines.append(
            f"the allocator counted {plural(v.ooms, 'out-of-memory error')}; cudamem "
            "recorded none of them"
        )
        where = (
            f"{format_bytes(v.stranded)} of the cache is stranded beside live blocks, in free "
            f"blocks of at most {format_bytes(v.largest_free)}"
        )
        if v.confidence == LIKELY:
            lines.append(f"{where}: a request between the two {_FITS}")
        else:
            lines.append(
                f"{where}: less than {LIKELY_RATIO}x the largest, too little to tell "
                "fragmentation from a request larger than the free memory (and memory freed "
                "since the OOM hides fragmentation)"
            )
    if v.cause == FRAGMENTATION:
        if v.expandable:
            lines.append(_ON_ALREADY)
        else:
            would = "would have" if v.confidence == CERTAIN else "would likely have"
            lines.append(f"{_EXPANDABLE} {would} avoided it")
    if v.requested is None:
        lines.append("cudamem.on_oom() records the next one's size for a certain verdict")
    return lines


@renders(OomVerdict)
def render_oom_verdict(v: OomVerdict) -> str:
    """``out-of-memory verdict on cuda:0: fragmentation (likely)``, the evidence, the fix."""
    first, *rest = verdict_lines(v)
    return "\n".join([first, *(f"  {line}" for line in rest)])


@renders(OomJudgement)
def render_oom_judgement(j: OomJudgement) -> str:
    """``last OOM on cuda:0: tried to allocate ...`` then the verdict."""
    when = "" if j.seconds_ago is None else f", {j.seconds_ago:.0f} s ago"
    source = f" ({j.source}{when})" if j.source else ""
    device = format_bytes(j.device_free)
    total = format_bytes(j.total_free)
    return (
        f"last OOM on cuda:{j.device}{source}: tried to allocate {format_bytes(j.requested)}; "
        f"largest free block {format_bytes(j.largest_free)}; free {format_bytes(j.cache_free)} "
        f"in the cache + {device} on the device = {total}\n  {_verdict(j)}"
    )


def _head(f: Fragmentation) -> str:
    if not f.pools:
        return f"cuda:{f.device} fragmentation: nothing reserved"
    return (
        f"cuda:{f.device} fragmentation: {format_bytes(f.cached)} of "
        f"{format_bytes(f.reserved)} reserved is unallocated ({_share(f.cached, f.reserved)}); "
        f"{format_bytes(f.stranded)} of it stranded beside live blocks"
        + (" (expandable segments)" if f.expandable else "")
    )


def _details(f: Fragmentation, *, verdict: bool = True) -> list[str]:
    """What follows the table: pending bytes, stranded, the peaks, the OOM, its verdict,
    notes."""
    lines = []
    pending = sum(p.pending for p in f.pools)
    if pending:
        lines.append(f"{format_bytes(pending)} freed, awaiting stream events (record_stream)")
    if f.stranded:
        lines.append(
            f"stranded: {format_bytes(f.stranded)} free beside live blocks; empty_cache() "
            "cannot return it until they are freed"
        )
    if f.peak_cached is not None and f.peak_reserved is not None:
        lines.append(
            f"at peak: peak reserved {format_bytes(f.peak_reserved)} − peak allocated "
            f"{format_bytes(f.peak_allocated)} = {format_bytes(f.peak_cached)}: at least that "
            "was unallocated at the reserved peak (the counters' peaks; maybe not one moment)"
        )
    if f.oom is not None:
        lines.extend(render_oom_judgement(f.oom).splitlines())
    if f.verdict is not None and verdict and f.oom is None:  # the judgement says it all
        lines.extend(render_oom_verdict(f.verdict).splitlines())
    lines.extend(f"note: {n}" for n in f.notes)
    return lines


def fragmentation_lines(f: Fragmentation, *, verdict: bool = True) -> list[str]:
    """The fragmentation as text lines (a section of the ledger, or the whole result);
    ``verdict=False`` leaves the OOM verdict out (the ledger shows it below its table)."""
    lines = [_head(f)]
    if f.pools:
        table = render_table(list(_HEADERS), [_row(p) for p in f.pools], align="lrrrrrrr")
        lines.extend("  " + line for line in table.splitlines())
    lines.extend("  " + line for line in _details(f, verdict=verdict))
    return lines


@renders(Fragmentation)
def render_fragmentation(f: Fragmentation) -> str:
    """Per pool: reserved, allocated, free, stranded, what empty_cache() returns, the largest
    free block; the peaks; the last OOM judged."""
    return "\n".join(fragmentation_lines(f))


@renders(Fragmentation, "html")
def fragmentation_html(f: Fragmentation) -> str:
    """The pools as a table, then the peaks, the OOM and the notes."""
    e = escape_html
    cells = "".join(f"<th>{e(h)}</th>" for h in _HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in _row(p)) + "</tr>" for p in f.pools)
    table = f"<table><tr>{cells}</tr>{body}</table>" if f.pools else ""
    more = "".join(f"<div><small>{e(line.strip())}</small></div>" for line in _details(f))
    return f"<div><div><b>{e(_head(f))}</b></div>{table}{more}</div>"
