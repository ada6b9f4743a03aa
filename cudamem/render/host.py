"""Text of the host half: a process's RSS/PSS/USS, the pinned pool, CPU tensors, the
DataLoader workers and their growth warning (``cudamem.host.workers``, ``cudamem.host.ledger``)."""

from __future__ import annotations

from ..base.format import format_bytes, plural
from ..base.present import renders
from ..host._dataset_walk import ContainerAttr
from ..host.ledger import HostLedger, HostRelease, HostRun, PinnedPool, ProcessTree
from ..host.procfs import ProcessMemory
from ..host.workers import LoaderReport, WatchSettings
from .text import render_table

__all__ = [
    "render_container",
    "render_host_ledger",
    "render_host_release",
    "render_host_run",
    "render_loader",
    "render_pinned",
    "render_process_memory",
    "render_process_trees",
    "render_watch_settings",
]

_FIX_FORK = (
    "fix: hold the data in numpy arrays or tensors (one buffer each, no per-element "
    "reference counts), or as serialized bytes with an offsets array (np.frombuffer, "
    "pickle.loads per item); strings as one numpy bytes array"
)
_FIX_SPAWN = (
    "fix: load the data inside each worker from a memory-mapped file (np.load(mmap_mode='r'), "
    "torch.from_file) or shared tensors, or use the fork start method with numpy arrays"
)
_FIX_OWN = (
    "fix: look for caches filled in __getitem__ or in worker_init_fn (they grow in every "
    "worker); decoded images held by the workers"
)


@renders(ProcessMemory)
def render_process_memory(m: ProcessMemory) -> str:
    """``pid 12: RSS 812.0 MiB, PSS 426.0 MiB, USS 230.0 MiB`` or why not."""
    if m.rss is None:
        return f"pid {m.pid}: {m.reason}"
    text = f"pid {m.pid}: RSS {format_bytes(m.rss)}"
    if m.pss is not None:
        text += f", PSS {format_bytes(m.pss)}"
    if m.uss is not None:
        text += f", USS {format_bytes(m.uss)}"
    if m.swap:
        text += f", swapped {format_bytes(m.swap)}"
    return text + (f" ({m.reason})" if m.reason else "")


def render_container(c: ContainerAttr) -> str:
    """``dataset.items: list of 2,000,000 dicts, 412.0 MiB of objects``."""
    element = c.element if c.element in ("mixed", "objects") else c.element + "s"
    if c.element == "mixed":
        element = "objects of several types"
    what = "values" if c.kind == "dict" else ""
    of = f"{c.count:,} {element}" + (f" ({what})" if what else "")
    return f"{c.path}: {c.kind} of {of}, {format_bytes(c.nbytes)} of objects"


@renders(LoaderReport)
def render_loader(report: LoaderReport) -> str:
    """A loader's workers: growth per worker and in total, the cause, the containers, the
    fix (the ``HostMemoryWarning`` text)."""
    n = len(report.workers)
    head = (
        f"DataLoader #{report.number} over {report.dataset} ({plural(n, 'worker')}, "
        f"{report.start_method}, {'persistent' if report.persistent else 'not persistent'}"
        + (", ended" if report.ended else "")
        + ")"
    )
    growth = [w.growth for w in report.workers]
    if not report.watched:
        lines = [
            f"{head}: USS {format_bytes(report.uss)}, PSS {format_bytes(report.pss)} in all "
            "(one reading: cudamem.host.workers.watch_workers() or cudamem run follows their "
            "growth)"
        ]
    else:
        lines = [
            f"{head}: workers' private memory (USS) grew by {format_bytes(report.growth)} in "
            "all"
            + (
                " (" + ", ".join(format_bytes(g, signed=True) for g in growth) + " per worker)"
                if n > 1
                else ""
            )
        ]
    exits = any(w.exited for w in report.workers)
    rows = []
    for w in report.workers:
        last = w.last
        row = [str(w.index), str(w.pid)]
        if report.watched:
            row.append(format_bytes(w.first.uss))
        row += [format_bytes(last.uss), format_bytes(last.pss), format_bytes(last.rss)]
        if exits:
            row.append("exited" if w.exited else "running")
        rows.append(row)
    headers = ["worker", "pid", *(["USS first"] if report.watched else []), "USS", "PSS", "RSS"]
    headers += ["state"] if exits else []
    lines.append(render_table(headers, rows, align="r" * (len(headers) - exits) + "l" * exits))
    cause = report.cause
    if cause == "copy-on-read":
        lines.append(
            "cause: copy-on-read. Forked workers share the parent's pages until they read a "
            "Python object: each read writes its reference count and copies its page into "
            "the worker (RSS stays flat; USS and PSS grow). The dataset holds:"
        )
        lines.extend(f"  {render_container(c)}" for c in report.containers)
        lines.append(_FIX_FORK)
    elif cause.startswith(("spawn", "forkserver")):
        lines.append(
            f"cause: {cause} (no copy-on-read: nothing is shared with the parent; each worker "
            "pays for the whole dataset)"
        )
        lines.extend(f"  {render_container(c)}" for c in report.containers)
        lines.append(_FIX_SPAWN)
    elif report.growth > 0 and report.warned:
        lines.append(
            "cause: the workers' own allocations (the dataset holds no large Python "
            "containers: not copy-on-read)"
        )
        lines.append(_FIX_OWN)
    return "\n".join(lines)


@renders(PinnedPool)
def render_pinned(pool: PinnedPool) -> str:
    """``pinned pool: 1.0 GiB in use, 2.5 GiB cached ...``."""
    text = (
        f"pinned pool: {format_bytes(pool.in_use)} in use, {format_bytes(pool.cached)} cached "
        f"({format_bytes(pool.owned)} pinned in {plural(pool.blocks, 'block')}, all in RSS)"
    )
    lines = [text]
    if pool.requested is not None and pool.rounding is not None:
        lines.append(
            f"  live pinned tensors asked for {format_bytes(pool.requested)}; rounding each "
            f"block up to a power of two added {format_bytes(pool.rounding)}"
        )
    if pool.cached:
        how = pool.free_call or "nothing on this torch (only the process exiting)"
        lines.append(
            "  the cache is freed by cudamem.release(host=True)"
            + (f" / {pool.free_call}" if pool.free_call else f"; {how}")
        )
    lines.extend(f"  note: {n}" for n in pool.notes)
    return "\n".join(lines)


@renders(HostLedger)
def render_host_ledger(ledger: HostLedger) -> str:
    """The host section of ``explain()``."""
    lines = [f"host, this process ({render_process_memory(ledger.process)})"]
    if ledger.pinned is None:
        lines.append(f"  pinned pool: {ledger.pinned_reason}")
    else:
        lines.extend("  " + line for line in render_pinned(ledger.pinned).splitlines())
    cpu = ledger.cpu
    if cpu is None:
        lines.append("  CPU tensors: the census failed")
    else:
        lines.append(f"  CPU tensors: {format_bytes(cpu.nbytes)} in {plural(cpu.count, 'storage')}")
        if cpu.largest:
            rows = [
                [format_bytes(s.nbytes), s.describe(), "; ".join(s.paths[:3]) or "not searched"]
                for s in cpu.largest
            ]
            table = render_table(["bytes", "storage", "held by"], rows, align="rll")
            lines.extend("    " + line for line in table.splitlines())
    if not ledger.loaders:
        lines.append("  DataLoader workers: none running")
    else:
        live = sum(len(r.live) for r in ledger.loaders)
        lines.append(
            f"  DataLoader workers: {plural(live, 'live worker')}, USS "
            f"{format_bytes(ledger.workers_uss)}, PSS {format_bytes(ledger.workers_pss)} "
            "in all"
        )
        for report in ledger.loaders:
            lines.extend("    " + line for line in render_loader(report).splitlines())
    return "\n".join(lines)


@renders(HostRelease)
def render_host_release(result: HostRelease) -> str:
    """``pinned cache: freed 2.5 GiB (torch.accelerator.empty_host_cache()) ...``."""
    if result.call is None:
        return f"pinned cache: not emptied: {result.note}"
    text = f"pinned cache: freed {format_bytes(result.freed)} with {result.call}"
    if result.after is not None:
        text += f", {format_bytes(result.after.in_use)} stays in use"
    if result.rss_before is not None and result.rss_after is not None:
        text += f"; RSS {format_bytes(result.rss_before)} → {format_bytes(result.rss_after)}"
    return text


@renders(WatchSettings)
def render_watch_settings(s: WatchSettings) -> str:
    return (
        f"worker watch: every {s.interval:g} s, at most {s.budget:.1%} of a core; warns at "
        f"{format_bytes(s.min_growth)} per worker"
    )


@renders(HostRun)
def render_host_run(run: HostRun) -> str:
    """``cudamem run``'s host section: this process at exit, the pinned pool, each loader."""
    lines = [f"host at exit ({render_process_memory(run.process)})"]
    if run.pinned is None:
        lines.append(f"  pinned pool: {run.pinned_reason}")
    else:
        lines.extend("  " + line for line in render_pinned(run.pinned).splitlines())
    if not run.loaders:
        lines.append("  DataLoader workers: none seen (num_workers=0, or no DataLoader)")
    else:
        lines.append(
            f"  DataLoader workers: {plural(len(run.loaders), 'loader')}, "
            f"{plural(sum(len(r.workers) for r in run.loaders), 'worker')}; "
            f"{plural(len(run.warnings), 'host memory warning')}"
        )
        for report in run.loaders:
            lines.extend("    " + line for line in render_loader(report).splitlines())
    return "\n".join(lines)


def render_process_trees(trees: tuple[ProcessTree, ...]) -> str:
    """``cudamem status``'s host table: each process, then its children summed."""
    if not trees:
        return "host: no GPU process of this machine to read (pass --pid PID for one)"
    rows = []
    for t in trees:
        m = t.process
        who = f"pid {m.pid}" + (f" {t.name}" if t.name else "")
        if m.rss is None:
            rows.append([who, "n/a", "n/a", "n/a", m.reason or "not measured"])
            continue
        rows.append([who, format_bytes(m.rss), format_bytes(m.pss), format_bytes(m.uss), ""])
        if t.children:
            rows.append(
                [
                    f"  its {plural(len(t.children), 'child', 'children')} (DataLoader workers?)",
                    "n/a",
                    format_bytes(t.children_pss),
                    format_bytes(t.children_uss),
                    "PSS and USS summed (RSS is not: each counts the shared pages)",
                ]
            )
    return render_table(
        ["process", "RSS", "PSS", "USS", "note"], rows, align="lrrrl", title="host memory"
    )


@renders(ProcessTree)
def render_process_tree(tree: ProcessTree) -> str:
    return render_process_trees((tree,))
