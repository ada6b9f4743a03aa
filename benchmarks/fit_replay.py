"""``cudamem.plan``'s search rules replayed on the CPU over a zoo run of ``benchmarks/fit.py``:
what another set of constants would have done on the same models, without a GPU.

A zoo run (``benchmarks/results/fit-zoo.json``) records, for each model, every step the plan
ran (size, role, peaks, out of memory or not), the measured peaks at ¼, ½ and ⅘ of its
answer, and the true largest batch (plain steps, bisected). The replay runs
``cudamem.fit._steps.search`` (the function ``cudamem.plan`` runs) with a ``run`` that answers
from that record:

* a warm-up, probe or check the GPU run also made (same size and role, in order) is answered
  with what it measured;
* any other step (a confirming step at another size, a probe the GPU run did not grow to) runs
  when its batch is at most the true largest and runs out of memory above it; its peak
  allocated is interpolated between the nearest measured peaks (linear in the batch). One
  that runs out of memory within 0.5 % of a batch where the GPU's did carries what that
  one reserved and asked for when it failed, scaled to its batch; any other carries
  neither.

What it cannot know: a confirming step runs after other steps, not from an empty cache as the
true largest's plain steps did, and the true largest moves by a few samples from run to run.
The replay of the rules the GPU run ran (``RECORDED``) therefore says whether it ran the same
steps as the GPU did (same count, the out-of-memory steps at the same places in the order);
where it does not, the replay of that model says little about the other variants.

Each replay also names the batch for the record's smaller budget (``budget_answer``: what
``MemoryPlan.largest_for(cap, margin=0)`` names from the replayed plan), against the true
largest the GPU found under that cap.

Beside the variants, ``failures`` reads each confirming step that ran out of memory on the GPU:
its message (what the process had in use, what was free, what it tried to allocate), what it
reserved, and the batch that would have left room for that request had both grown with the
batch (the plan's ``_room``), against the true largest.

Usage: ``python benchmarks/fit_replay.py [--zoo benchmarks/results/fit-zoo.json]
[--out benchmarks/results/fit-replay.json]``. No GPU; about a second.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import emit

from cudamem.base.format import format_bytes
from cudamem.fit import _steps
from cudamem.fit._terms import HEADROOM, terms_for
from cudamem.fit.memory_plan import MemoryPlan, NotLinearError, Probe
from cudamem.ledger.oom import parse_oom_message
from cudamem.render.text import render_table

#: The constants tried, each against today's (``as landed``): the rule each stands for is in
#: ``cudamem/fit/_steps.py``'s docstring.
VARIANTS: dict[str, dict[str, float]] = {
    "as landed": {},
    "room only lowers": {"AIM_AT_ROOM": False},
    "no room read": {"READ_ROOM": False},
    "bracket 2.5 %": {"BRACKET": 0.025},
    "bracket 3 %": {"BRACKET": 0.03},
    "step down 10 %": {"STEP_DOWN": 0.10},
    "step down 3 %": {"STEP_DOWN": 0.03},
    "confirm close 2 %": {"CONFIRM_CLOSE": 0.02},
    "prior allowance 2 %": {"ALLOWANCE": 0.02},
    "prior allowance 0.5 %": {"ALLOWANCE": 0.005},
}

#: The rules the GPU run in the record ran (712b113: ``READ_ROOM`` on, ``AIM_AT_ROOM``
#: off): the replay of these is the one that should run the steps the GPU did.
RECORDED = "room only lowers"

#: How far (a share of the batch) a replayed failure may be from one of the GPU run's and
#: still take its reserved bytes and request, scaled.
NEAR = 0.005

#: The default probes of ``cudamem.plan`` (``sizes=(4, 8)``) and its first check.
SCHEDULE = (4, 8)
CHECK = 16


@contextlib.contextmanager
def rules(constants: Mapping[str, float]) -> Iterator[None]:
    """``cudamem.fit._steps``'s module constants set to ``constants`` while inside."""
    unknown = [name for name in constants if not hasattr(_steps, name)]
    if unknown:
        raise ValueError(f"no constant {', '.join(unknown)} in cudamem.fit._steps")
    saved = {name: getattr(_steps, name) for name in constants}
    try:
        for name, value in constants.items():
            setattr(_steps, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(_steps, name, value)


class Truth:
    """One model's record: the steps the GPU ran and a step's outcome at any batch."""

    def __init__(self, model: Mapping[str, Any]) -> None:
        self.recorded: list[dict[str, Any]] = list(model["probes"])
        self.true_largest = int(model["true_largest"])
        self.available = int(model["available"])
        measured: dict[int, int] = {}
        for p in self.recorded:
            if not p["oom"] and p["role"] != "warm-up":
                measured[int(p["n"])] = int(p["allocated"])
        for peak in model.get("peaks", {}).values():
            measured[int(peak["n"])] = int(peak["measured"])
        self._ns = sorted(measured)
        self._peaks = measured
        self._used: set[int] = set()
        #: What the GPU's confirming steps that ran out of memory reserved and asked for
        #: when they failed, by batch.
        self._failed: dict[int, tuple[int | None, int | None]] = {
            int(p["n"]): (p.get("oom_reserved"), requested(p))
            for p in self.recorded
            if p["oom"] and p["role"] == "confirm"
        }

    def allocated(self, n: int) -> int:
        """The peak allocated at ``n``: measured, or linear between the nearest measured."""
        if n in self._peaks:
            return self._peaks[n]
        ns = self._ns
        # the two measured sizes around n; the first or last two past either end
        k = min(max(bisect.bisect_left(ns, n), 1), len(ns) - 1)
        a, b = ns[k - 1], ns[k]
        slope = (self._peaks[b] - self._peaks[a]) / (b - a)
        return round(self._peaks[a] + slope * (n - a))

    def failed_near(self, n: int) -> tuple[int | None, int | None]:
        """What a confirming step of the GPU run that failed within ``NEAR`` of batch ``n``
        reserved and asked for when it failed, scaled to ``n``; ``(None, None)`` where none
        did (the replay's line puts a step a few samples from where the GPU's did)."""
        near = [m for m in self._failed if abs(m - n) <= NEAR * m]
        if not near:
            return None, None
        m = min(near, key=lambda m: abs(m - n))
        reserved, asked = self._failed[m]
        return (
            None if reserved is None else round(reserved * n / m),
            None if asked is None else round(asked * n / m),
        )

    def run(self, size: _steps.Size, role: str, profile: bool) -> Probe:
        """The step ``search`` asks for: the GPU run's where it made the same one."""
        for i, p in enumerate(self.recorded):
            # confirming steps always come from the truth below: where they land is what
            # the constants change
            replayable = role != "confirm" and p["role"] == role and p["n"] == size.n
            if replayable and i not in self._used:
                self._used.add(i)
                return probe(p)
        if size.n > self.true_largest:
            reserved, asked = self.failed_near(size.n)
            return Probe(
                size.n,
                None,
                role,
                None,
                None,
                0,
                0.0,
                True,
                "replayed: out of memory",
                oom_reserved=reserved,
                oom_requested=asked,
            )
        allocated = self.allocated(size.n)
        # near the limit the allocator freed its cache (one retry); far below it, not
        near = allocated > 0.5 * self.available
        reserved = allocated if near else round(allocated * 1.05)
        return Probe(size.n, None, role, allocated, reserved, 0, 0.0, False, None, int(near))


def replay(model: Mapping[str, Any], constants: Mapping[str, float]) -> dict[str, Any]:
    """One model's plan under ``constants``: the steps, the answer at margin 0 (the largest
    step that ran past the probes, as ``largest(0.0)`` names it after confirming steps) and
    how far short of the true largest it is."""
    truth = Truth(model)
    steps: list[tuple[int, str, bool]] = []
    probes: list[Probe] = []

    def run(size: _steps.Size, role: str, profile: bool) -> Probe:
        probe = truth.run(size, role, profile)
        steps.append((size.n, role, probe.oom))
        probes.append(probe)
        return probe

    with rules(constants):
        outcome = _steps.search(
            run,
            [_steps.Size(n, None) for n in SCHEDULE],
            terms_for(1),
            _steps.Size(CHECK, None),
            lambda: truth.available,
            adaptive=True,
            confirm=True,
        )
    ran = [n for n, role, oom in steps if not oom and role != "warm-up"]
    named = max(ran, default=0)
    short = (truth.true_largest - named) / truth.true_largest if truth.true_largest else 0.0
    under_cap = budget_answer(outcome, probes, model)
    return {
        "steps": len(steps),
        "ooms": sum(oom for _, _, oom in steps),
        "sizes": [n for n, _, _ in steps],
        "oom_at": [k for k, (_, _, oom) in enumerate(steps) if oom],
        "named": named,
        "true_largest": truth.true_largest,
        "short": short,
        "allowance": outcome.allowance,
        **under_cap,
    }


def budget_answer(
    outcome: _steps.Outcome, probes: Sequence[Probe], model: Mapping[str, Any]
) -> dict[str, Any]:
    """What ``largest_for(cap, margin=0)`` names for the record's smaller budget
    (``model["budget"]``: the cap and the true largest under it), asked of the plan the
    replayed ``outcome`` and ``probes`` make: ``MemoryPlan`` answers, as on the GPU."""
    cap = model.get("budget") or {}
    lines = outcome.lines
    if lines is None or "bytes" not in cap:
        return {}
    plan = MemoryPlan(
        0,
        tuple(probes),
        lines.allocated,
        lines.reserved,
        1.0,
        outcome.check,
        phase_lines=lines.phases,
        allowance=outcome.allowance,
        available=int(model["available"]),
        confirm=True,
    )
    try:
        named = plan.largest_for(int(cap["bytes"]), margin=0.0).n
    except NotLinearError:
        return {}
    true = int(cap["true_largest"])
    return {"cap_named": named, "cap_true_largest": true, "cap_short": (true - named) / true}


def same_as_recorded(model: Mapping[str, Any], result: Mapping[str, Any]) -> bool:
    """Whether a replay ran the steps the GPU run did: as many, the OOMs at the same places."""
    recorded = model["probes"]
    return bool(result["steps"] == len(recorded)) and result["oom_at"] == [
        k for k, p in enumerate(recorded) if p["oom"]
    ]


def requested(step: Mapping[str, Any]) -> int | None:
    """What a recorded step that ran out of memory asked for: its ``oom_requested`` (zoo runs
    since the plan records it), else read from its message."""
    if step.get("oom_requested") is not None:
        return int(step["oom_requested"])
    return parse_oom_message(step["error"]).requested if step.get("error") else None


def failures(model: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each confirming step of ``model``'s GPU run that ran out of memory: its message's bytes
    (in use, free, requested), what it reserved, and ``room``, the batch the plan's rule
    (``cudamem.fit._steps._room``) reads from it, with the line through the GPU run's probes
    and checks, against the true largest."""
    fitted = [probe(p) for p in model["probes"] if not p["oom"] and p["role"] in ("probe", "check")]
    fixed = _steps.fit_lines(fitted, terms_for(1)).allocated.fixed
    usable = int(model["available"]) - HEADROOM
    truth = int(model["true_largest"])
    out = []
    for p in model["probes"]:
        if not p["oom"] or p["role"] != "confirm" or not p["error"]:
            continue
        step = probe(p)
        room = _steps._room(step, fixed, usable)
        if room is None:
            continue
        parsed = parse_oom_message(p["error"])
        out.append(
            {
                "n": step.n,
                "in_use": parsed.process_in_use,
                "free": parsed.free,
                "requested": step.oom_requested,
                "allocated": p["oom_allocated"],
                "reserved": p["oom_reserved"],
                "room": room,
                "true_largest": truth,
                "off": room / truth - 1.0,
            }
        )
    return out


def probe(step: Mapping[str, Any]) -> Probe:
    """A recorded step as the plan's ``Probe``."""
    return Probe(
        int(step["n"]),
        None,
        step["role"],
        step["allocated"],
        step["reserved"],
        0,
        step["seconds"],
        step["oom"],
        step["error"],
        step["retries"],
        oom_allocated=step.get("oom_allocated"),
        oom_reserved=step.get("oom_reserved"),
        oom_requested=requested(step) if step["oom"] else None,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", default=os.path.join(here, "results", "fit-zoo-712b113.json"))
    parser.add_argument("--out", default=os.path.join(here, "results", "fit-replay.json"))
    args = parser.parse_args(argv)
    with open(args.zoo) as fh:
        zoo = json.load(fh)
    models: dict[str, Any] = zoo["models"]
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for variant, constants in VARIANTS.items():
        per_model = {name: replay(model, constants) for name, model in models.items()}
        results[variant] = {"constants": constants, "models": per_model}
        worst = max(r["short"] for r in per_model.values())
        most = max(r["steps"] for r in per_model.values())
        over_3 = [name for name, r in per_model.items() if r["short"] > 0.03]
        capped = [r for r in per_model.values() if "cap_short" in r]
        rows.append(
            [
                variant,
                f"{sum(r['steps'] for r in per_model.values())}",
                f"{most}",
                f"{sum(r['steps'] > 6 for r in per_model.values())}",
                f"{worst:.1%}",
                ", ".join(over_3) or "-",
                f"{max((r['cap_short'] for r in capped), default=0.0):.1%}",
                f"{sum(r['cap_named'] > r['cap_true_largest'] for r in capped)}",
            ]
        )
    recorded = results[RECORDED]["models"]
    fidelity = {name: same_as_recorded(models[name], recorded[name]) for name in models}
    print(
        render_table(
            ["model", *VARIANTS],
            [
                [
                    name + ("" if fidelity[name] else " *"),
                    *(
                        f"{v['models'][name]['steps']} / {v['models'][name]['short']:.1%}"
                        for v in results.values()
                    ),
                ]
                for name in models
            ],
            title="steps run / short of the true largest, a column a variant "
            f"(* the replay of the rules the GPU ran, {RECORDED!r}, differs from its run)",
        )
    )
    print()
    failed = {name: failures(model) for name, model in models.items()}
    print(
        render_table(
            [
                "model",
                "failed at",
                "in use",
                "free",
                "requested",
                "reserved",
                "room",
                "true largest",
            ],
            [
                [
                    name,
                    str(f["n"]),
                    format_bytes(f["in_use"]),
                    format_bytes(f["free"]),
                    format_bytes(f["requested"]),
                    format_bytes(f["reserved"]),
                    f"{f['room']:.1f} ({f['off']:+.1%})",
                    str(f["true_largest"]),
                ]
                for name, rows_of in failed.items()
                for f in rows_of
            ],
            title="the confirming steps that ran out of memory, read from their messages",
        )
    )
    print()
    emit(
        f"cudamem.plan's rules replayed over the zoo run on {zoo.get('card', '?')} "
        f"(commit {zoo.get('commit', '?')})",
        [
            "variant",
            "steps in all",
            "most steps",
            "models > 6 steps",
            "worst short",
            "> 3 % short",
            "cap: worst short",
            "cap: over",
        ],
        rows,
        {
            "zoo": os.path.relpath(args.zoo),
            "fidelity": fidelity,
            "variants": results,
            "failures": failed,
        },
        args.out,
    )
    return results


if __name__ == "__main__":
    main()
