"""cudamem's own Python per span, without a GPU: enter, exit, exit hooks, history fold.

The real backend (``TorchBackend``) is installed at the ``_backend`` seam with a stub in
place of the C++ counter reader: one "device" with a context, whose three counters are a
constant tuple returned by a C-level call (about what the C++ reader costs minus the
allocator's own work). So every line of cudamem's hot path runs as on a GPU host whose C++
reader is active, and what is measured is cudamem's Python.

Cases, interleaved round by round (many short rounds: the figures are medians and ranges
over rounds, robust to a busy shared machine):

  * floors: a bare function call, ``with contextlib.nullcontext():``, and a minimal Python
    span (two counter reads, two clock reads);
  * enter+exit of ``with cudamem.track("s"):`` and ``with cudamem.MemorySpan("s"):`` (the
    defaults), ``track(peak=False)``, a decorated call, a nested pair (per span), and
    ``track()`` with no exit hooks registered (the difference is what the hooks cost);
  * phases of ``track()`` with defaults, timed with a clock read between them (the clock's own
    cost subtracted): enter (``track()`` plus ``__enter__``) and exit (``__exit__``);
  * each exit hook called on its own on a closed span (growth detection, history, OOM), and
    the history's fold per span (a drain of a full inbox into the ring and the aggregates).

Usage: ``python benchmarks/span_python.py [--rounds 300] [--out ...json]``.
``--baseline DIR`` compares against another checkout (e.g. ``git worktree add /tmp/base
main``): the two trees run alternately, ``--alternate`` times each, in fresh processes, and
the table shows before and after side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _stub_backend() -> Any:
    """The real ``TorchBackend`` with one device that has a context and a stub C++ reader."""
    from cudamem.allocator import torch_backend as _torch_backend

    backend = _torch_backend.TorchBackend()
    counters = {0: (1 << 20, 2 << 20, 1 << 20)}.__getitem__
    backend._with_context = (0,)
    backend._all_contexts = True
    backend.settled_devices = backend._with_context  # as once every device has a context
    backend._count = 1
    backend._reader_pending = False
    backend.fast_counters = counters
    backend.fast_reset = counters
    if hasattr(backend, "_fast_counters"):  # a checkout from before the seam's public names
        backend._fast_counters = backend._fast_reset = counters
    return backend


def _cases() -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[int], float]]]:
    """(loop cases: one call = one unit; direct cases: ``f(n)`` -> µs per unit)."""
    import cudamem
    from cudamem.spans import history as _history
    from cudamem.spans import state as _spans_state

    leaks = importlib.import_module(
        "cudamem.growth.detector"
    )  # ``cudamem.leaks`` is also a function
    oom = importlib.import_module("cudamem.ledger.oom_guard")

    track, memory_span = cudamem.track, cudamem.MemorySpan
    counters = _backend_now().counters
    now = time.perf_counter_ns

    def bare() -> None:
        pass

    def nullctx() -> None:
        with contextlib.nullcontext():
            pass

    class Minimal:
        __slots__ = ("after", "before", "end", "start")

    def minimal() -> None:
        m = Minimal()
        m.before = counters(0)
        m.start = now()
        m.end = now()
        m.after = counters(0)

    def defaults() -> None:
        with track("s"):
            pass

    def memspan() -> None:
        with memory_span("s"):
            pass

    def no_peak() -> None:
        with track("s", peak=False):
            pass

    @track("decorated")
    def decorated() -> None:
        pass

    def nested() -> None:
        with track("outer"), track("inner"):
            pass

    saved_hooks = list(_spans_state._exit_hooks)

    loop: dict[str, Callable[[], object]] = {
        "bare function call": bare,
        "with nullcontext()": nullctx,
        "minimal Python span (floor)": minimal,
        "track() defaults": defaults,
        "MemorySpan() defaults": memspan,
        "track(peak=False)": no_peak,
        "@track function call": decorated,
        "nested pair (2 spans)": nested,
    }

    errors_only = set(_spans_state._errors_only)
    # The history's queue.
    saved_sink = _spans_state.STATE.finished_sink

    def without_hooks(n: int) -> float:
        for hook, _ in saved_hooks:
            _spans_state.remove_exit_hook(hook)
        if saved_sink is not None:
            _spans_state.set_finished_sink(None)
        try:
            t0 = now()
            for _ in range(n):
                with track("s"):
                    pass
            return (now() - t0) / n / 1e3
        finally:
            for hook, propagate in saved_hooks:
                _spans_state.add_exit_hook(
                    hook, propagate=propagate, errors_only=hook in errors_only
                )
            if saved_sink is not None:
                _spans_state.set_finished_sink(saved_sink)

    def clock_pair(n: int) -> float:
        total = 0
        for _ in range(n):
            t0 = now()
            t1 = now()
            total += t1 - t0
        return total / n / 1e3

    def enter(n: int) -> float:
        total = 0
        for _ in range(n):
            t0 = now()
            s = track("s")
            s.__enter__()
            t1 = now()
            s.__exit__(None, None, None)
            total += t1 - t0
        return total / n / 1e3 - _clock[0]

    def exit_(n: int) -> float:
        total = 0
        for _ in range(n):
            s = track("s")
            s.__enter__()
            t0 = now()
            s.__exit__(None, None, None)
            t1 = now()
            total += t1 - t0
        return total / n / 1e3 - _clock[0]

    with track("s") as closed:
        pass
    raw = closed._raw

    def hook(fn: Callable[[Any], None]) -> Callable[[int], float]:
        def run(n: int) -> float:
            t0 = now()
            for _ in range(n):
                fn(raw)
            return (now() - t0) / n / 1e3

        return run

    def history_queue(n: int) -> float:
        """What a top-level span's exit does for the history (``span._close`` inline)."""
        queue, at, sink = _spans_state.finished, _spans_state.FINISHED_AT, saved_sink
        t0 = now()
        for _ in range(n):
            queue.append(raw)
            if len(queue) >= at and sink is not None:
                sink()
        return (now() - t0) / n / 1e3

    def fold(n: int) -> float:
        ring = _history._ring
        batch = max(1, min(n, _history.DRAIN_AT))
        total, done = 0, 0
        while done < n:
            with ring.lock:
                ring.drain()
                ring.inbox.extend([raw] * batch)
                t0 = now()
                ring.drain()
                total += now() - t0
            done += batch
        return total / done / 1e3

    direct: dict[str, Callable[[int], float]] = {
        "track(), no exit hooks": without_hooks,
        "phase: enter (track() + __enter__)": enter,
        "phase: exit (__exit__)": exit_,
        "hook: growth detection": hook(leaks._on_span_exit),
        "history (append + fold every 256)": history_queue,
        "hook: OOM": hook(oom._on_span_exit),  # called alone: spans that did not raise skip it
        "history fold, per span (drain of 256)": fold,
    }
    direct["(clock pair)"] = clock_pair
    return loop, direct


_clock = [0.0]


def _backend_now() -> Any:
    from cudamem.allocator import backend as _backend

    return _backend.get()


def measure(rounds: int, per_round: int) -> dict[str, list[float]]:
    """µs per unit of every case, ``rounds`` interleaved rounds of ``per_round`` units."""
    import cudamem
    from cudamem.allocator import backend as _backend

    with _backend.use(_stub_backend()):
        loop, direct = _cases()
        for fn in loop.values():  # warm up (growth detection reaches its steady state)
            for _ in range(2000):
                fn()
        out: dict[str, list[float]] = {name: [] for name in (*loop, *direct)}
        now = time.perf_counter_ns
        for _ in range(rounds):
            _clock[0] = direct["(clock pair)"](per_round)
            out["(clock pair)"].append(_clock[0])
            for name, fn in loop.items():
                t0 = now()
                for _ in range(per_round):
                    fn()
                out[name].append((now() - t0) / per_round / 1e3)
            for name, run in direct.items():
                if name != "(clock pair)":
                    out[name].append(run(per_round))
            cudamem.clear_history()
            gc.collect()
        out["nested pair, per span"] = [x / 2 for x in out.pop("nested pair (2 spans)")]
    return out


def _q1(xs: list[float]) -> float:
    """The lower quartile: on a shared machine many rounds run on a contended core (about
    twice as slow); the uncontended rounds are the lower half."""
    return statistics.quantiles(xs, n=4)[0] if len(xs) >= 4 else min(xs)


def _summary(xs: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs),
        "q1": _q1(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def _cell(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {_q1(xs):.3f} / {statistics.median(xs):.3f}"


def _table(columns: dict[str, dict[str, list[float]]]) -> str:
    from cudamem.render.text import render_table

    first = next(iter(columns.values()))
    names = list(first)
    headers = ["case (µs per span)", *[f"{c}: min / q1 / median" for c in columns]]
    rows = [
        [name, *[_cell(col[name]) if col.get(name) else "" for col in columns.values()]]
        for name in names
    ]
    if len(columns) == 2:
        before, after = columns.values()
        headers.append("after / before (q1)")
        for row, name in zip(rows, names, strict=True):
            b, a = before.get(name), after.get(name)
            row.append(f"{_q1(a) / _q1(b):.2f}" if a and b and _q1(b) > 0 else "")
    return render_table(
        headers, rows, title="cudamem's Python per span (CPU harness, stub C++ reader)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--per-round", type=int, default=400, help="spans per case per round")
    parser.add_argument("--out", default="benchmarks/results/span_python.json")
    parser.add_argument("--baseline", help="another checkout to compare against")
    parser.add_argument("--alternate", type=int, default=4, help="runs of each tree")
    parser.add_argument("--json-stdout", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.json_stdout:
        print(json.dumps(measure(args.rounds, args.per_round)))
        return

    if args.baseline:
        trees = {"before": os.path.abspath(args.baseline), "after": ROOT}
        samples: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
        per_run = max(1, args.rounds // args.alternate)
        for i in range(args.alternate):
            for label, tree in trees.items() if i % 2 == 0 else reversed(trees.items()):
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, os.path.abspath(__file__), "--json-stdout"]
                cmd += ["--rounds", str(per_run), "--per-round", str(args.per_round)]
                done = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True)
                for name, xs in json.loads(done.stdout).items():
                    samples[label].setdefault(name, []).extend(xs)
                print(f"  run {i + 1}/{args.alternate}: {label} done", file=sys.stderr)
        columns = samples
    else:
        sys.path.insert(0, ROOT)
        columns = {"this tree": measure(args.rounds, args.per_round)}

    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from _common import machine

    print(_table(columns))
    print(
        "\nphases: clock reads subtracted; hooks: each called alone on a closed span; "
        "figures are CPU time of cudamem's Python on this machine, not a GPU's."
    )
    data = {
        "machine": machine(),
        "rounds": args.rounds,
        "per_round": args.per_round,
        "baseline": args.baseline,
        "cases_us": {
            label: {k: _summary(v) for k, v in col.items()} for label, col in columns.items()
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
