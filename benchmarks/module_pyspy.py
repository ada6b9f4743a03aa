"""Where a profiled step's host time goes, by a sampling profiler (py-spy), in µs per module
call: the per-module profile's own functions, torch's hook dispatch, the rest of the step.

Two parts, run one after the other:

- ``run``: the 2-layer GPT-2 of ``module_profile.py --quick`` (2 x 128, batch 8 x 128,
  AdamW; or ``--case resnet-tree``, ``module_cost.py``'s ResNet-18 at batch 2) trains for
  ``--seconds`` under ``cudamem.track_modules`` (or bare with
  ``--bare``), steps synchronized, and writes how many steps it ran in how long. Run it
  under py-spy: ``py-spy record -r 1000 -f raw -o spy.txt -- python
  benchmarks/module_pyspy.py run --json run.json``.
- ``table``: reads py-spy's raw stacks and the run's JSON and prints, per function, its
  share of the sampled time and its µs per module call (share x seconds per step / module
  calls per step), self and inclusive: ``python benchmarks/module_pyspy.py table spy.txt
  run.json [--json out.json]``.

py-spy samples Python threads: on a GPU the autograd engine's device thread runs the
backward in C++ and shows only where it calls into Python (those samples are counted as the
loop's time: its thread waits in the backward meanwhile); the C++ gates run there with no
Python and do not show. The step's own Python work (the model's forward, the optimizer)
shows as the rest.

With ``py-spy record --native --threads`` the C++ frames show too: the table then adds the
native parts (the C++ gates, the allocator's counter reads and peak resets, the log's
writes and replay) and the autograd engine's thread, each as a share of the loop's wall
time and in µs per module call. The engine's thread runs beside the loop's (which waits in
the backward meanwhile): its rows say how busy it was, not time added to the loop's. On an
H200 host ``--native`` paused the process for every native stack it unwound (a 6 ms step
took 395 ms): its shares are then not the step's; ``module_units.py`` times the parts alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

#: Function groups of the table (by the function's name and file as py-spy writes them).
GROUPS = [
    ("cudamem: forward pre-hook", r"^ModuleProfiler\._pre \(.*modules\.py"),
    ("cudamem: forward post-hook", r"^ModuleProfiler\._post \(.*modules\.py"),
    ("cudamem: log replay", r"^ModuleProfiler\._replay \(.*modules\.py"),
    ("cudamem: figures added up", r"^ModuleProfiler\._add_(forward|backward) \("),
    ("cudamem: end of backward", r"^ModuleProfiler\._native_(ended|backward) \("),
    ("cudamem: step end", r"^ModuleProfiler\._end_step \("),
    ("cudamem: state reads", r"^ModuleProfiler\._read_state \("),
    ("cudamem: grad search", r"^_grad_tensor \(.*modules\.py"),
    ("cudamem: any", r"\(.*cudamem/"),
    ("torch: hook dispatch (_call_impl's inner)", r"^Module\._call_impl\.<locals>\.inner \("),
    ("torch: is_compiling", r"^is_compiling \("),
]

#: Native parts (``py-spy --native``), by any frame of the sample.
NATIVE_GROUPS = [
    ("C++: gate hooks on autograd nodes (GateHook)", r"GateHook"),
    ("C++: the log's counter reads (gate_read, read_locked)", r"gate_read|read_locked"),
    ("C++: allocator counter reads", r"getDeviceStats"),
    ("C++: allocator peak resets", r"resetPeakStats"),
    ("C++: the log's replay (log_replay)", r"log_replay"),
    ("C++: autograd pre-hooks run by the engine", r"call_pre_hooks|call_tensor_pre_hooks"),
]
#: A sample of the autograd engine's own thread.
ENGINE_THREAD = r"Engine::thread_main|Engine::thread_init"


def run(seconds: float, bare: bool, out: str, case: str) -> None:
    from module_profile import _sync as sync
    from module_profile import gpt2_case, module_calls, ready_paths

    import cudamem

    paths = ready_paths()  # the C++ reader built first, as a run has it a minute in

    if case == "gpt2":
        model, external, step, label = gpt2_case(True)
    else:
        from module_cost import resnet_case

        label, model, external, step = resnet_case()
    for _ in range(3):
        step()
    calls = module_calls(step)
    prof = None if bare else cudamem.track_modules(model, optimizer=external).start()
    for _ in range(3):
        step()
    sync()
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            step()
        sync()
        steps += 8
    wall = time.perf_counter() - t0
    native = prof is not None and prof._native is not None
    if prof is not None:
        prof.stop()
    data = {
        "case": label,
        "bare": bare,
        "steps": steps,
        "seconds": wall,
        "module_calls": calls,
        "paths": paths,
        "c++ log": native,
    }
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    print(json.dumps(data))


def table(raw: str, run_json: str, out: str | None) -> None:
    with open(run_json, encoding="utf-8") as fh:
        info = json.load(fh)
    per_step = info["seconds"] / info["steps"]
    calls = info["module_calls"]
    total = engine = 0
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    native_n: collections.Counter[str] = collections.Counter()
    with open(raw, encoding="utf-8") as fh:
        for line in fh:
            found = re.match(r"^(.*) (\d+)$", line.rstrip("\n"))
            if found is None:  # a frame name with a line break in it: not a sample line
                continue
            stack, n = found.group(1), int(found.group(2))
            frames = stack.split(";")
            loop = "module_pyspy.py" in stack and "run (" in stack
            in_engine = not loop and re.search(ENGINE_THREAD, stack) is not None
            if in_engine:
                engine += n
            if loop or in_engine:
                for label, pattern in NATIVE_GROUPS:
                    if re.search(pattern, stack):
                        native_n[label] += n
            if loop:
                total += n  # the timed loop's thread
            elif "cudamem/" not in stack:
                continue  # set-up, imports, idle threads
            # else: the autograd engine's thread calling into the profile, while the loop's
            # thread waits in the backward: counted as the loop's time, as it is.
            leaf = frames[-1]
            for label, pattern in GROUPS:
                if re.search(pattern, leaf):
                    self_n[label] += n
                if any(re.search(pattern, f) for f in frames):
                    incl_n[label] += n
    rows = []
    for label, _ in GROUPS:
        s, i = self_n[label] / max(total, 1), incl_n[label] / max(total, 1)
        rows.append(
            {
                "part": label,
                "self_share": s,
                "inclusive_share": i,
                "self_us_per_call": s * per_step / calls * 1e6,
                "inclusive_us_per_call": i * per_step / calls * 1e6,
            }
        )
    if engine or native_n:
        for label, n in [("autograd engine thread: every sample", engine)] + [
            (label, native_n[label]) for label, _ in NATIVE_GROUPS
        ]:
            share = n / max(total, 1)
            rows.append(
                {
                    "part": label,
                    "self_share": None,
                    "inclusive_share": share,
                    "self_us_per_call": None,
                    "inclusive_us_per_call": share * per_step / calls * 1e6,
                }
            )
    head = (
        f"{info['case']}: {info['steps']} steps, {per_step * 1e3:.2f} ms a step, "
        f"{calls} module calls a step, {total} samples in the loop"
    )
    print(head)
    print(f"{'part':45} {'self %':>7} {'incl %':>7} {'self µs/call':>13} {'incl µs/call':>13}")
    for r in rows:
        self_pct = "" if r["self_share"] is None else f"{r['self_share'] * 100:.1f}"
        self_us = "" if r["self_us_per_call"] is None else f"{r['self_us_per_call']:.2f}"
        print(
            f"{r['part']:45} {self_pct:>7} {r['inclusive_share'] * 100:7.1f} "
            f"{self_us:>13} {r['inclusive_us_per_call']:13.2f}"
        )
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"run": info, "samples": total, "rows": rows}, fh, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seconds", type=float, default=20.0)
    r.add_argument("--bare", action="store_true")
    r.add_argument("--json", default="module-pyspy-run.json")
    r.add_argument(
        "--case",
        choices=["gpt2", "resnet-tree"],
        default="gpt2",
        help="gpt2: module_profile.py --quick's GPT-2; resnet-tree: module_cost.py's ResNet-18",
    )
    t = sub.add_parser("table")
    t.add_argument("raw")
    t.add_argument("run_json")
    t.add_argument("--json")
    args: Any = parser.parse_args()
    if args.cmd == "run":
        run(args.seconds, args.bare, args.json, args.case)
    else:
        table(args.raw, args.run_json, args.json)


if __name__ == "__main__":
    main()
