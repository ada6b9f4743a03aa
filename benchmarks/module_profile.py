"""What the per-module profile costs per training step, against PyTorch's ``MemTracker`` and
against no instrumentation, in one interleaved run, measured the way a user runs it; and
whether the two agree.

Steps: GPT-2s built from a transformers config (no download): a 2-layer, 128-wide one at
batch 8 x 128 and GPT-2 small (12 layers, 768 wide, batch 8 x 512 tokens; not in
``--quick``), both with AdamW; a BERT-base (``BertForMaskedLM``, batch 16 x 256, AdamW; not
in ``--quick``) and a torchvision ResNet-18 (batch 32 at 224², SGD with momentum): every
step the goals name, in one run. The two launch-bound steps (the small GPT-2, the ResNet-18)
run 16 steps a block and at least 15 rounds (their blocks are short and their hosts' noise
large); the two large ones ``--steps`` (8) and ``--rounds`` (9). The model is copied: one profile (``track_modules`` with its hooks installed
once) stays on the copy for the whole run, over every profiled block, as a user's profile
stays over a training run; the original runs bare. Each round times one block of
``--steps`` steps per case, back to back: ``bare`` (the original), ``cudamem`` (the
profiled copy), ``cudamem paused`` (the same copy with the profile paused: its hooks still
installed, so the floor of torch's hook dispatch and cudamem's early return), ``control``
(a third copy, bare: how far two bare blocks of one step differ on this host) and
``memtracker`` (``MemTracker`` around each step of the original, its stats reset in
between: it refuses a second iteration otherwise). The order rotates from round to round
(no case always follows the same one); before each block, a garbage collection and one
untimed step (the GPU's clocks up again after the collection's pause). Per-step time is
the block's wall time (synchronized at both ends) over its steps; the overhead is the
median over rounds of each round's ratio to its own bare block, and beside it the same
difference in µs per module call (the module calls of one step, counted once), and the
difference of the fastest blocks (a shared host's noise only adds time).

Agreement: each module's bytes kept by its forward, cudamem's against MemTracker's (its
total at the forward's exit minus at entry), for the same step, each from an emptied cache.

Goals (issue 36, H200): at most 20 µs per module call; ResNet-18 at batch 32 at most +15 %
per step, GPT-2 2 x 128 at most +10 %, GPT-2 small and BERT-base within 1 %; at least 10x
cheaper than MemTracker on every row.

Usage: ``python benchmarks/module_profile.py [--quick] [--rounds N] [--steps N] [--out PATH]``
(default ``benchmarks/results/module-profile.json``)
(``--quick``: the 2-layer GPT-2 and the ResNet-18 only, 9 rounds of 16 steps, about a
minute on an H200. The full run's MemTracker steps on GPT-2 small and BERT-base dominate its
time: with MemTracker in every round it did not finish in six minutes on an H200, hence
MemTracker in every third round by default (``--memtracker-every``). The JSON is written
after each case, marked ``partial``, so that a run cut short keeps what it measured.)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import CUDA, emit, fmt_seconds, write_json

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudamem
from tests.memtracker import memtracker_kept

DEVICE = "cuda" if CUDA else "cpu"


#: A model, the objects MemTracker tracks with it (its optimizer), its step, its label.
Case = tuple[torch.nn.Module, list[Any], Callable[[], None], str]


def gpt2_case(quick: bool) -> Case:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if quick:
        shape = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 8192}
        batch, seq = 8, 128
    else:
        shape = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
        batch, seq = 8, 512
    if not CUDA:
        shape.update(n_layer=2, n_embd=64, n_head=2, vocab_size=512)
        batch, seq = 2, 32
    config = transformers.GPT2Config(n_positions=max(seq, 128), **shape)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=DEVICE)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    label = f"GPT-2 {shape['n_layer']}x{shape['n_embd']}, batch {batch}x{seq}"
    return model, [opt], step, label


def bert_case() -> Case:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    batch, seq = (16, 256) if CUDA else (2, 32)
    if CUDA:
        config = transformers.BertConfig()  # BERT-base: 12 layers, 768 wide
    else:
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128
        )
    model = transformers.BertForMaskedLM(config).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    label = f"BERT {config.num_hidden_layers}x{config.hidden_size}, batch {batch}x{seq}"
    return model, [opt], step, label


def resnet_case() -> Case:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch, side = (32, 224) if CUDA else (2, 64)
    x = torch.randn(batch, 3, side, side, device=DEVICE)
    y = torch.randint(0, 1000, (batch,), device=DEVICE)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return model, [opt], step, f"ResNet-18, batch {batch} at {side}²"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _fresh_cache() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def ready_paths() -> dict[str, str]:
    """Build the C++ counter reader and the compiled span core now, as a run has them a
    minute in (both build in the background at first use; until then every read takes the
    dict path, 11-22 µs, and every span the Python open and close); what serves, in words."""
    from cudamem.allocator import backend as _backend
    from cudamem.spans import span

    out = {}
    if CUDA:
        torch.empty(1, device="cuda")
        reader = _backend.build_reader()
        out["counter reader"] = f"{reader.reader} ({reader.state}: {reader.reason})"
    core = span.span_core_status(wait=120)
    out["span core"] = f"{core.state} ({core.reason})"
    return out


def module_calls(step: Callable[[], None]) -> int:
    """Module calls in one step (the profile hooks every module of the model)."""
    calls = [0]

    def count(module: torch.nn.Module, args: Any) -> None:
        calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        step()
    finally:
        handle.remove()
    return calls[0]


def time_cases(
    case: Case, twin: Case, control: Case, steps: int, rounds: int, memtracker_every: int = 1
) -> tuple[dict[str, list[float]], float]:
    """Seconds per step of each case, one block per case per round, interleaved; and the
    seconds the profile took to install and remove its hooks, once for the whole run
    (outside every block's time: a profile is meant to run over many steps). ``twin`` is a
    copy of ``case``'s model and step: the one profile stays on it throughout; ``control``
    another copy, run bare: how far two bare blocks of the same step differ here.
    MemTracker's block runs in every ``memtracker_every``-th round only (its steps cost ten
    to a thousand times a bare one); ``memtracker_bare`` holds those rounds' bare blocks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, external, step, _ = case
    twin_model, twin_external, twin_step, _ = twin
    tracker = MemTracker()
    tracker.track_external(model, *external)

    def timed(run: Callable[[], None]) -> float:
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        _sync()
        return time.perf_counter() - t0

    def tracked() -> None:  # MemTracker is entered per iteration: it refuses a second one
        tracker.reset_mod_stats()
        with tracker:
            step()

    s0 = time.perf_counter()
    prof = cudamem.track_modules(twin_model, optimizer=twin_external).start()
    setup = time.perf_counter() - s0

    def profiled() -> None:
        prof.resume()
        twin_step()

    def paused() -> None:
        prof.pause()
        twin_step()

    cases = {
        "bare": step,
        "control": control[2],
        "cudamem": profiled,
        "paused": paused,
        "memtracker": tracked,
    }
    out: dict[str, list[float]] = {k: [] for k in cases}
    out["memtracker_bare"] = []
    names = list(cases)
    try:
        for run in cases.values():  # warm every path
            timed(run)
        started = time.perf_counter()
        for r in range(rounds):
            _progress(f"round {r + 1}/{rounds}, {time.perf_counter() - started:.0f} s in")
            order = names[r % len(names) :] + names[: r % len(names)]
            if r % memtracker_every:
                order.remove("memtracker")
            for name in order:
                gc.collect()
                cases[name]()  # untimed: the GPU's clocks up again after the collection
                out[name].append(timed(cases[name]) / steps)
            if "memtracker" in order:
                out["memtracker_bare"].append(out["bare"][-1])
    finally:
        prof.resume()
        s0 = time.perf_counter()
        prof.stop()
        setup += time.perf_counter() - s0
    return out, setup


def _progress(line: str) -> None:
    """A progress line on stderr (a full run takes minutes; the table comes at the end)."""
    print(f"  {line}", file=sys.stderr, flush=True)


def _bare(case: str) -> str:
    """The bare blocks of the rounds ``case`` ran in."""
    return "memtracker_bare" if case == "memtracker" else "bare"


def overhead(times: dict[str, list[float]], case: str) -> tuple[float, float, float]:
    """(median, min, max) percent over the same round's bare block."""
    ratios = [(c / b - 1) * 100 for c, b in zip(times[case], times[_bare(case)], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def per_module_call(
    times: dict[str, list[float]], case: str, calls: int
) -> tuple[float, float, float]:
    """(median, min, max) µs per module call over the same round's bare block."""
    diffs = [(c - b) / calls * 1e6 for c, b in zip(times[case], times[_bare(case)], strict=True)]
    return statistics.median(diffs), min(diffs), max(diffs)


def best_per_call(times: dict[str, list[float]], case: str, calls: int) -> float:
    """µs per module call, the case's fastest block over the fastest bare block: the noise
    of a shared host only ever adds time, so the best blocks bound what the case costs
    with the least of it."""
    return (min(times[case]) - min(times["bare"])) / calls * 1e6


def agreement(
    model: torch.nn.Module, external: list[Any], step: Callable[[], None]
) -> dict[str, Any]:
    """cudamem's and MemTracker's kept bytes per module for one step each, each from an
    emptied cache, so that neither depends on the cache state the timed blocks leave (the
    allocator counts a block it reuses unsplit at the block's size, MemTracker the
    tensor's)."""
    _fresh_cache()
    with cudamem.track_modules(model, optimizer=external) as prof:
        step()
    if prof.profile.unmeasured:
        return {"modules": [], "worst_relative_difference_at_1MiB": None, "compared": 0}
    _fresh_cache()
    theirs = memtracker_kept(model, external, step, DEVICE)
    rows = []
    for row in prof.profile.modules:
        ref = theirs.get(row.name)
        if ref is None:
            continue
        rows.append({"module": row.name, "cudamem": int(row.kept.max), "memtracker": ref})
    big = [r for r in rows if max(abs(r["cudamem"]), abs(r["memtracker"])) >= 1 << 20]
    worst = max(
        (abs(r["cudamem"] - r["memtracker"]) / max(abs(r["memtracker"]), 1) for r in big),
        default=0.0,
    )
    return {"modules": rows, "worst_relative_difference_at_1MiB": worst, "compared": len(big)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/module-profile.json")
    parser.add_argument("--rounds", type=int, help="rounds of blocks (default 9)")
    parser.add_argument("--steps", type=int, help="steps per block (default 16 quick, 8 full)")
    parser.add_argument(
        "--memtracker-every",
        type=int,
        help="time MemTracker in every Nth round (default 1 quick, 3 full: its steps are slow)",
    )
    args = parser.parse_args()
    for flag in ("rounds", "steps", "memtracker_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    paths = ready_paths()
    every = args.memtracker_every or (1 if args.quick else 3)
    rounds = args.rounds or 9
    steps = args.steps or (16 if args.quick else 8)
    # Each case with its rounds and steps: the launch-bound ones more of both in a full run.
    small = (args.rounds or (9 if args.quick else 15), args.steps or 16)
    makers: list[tuple[Callable[[], Case], tuple[int, int]]] = [(lambda: gpt2_case(True), small)]
    if not args.quick:
        makers += [(lambda: gpt2_case(False), (rounds, steps)), (bert_case, (rounds, steps))]
    makers.append((resnet_case, small))
    rows: list[list[str]] = []
    data: dict[str, Any] = {
        "rounds": rounds,
        "steps_per_block": steps,
        "launch_bound_rounds_and_steps": list(small),
        "memtracker_every": every,
        "device": DEVICE,
        "paths": paths,
        "cases": {},
    }
    for maker, (case_rounds, case_steps) in makers:
        try:
            # The same seed: equal models and batches.
            case, twin, control = maker(), maker(), maker()
        except ImportError as exc:
            print(f"{exc.name} is not installed: its rows are skipped")
            continue
        model, external, step, label = case
        _progress(f"{label}: {case_rounds} rounds of {case_steps} steps")
        step()  # the optimizer's state exists before anything is timed
        twin[2]()
        control[2]()
        calls = module_calls(step)
        times, setup = time_cases(case, twin, control, case_steps, case_rounds, every)
        measured = ("control", "cudamem", "paused", "memtracker")
        pcts = {name: overhead(times, name) for name in measured}
        ours, theirs = pcts["cudamem"], pcts["memtracker"]
        ratio = theirs[0] / ours[0] if ours[0] > 0 else None
        per_call = {name: per_module_call(times, name, calls) for name in measured}
        best = {name: best_per_call(times, name, calls) for name in measured}
        for name in ("bare", "control", "cudamem", "paused", "memtracker"):
            if name == "bare":
                pct = us = fastest = ""
            else:
                pct = "{:+.1f} % ({:+.1f} to {:+.1f})".format(*pcts[name])
                us = "{:.1f} ({:.1f} to {:.1f})".format(*per_call[name])
                fastest = f"{best[name]:.1f}"
            first = f"{label} ({calls} module calls)" if name == "bare" else ""
            shown_name = {
                "paused": "cudamem, paused (hooks installed)",
                "control": "bare, a second copy (the noise)",
            }.get(name, name)
            rows.append([first, shown_name, fmt_seconds(times[name]), pct, us, fastest])
        shown = "n/a (cudamem's median is not above bare)" if ratio is None else f"{ratio:.1f}x"
        rows.append(["", "MemTracker / cudamem overhead", "", shown, "", ""])
        rows.append(
            ["", "cudamem hooks installed + removed", fmt_seconds([setup]), "once per run", "", ""]
        )
        agree = agreement(model, external, step)
        worst = agree["worst_relative_difference_at_1MiB"]
        rows.append(
            [
                "",
                "kept per module vs MemTracker",
                f"{agree['compared']} modules >= 1 MiB",
                "not measured (no CUDA)" if worst is None else f"worst {worst * 100:.2f} %",
                "",
                "",
            ]
        )
        data["cases"][label] = {
            "rounds": case_rounds,
            "steps_per_block": case_steps,
            "module_calls": calls,
            "seconds_per_step": times,
            "overhead_percent": pcts,
            "us_per_module_call": per_call,
            "us_per_module_call_best_blocks": best,
            "memtracker_over_cudamem": ratio,
            "cudamem_install_and_remove_seconds": setup,
            "agreement": agree,
        }
        write_json({**data, "partial": "cases measured so far"}, args.out)
        del model, external, step, case, twin, control
        _fresh_cache()
    emit(
        "per-module profile: time per step (median, range over rounds), interleaved, "
        "one profile over the whole run",
        [
            "step",
            "case",
            "time per step",
            "over bare",
            "µs per module call",
            "µs per call, best blocks",
        ],
        rows,
        data,
        args.out,
    )
    for name, status in paths.items():
        print(f"{name}: {status}")


if __name__ == "__main__":
    main()
