"""Under load: does cudamem stay correct and bounded?

  * **1,000,000 spans** in one process (flat, nested and decorated, over 2,000 distinct
    names: twice the history's per-name cap): RSS before, at checkpoints and after, with
    the history's own counts;
  * **8 threads x 10,000 spans** each (flat, nested, and spans another thread exits): every
    span accounted for, ``history()`` counts exact;
  * **a ScalarLogger fed 10,000,000 values** (all kept, and with ``maxlen``): RSS growth per
    value against what the logger says it keeps;
  * **who_holds from 4 threads at once**: the same paths as a call alone.

Spans read the real allocator on a GPU; without one they run over a constant reader (the
same bookkeeping, nothing to measure), which the output says. Not a timed test: the figures
are memory and counts; the seconds are there to size the run.

Usage: ``python benchmarks/soak.py [--quick] [--out benchmarks/results/soak.json]``
(~1-2 minutes; ``--quick`` scales every count down by 10).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import sys
import threading
import time
from typing import Any

import torch
from _common import ConstantReader, machine

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.base.format import format_bytes
from cudamem.render.text import render_table

CUDA = torch.cuda.is_available()
MiB = 1024**2


def rss() -> int:
    """Resident set size of this process, bytes (Linux ``/proc``; else the peak RSS)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def settled_rss() -> int:
    gc.collect()
    return rss()


# --------------------------------------------------------------------------- 1 M spans


def million_spans(total: int) -> dict[str, Any]:
    names = [f"name{i}" for i in range(2000)]
    keep = torch.ones(MiB, device="cuda:0") if CUDA else None

    @cudamem.track("decorated")
    def decorated() -> None:
        pass

    def chunk(start: int, n: int) -> None:
        for i in range(start, start + n):
            k = i % 10
            if k < 6:
                with cudamem.track(names[i % 2000]):
                    pass
            elif k < 8:
                decorated()
            elif k == 8:
                with cudamem.track("outer"), cudamem.track(names[i % 2000]):
                    pass  # two spans
            # k == 9: the nested pair above counted for it

    chunk(0, 20_000)  # warm: the ring is full, every name seen
    cudamem.clear_history()
    checkpoints = [(0, settled_rss())]
    t0 = time.perf_counter()
    step = total // 10
    for done in range(0, total, step):
        chunk(done, step)
        checkpoints.append((done + step, settled_rss()))
    seconds = time.perf_counter() - t0
    hist = cudamem.history()
    calls = sum(s.calls for s in hist.stats)
    expected = total // 10 * 9  # top-level spans: 6 flat + 2 decorated + 1 outer per 10
    del keep
    return {
        "spans": total,
        "top_level_expected": expected,
        "top_level_counted": calls,
        "names_kept": len(hist.stats),
        "ring": len(hist.spans),
        "rss_before": checkpoints[0][1],
        "rss_after": checkpoints[-1][1],
        "rss_checkpoints": checkpoints,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- threads


def threaded_spans(threads: int, per_thread: int) -> dict[str, Any]:
    """Per thread, per 10 spans: 4 flat, a nested pair, 2 exited by a closer thread, and a
    pair whose inner span the closer exits (8 top-level spans)."""
    cudamem.clear_history()
    handoff: queue.Queue[tuple[cudamem.MemorySpan, threading.Event] | None] = queue.Queue()
    errors: list[str] = []
    start = threading.Barrier(threads)

    def closer() -> None:
        while (item := handoff.get()) is not None:
            span, done = item
            span.__exit__(None, None, None)
            done.set()

    def elsewhere(span: cudamem.MemorySpan) -> None:
        done = threading.Event()
        handoff.put((span, done))
        done.wait()

    def worker() -> None:
        try:
            start.wait()
            for _ in range(per_thread // 10):
                for _ in range(4):
                    with cudamem.track("flat"):
                        pass
                with cudamem.track("outer"), cudamem.track("inner"):
                    pass
                for _ in range(2):
                    span = cudamem.track("handoff")
                    span.__enter__()
                    elsewhere(span)
                with cudamem.track("outer2") as outer:
                    inner = cudamem.track("inner2")
                    inner.__enter__()
                    elsewhere(inner)
                if len(outer.children) != 1:
                    errors.append(f"outer2 has {len(outer.children)} children")
        except Exception as exc:  # pragma: no cover - reported
            errors.append(repr(exc))

    closers = [threading.Thread(target=closer) for _ in range(2)]
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for th in closers + workers:
        th.start()
    for th in workers:
        th.join()
    for _ in closers:
        handoff.put(None)
    for th in closers:
        th.join()
    seconds = time.perf_counter() - t0
    per = per_thread // 10
    expected = {"flat": 4 * per, "outer": per, "handoff": 2 * per, "outer2": per}
    expected = {k: v * threads for k, v in expected.items()}
    counted = {s.name: s.calls for s in cudamem.history().stats}
    return {
        "threads": threads,
        "spans": threads * per_thread,
        "expected": expected,
        "counted": counted,
        "exact": counted == expected and not errors,
        "errors": errors[:10],
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- logger


def logger_soak(values: int, maxlen: int | None) -> dict[str, Any]:
    before = settled_rss()
    t0 = time.perf_counter()
    logger = cudamem.ScalarLogger(maxlen=maxlen)
    chunk = [float(i % 1000) for i in range(100_000)]
    for _ in range(values // len(chunk)):
        logger.extend(chunk)
    kept = len(logger)
    stats = getattr(logger, "stats", None)
    said = str(stats() if callable(stats) else stats) if stats is not None else ""
    after = settled_rss()
    seconds = time.perf_counter() - t0
    logger.close()
    del logger
    return {
        "values": values,
        "maxlen": maxlen,
        "kept": kept,
        "rss_growth": after - before,
        "bytes_per_value": (after - before) / max(values, 1),
        "logger_says": said,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- who_holds


class Model:
    def __init__(self, t: torch.Tensor) -> None:
        self.weight = t


HELD: dict[str, Any] = {}


def _hold() -> None:
    """A tensor held by globals only (no frame of this script holds it)."""
    t = torch.ones(256, 256)
    HELD["model"] = Model(t)
    HELD["history"] = [t, t.view(-1)]
    HELD["by_name"] = {"w": t[0]}


def who_holds_from_threads(threads: int) -> dict[str, Any]:
    _hold()
    alone = sorted(cudamem.who_holds(HELD["model"].weight).paths)
    results: list[list[str] | str] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def ask(i: int) -> None:
        start.wait()
        try:
            results[i] = sorted(cudamem.who_holds(HELD["model"].weight).paths)
        except Exception as exc:  # pragma: no cover - reported
            results[i] = repr(exc)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=ask, args=(i,)) for i in range(threads)]
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    seconds = time.perf_counter() - t0
    HELD.clear()
    same = all(r == alone for r in results)
    return {
        "threads": threads,
        "alone": alone,
        "same_paths": same,
        "differing": [r for r in results if r != alone][:3],
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    parser.add_argument("--quick", action="store_true", help="every count divided by 10")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    reader = "the real allocator (cuda:0)" if CUDA else "a constant reader (no CUDA device)"
    backend: Any = _backend.get() if CUDA else ConstantReader()
    data: dict[str, Any] = {"quick": args.quick, "spans_read": reader}
    start_rss = settled_rss()
    with _backend.use(backend):
        print("1,000,000 spans ...", file=sys.stderr)
        data["million_spans"] = million_spans(1_000_000 // scale)
        print("8 threads ...", file=sys.stderr)
        data["threads"] = threaded_spans(8, 10_000 // scale)
    print("ScalarLogger ...", file=sys.stderr)
    data["logger_all"] = logger_soak(10_000_000 // scale, None)
    data["logger_maxlen"] = logger_soak(10_000_000 // scale, 100_000)
    print("who_holds ...", file=sys.stderr)
    data["who_holds"] = who_holds_from_threads(4)
    data["rss_start"], data["rss_end"] = start_rss, settled_rss()

    m, th = data["million_spans"], data["threads"]
    la, lm, wh = data["logger_all"], data["logger_maxlen"], data["who_holds"]
    growth = m["rss_after"] - m["rss_before"]
    rows = [
        [
            f"{m['spans']:,} spans ({m['names_kept']} names kept)",
            f"RSS {format_bytes(m['rss_before'])} -> {format_bytes(m['rss_after'])} "
            f"({format_bytes(growth, signed=True)})",
            "bounded" if growth < 16 * MiB else "GROWS",
        ],
        [
            "  history counts",
            f"{m['top_level_counted']:,} of {m['top_level_expected']:,} top-level; ring {m['ring']}",
            "exact" if m["top_level_counted"] == m["top_level_expected"] else "WRONG",
        ],
        [
            f"{th['threads']} threads x {th['spans'] // th['threads']:,} spans",
            ", ".join(f"{k} {v:,}" for k, v in sorted(th["counted"].items())),
            "exact" if th["exact"] else f"WRONG {th['errors']}",
        ],
        [
            f"ScalarLogger, {la['values']:,} values",
            f"RSS {format_bytes(la['rss_growth'], signed=True)} "
            f"({la['bytes_per_value']:.1f} B/value), keeps {la['kept']:,}",
            la["logger_says"] or "-",
        ],
        [
            f"ScalarLogger(maxlen={lm['maxlen']:,}), {lm['values']:,} values",
            f"RSS {format_bytes(lm['rss_growth'], signed=True)}, keeps {lm['kept']:,}",
            "bounded" if lm["kept"] == lm["maxlen"] and lm["rss_growth"] < 16 * MiB else "GROWS",
        ],
        [
            f"who_holds from {wh['threads']} threads",
            f"{len(wh['alone'])} paths alone",
            "same paths"
            if wh["same_paths"]
            else f"DIFFERENT, e.g. {str(wh['differing'][0])[:160]}...",
        ],
    ]
    print(render_table(["soak", "figure", "verdict"], rows, title=f"soak (spans read {reader})"))
    print(
        f"\nseconds: spans {m['seconds']:.1f}, threads {th['seconds']:.1f}, "
        f"logger {la['seconds'] + lm['seconds']:.1f}, who_holds {wh['seconds']:.1f}"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"machine": machine(), **data}, fh, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
