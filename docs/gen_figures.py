"""Write the benchmark figures the docs quote, from the JSON the benchmarks wrote.

    python docs/gen_figures.py          # benchmarks/results/*.json -> docs/output/figures/*.txt
    python docs/gen_figures.py --check  # exit 1 when a committed file differs from a fresh one

One figure, one home: a figure a page quotes (what a span costs, what `memory_allocated()`
costs, what the module profile adds to a step, ...) is written here from the JSON of the run
that measured it, with the card and torch version of that run, and pages include it with
pymdownx.snippets (``--8<-- "docs/output/figures/spans.txt:reads"``). A new benchmark run
changes the JSON; this script then changes every page that quotes it, and
``tests/unit/test_doc_figures.py`` fails while the committed files lag behind the JSON. The
README, which GitHub renders without snippets, quotes one figure: ``README_FIGURE``'s, checked
by the same test.

Only the standard library is used: the script runs wherever the docs build.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "output" / "figures"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    return data


def card(machine: dict[str, Any]) -> str:
    """ "NVIDIA H200, torch 2.11.0+cu130" (or "CPU only, torch 2.13.0+cpu") from a run's
    ``machine`` record (``benchmarks/_common.py``'s ``machine()``)."""
    gpu = machine.get("gpu")
    where = str(gpu) if gpu else "CPU only"
    return f"{where}, torch {machine['torch']}"


def _us(value: float) -> str:
    return f"{value:.2f} µs"


def _range(xs: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(xs))}–{fmt(max(xs))}"


def _pct(value: float) -> str:
    return f"{value:+.1f} %".replace("-", "−")


def _measured_on(machine: dict[str, Any], how: str, json_name: str) -> str:
    """The source sentence of a figures file: the card, CUDA, how it was run, its JSON."""
    return (
        f"Measured on an {card(machine)}, CUDA {machine['cuda']} ({how}; the JSON is "
        f"`benchmarks/results/{json_name}`)."
    )


def _sections(sections: dict[str, str]) -> str:
    """Snippet sections (``--8<-- [start:name]`` ... ``[end:name]``), one per figure."""
    out: list[str] = ["written by docs/gen_figures.py from benchmarks/results/*.json: do not edit"]
    for name, text in sections.items():
        out += [f"--8<-- [start:{name}]", text.rstrip("\n"), f"--8<-- [end:{name}]"]
    return "\n".join(out) + "\n"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- spans: benchmarks/span_overhead.py ------------------------------------------------------

SPANS_JSON = "span_overhead.json"
VERIFIED_JSON = "gpu-verified.json"

_SPAN_ROWS = (
    ("track() defaults [active reader]", "`track()` with defaults"),
    ("track(peak=False) [active reader]", "`track(peak=False)`"),
    ("@track function call [active reader]", "a call of a `@cudamem.track` function"),
    ("track(), growth detection off [active reader]", "`track()`, growth detection off"),
    ("nested pair, per span [active reader]", "a nested pair, per span"),
    ("track(sync=True) [active reader]", "`track(sync=True)`, idle GPU"),
    ("track() defaults, Python open/close [active reader]", "`track()`, without the span core"),
    ("track() defaults [raw dict]", "`track()`, without the C++ reader"),
    ("minimal Python span (the floor) [active reader]", "the floor: two reads, two clocks"),
)
_READ_ROWS = (
    ("backend.counters(0): active reader", "cudamem's C++ reader: three counters"),
    ("backend.counters_reset_peak(0): active reader", "the same, with the peak reset"),
    ("torch._C._cuda_memoryStats(0)", "`torch._C._cuda_memoryStats(0)`: every counter's dict"),
    ("torch.cuda.memory_allocated(0)", "`torch.cuda.memory_allocated(0)`"),
)
_STEP_COLUMNS = (
    ("track()", "`track()`"),
    ("track(sync=True)", "`track(sync=True)`"),
    ("memory_allocated() before/after", "`memory_allocated()` before and after"),
    ("_record_memory_history()", "`_record_memory_history()`"),
    ("profiler(profile_memory=True)", "`torch.profiler(profile_memory=True)`"),
)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def memory_allocated_us() -> str:
    """One ``torch.cuda.memory_allocated(0)`` call, as the span benchmark measured it."""
    return _us(_median(_load(SPANS_JSON)["readers_us"]["torch.cuda.memory_allocated(0)"]))


def track_us() -> str:
    """One ``track()`` span with defaults, enter and exit, as the span benchmark measured it."""
    return _us(_median(_load(SPANS_JSON)["spans_us"]["track() defaults [active reader]"]))


def readme_figure() -> str:
    """The README's one figure (the README is rendered without snippets)."""
    machine = _load(SPANS_JSON)["machine"]
    return f"a span costs {track_us()} on an {machine['gpu']} (torch {machine['torch']})"


def spans() -> str:
    data = _load(SPANS_JSON)
    machine = data["machine"]
    rounds = len(data["spans_us"]["track() defaults [active reader]"])
    source = (
        f"{machine['gpu']}, torch {machine['torch']}, CUDA {machine['cuda']}, Python "
        f"{machine['python']}; `python benchmarks/span_overhead.py --quick`, medians of "
        f"{rounds} interleaved rounds, range in brackets; the JSON is "
        f"`benchmarks/results/{SPANS_JSON}`"
    )
    reads = _table(
        ["one read", "µs a call"],
        [
            [label, f"{_us(_median(xs))} ({_range(xs, lambda v: f'{v:.2f}')})"]
            for key, label in _READ_ROWS
            for xs in [data["readers_us"][key]]
        ],
    )
    span_rows = _table(
        ["per span, enter and exit", "µs"],
        [
            [label, f"{_us(_median(xs))} ({_range(xs, lambda v: f'{v:.2f}')})"]
            for key, label in _SPAN_ROWS
            for xs in [data["spans_us"][key]]
        ],
    )
    kinds = list(data["steps"].items())
    step_header = ["per training step, over the adjacent bare block"] + [
        f"{name} ({kind['params']['cpu_ms']:.1f} ms CPU / {kind['params']['gpu_ms']:.1f} ms GPU)"
        for name, kind in kinds
    ]
    step_rows = []
    for key, label in _STEP_COLUMNS:
        row = [label]
        for _, kind in kinds:
            ratios = kind["ratios"][key]
            med = (_median(ratios) - 1) * 100
            lo, hi = (min(ratios) - 1) * 100, (max(ratios) - 1) * 100
            row.append(f"{_pct(med)} ({_pct(lo)} to {_pct(hi)})")
        step_rows.append(row)
    verified = _load(VERIFIED_JSON)
    vcard = verified["card"]["name"]
    vtorch = re.search(r"torch([0-9][^-]*)", verified.get("reader_build", {}).get("cache_dir", ""))
    vspan = verified["spans"]["enter_exit"]["track() defaults [active reader]"]["median_us"]
    vfloor = verified["spans"]["enter_exit"]["minimal Python span (the floor) [active reader]"]
    sections = {
        "source": f"Measured on an {source}.",
        "reads": reads,
        "spans": span_rows,
        "steps": _table(step_header, step_rows),
        "verified": (
            f"The last GPU record (`.ci/gpu`, `benchmarks/results/{VERIFIED_JSON}`) ran on an "
            f"{vcard}" + (f" with torch {vtorch.group(1)}" if vtorch else "") + ": `track()` "
            f"with defaults took {_us(vspan)} a span there, against {_us(vfloor['median_us'])} "
            "for the least a Python context manager reading the same counters costs on that "
            "host (the floor: the host's speed, not cudamem's, moves both)."
        ),
        "memory-allocated": (
            f"one `torch.cuda.memory_allocated()` call costs {memory_allocated_us()} "
            f"({machine['gpu']}, torch {machine['torch']}; `benchmarks/results/{SPANS_JSON}`)"
        ),
        "track": (
            f"`track()` with defaults costs {track_us()} a span, enter and exit "
            f"({machine['gpu']}, torch {machine['torch']}; `benchmarks/results/{SPANS_JSON}`)"
        ),
        "readme": readme_figure(),
    }
    return _sections(sections)


# -- the per-module profile: benchmarks/module_profile.py -------------------------------------

MODULES_JSON = "module-profile-c-hooks-h200.json"


def modules() -> str:
    data = _load(MODULES_JSON)
    machine = data["machine"]
    rows = []
    for name, case in data["cases"].items():
        pct = case["overhead_percent"]
        per_call = case["us_per_module_call"]
        bare_ms = _median(case["seconds_per_step"]["bare"]) * 1e3
        rows.append(
            [
                f"{name} ({case['module_calls']} module calls; {case['rounds']} rounds of "
                f"{case['steps_per_block']} steps)",
                f"{bare_ms:.1f} ms",
                "{} ({} to {})".format(*map(_pct, pct["cudamem"][:3])),
                f"{per_call['cudamem'][0]:.1f}",
                _pct(pct["control"][0]),
                _pct(pct["paused"][0]),
                f"{case['memtracker_over_cudamem']:,.0f}×",
            ]
        )
    table = _table(
        [
            "step",
            "bare",
            "cudamem's profile",
            "µs per module call",
            "a second bare copy (noise)",
            "paused (torch's hook dispatch)",
            "`MemTracker`, × cudamem's overhead",
        ],
        rows,
    )
    source = (
        f"Measured on an {card(machine)}, CUDA {machine['cuda']}, with the C++ counter reader "
        f"and the span core serving; `python benchmarks/module_profile.py`, one profile over "
        f"the run, medians over rounds, range in brackets; the JSON is "
        f"`benchmarks/results/{MODULES_JSON}`."
    )
    return _sections({"source": source, "cost": table})


# -- the holder search on a real training heap: benchmarks/holders.py --real ------------------

HOLDERS_GPU_JSON = "holders-real-gpu.json"
HOLDERS_CPU_JSON = "holders-real-cpu.json"
_HOLDER_ROWS = (
    ("who_holds", "`who_holds(one parameter)`, every path"),
    ("objgraph.find_backref_chain", "objgraph `find_backref_chain`, one chain"),
    ("who_holds (Python pass)", "`who_holds`, the Python pass (no compiler)"),
    ("live_tensors(holders=True)", "`live_tensors(holders=True)`"),
    ("leaks(since=span) (culprits)", "naming the culprits of a step that kept its loss"),
    ("find_graph_holders()", "`find_graph_holders()`"),
    ("explain()", "`explain()`"),
    ("dump_snapshot()", "`dump_snapshot()`"),
)


def _seconds(xs: Sequence[float]) -> str:
    return f"{_median(xs):.3f} s ({min(xs):.3f}–{max(xs):.3f})"


def holders() -> str:
    gpu, cpu = _load(HOLDERS_GPU_JSON), _load(HOLDERS_CPU_JSON)

    def column(data: dict[str, Any]) -> str:
        return f"{card(data['machine'])} ({data['gc_objects']:,} gc objects)"

    rows = []
    for key, label in _HOLDER_ROWS:
        cells = [label]
        for data in (gpu, cpu):
            xs = data["seconds"].get(key)
            if key == "explain()" and not data["machine"].get("gpu"):
                cells.append("– (no GPU to explain)")
            else:
                cells.append(_seconds(xs) if xs else "–")
        rows.append(cells)
    for data_key, label in (("step under track(leaks=True)", "a step under `track(leaks=True)`"),):
        cells = [label]
        for data in (gpu, cpu):
            leaky, plain = data["seconds"][data_key], data["seconds"]["step plain"]
            cells.append(
                f"+{_median(leaky) - _median(plain):.2f} s "
                f"({_median(leaky):.3f} s against {_median(plain):.3f} s)"
            )
        rows.append(cells)
    cells = ["`pytest --cudamem`, 60 tiny tests, against plain `pytest`"]
    for data in (gpu, cpu):
        plugin = data["plugin"]
        cells.append(f"{plugin['ratio']:.2f}×")
    rows.append(cells)
    table = _table(["operation", column(gpu), column(cpu)], rows)
    source = (
        "`python benchmarks/holders.py --real --quick`: wall-clock medians and ranges of 3; "
        f"the JSON is `benchmarks/results/{HOLDERS_GPU_JSON}` and `{HOLDERS_CPU_JSON}`."
    )
    return _sections({"source": source, "real": table})


# -- logging a loss each step: benchmarks/scalars.py ------------------------------------------

SCALARS_JSON = "scalars.json"
_SCALAR_METHODS = (
    ("item", "`.item()`"),
    ("detach", "`detach()` kept"),
    ("ScalarLogger", "`ScalarLogger`"),
)


def scalars() -> str:
    data = _load(SCALARS_JSON)
    machine = data["machine"]
    rows = []
    for name, kind in data["kinds"].items():
        row = [
            f"{name}: CPU launch {kind['cpu_launch_ms']:.2f} ms, GPU {kind['gpu_ms']:.2f} ms",
            f"{kind['methods']['none']['median_step_ms']:.2f} ms",
        ]
        for key, _ in _SCALAR_METHODS:
            row.append(_pct((kind["methods"][key]["ratio_vs_none"] - 1) * 100))
        rows.append(row)
    table = _table(["step kind", "no logging"] + [label for _, label in _SCALAR_METHODS], rows)
    source = _measured_on(
        machine,
        f"{data['device']}; `python benchmarks/scalars.py`, CUDA events, methods interleaved, "
        f"median step of {data['repeats']} repeats and its ratio to no logging",
        SCALARS_JSON,
    )
    return _sections({"source": source, "cost": table})


#: The zoo run the fit guide quotes (``python benchmarks/fit.py --out ...``).
FIT_JSON = "fit-zoo.json"
#: The models held out of the rules' tuning (``python benchmarks/fit.py --held-out``).
FIT_HELD_OUT_JSON = "fit-held-out.json"

_FIT_LABELS = {
    "decoder": "decoder LM",
    "encoder": "BERT-base",
    "resnet50": "ResNet-50",
    "convnext": "ConvNeXt",
    "vit": "ViT-S/16",
    "lstm": "LSTM",
    "unet": "UNet",
    "mlp": "MLP, GradScaler",
    "checkpointed": "checkpointed",
    "gpt2": "GPT-2 small",
    "t5": "T5-small",
    "efficientnet": "EfficientNet-B0",
    "swin": "Swin-T",
    "gru": "GRU",
    "moe": "MoE (Mixtral-style)",
    "wav2vec2": "wav2vec 2.0",
    "mobilenetv3": "MobileNetV3-L",
}

#: The fit guide's names for the peers of ``benchmarks/fit.py``.
_PEER_LABELS = {
    "lightning": "Lightning binsearch",
    "lightning max_val": "Lightning binsearch, `max_val` raised",
    "accelerate": "accelerate",
}


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _off(value: float | None) -> str:
    if value is None:
        return "-"
    return _pct(-100 * value).replace("+0.0 ", "0.0 ").replace("−0.0 ", "0.0 ")


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "ran out"


def _zoo(data: dict[str, Any]) -> str:
    """The table of a zoo run: per model, the plan's time, steps, answers, the true largest,
    and the answer under the smaller budget."""
    rows = []
    for name, m in data["models"].items():
        if "largest_0" not in m:
            # the message's first clause: the JSON keeps 120 characters of it
            why = str(m.get("error_message", "failed")).split(";")[0]
            rows.append([_FIT_LABELS.get(name, name), f"no answer: {why}"] + [""] * 9)
            continue
        b = m["budget"]
        worst = m.get("worst_peak_error")
        rows.append(
            [
                _FIT_LABELS.get(name, name),
                f"{m['seconds']:.1f} s",
                f"{m['steps']} / {m['ooms']}",
                _n(m["largest_0"]),
                _n(m["largest_5"]),
                _n(m["true_largest"]),
                _off(m["error"]),
                f"{_yes(m['ran_0'])} / {_yes(m['ran_5'])}",
                "-" if worst is None else _pct(100 * worst),
                f"{_n(b['answer'])} / {_n(b['true_largest'])} / {_off(b['error'])}",
                _yes(b["ran"]),
            ]
        )
    fraction = f"{data['fraction']:.0%}".replace("%", " %")
    return _table(
        [
            "model",
            "plan",
            "steps / OOMs caught",
            "`largest(0)`",
            "`largest(0.05)`",
            "true largest",
            "off",
            "ran at 0 / 0.05",
            "worst peak error ¼ ½ ⅘",
            f"{fraction}: answer / true / off",
            f"{fraction} ran",
        ],
        rows,
    )


def fit() -> str:
    data = _load(FIT_JSON)
    machine = data["machine"]
    zoo = _zoo(data)
    peers = []
    for name, tools in data.get("peers", {}).items():
        truth = data["models"].get(name, {}).get("true_largest")
        plan_seconds = data["models"].get(name, {}).get("seconds")
        for tool, r in tools.items():
            if "error" in r:
                continue
            faster = "-" if not plan_seconds else f"{r['seconds'] / plan_seconds:.1f}×"
            off = None if not truth else (truth - r["answer"]) / truth
            peers.append(
                [
                    _FIT_LABELS.get(name, name),
                    _PEER_LABELS.get(tool, tool),
                    f"{r['seconds']:.1f} s",
                    f"{r['trials']} / {r['ooms']}",
                    _n(r["answer"]),
                    _off(off),
                    faster,
                ]
            )
    peer_table = _table(
        ["model", "tool", "time", "trials / OOMs", "answer", "off the true largest", "plan faster"],
        peers,
    )
    how = f"at {str(data['commit'])[:7]}, TF32 matmuls; `python benchmarks/fit.py`"
    source = _measured_on(machine, how, FIT_JSON)
    held = _load(FIT_HELD_OUT_JSON)
    held_source = _measured_on(
        held["machine"],
        f"at {str(held['commit'])[:7]}, TF32 matmuls; `python benchmarks/fit.py --held-out`",
        FIT_HELD_OUT_JSON,
    )
    return _sections(
        {
            "source": source,
            "zoo": zoo,
            "peers": peer_table,
            "held-out-source": held_source,
            "held-out": _zoo(held),
        }
    )


GENERATORS: dict[str, Callable[[], str]] = {
    "fit.txt": fit,
    "spans.txt": spans,
    "modules.txt": modules,
    "holders.txt": holders,
    "scalars.txt": scalars,
}


def figures() -> dict[str, str]:
    """Every figures file, by name, as this script writes it from the committed JSON."""
    return {name: make() for name, make in GENERATORS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in figures().items():
        path = FIGURES / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(
            "stale: " + ", ".join(stale) + " (run python docs/gen_figures.py)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
