"""Seed 001's multi-GPU question: the demo's experiments and their checks, on the CPU.

The experiments run their workloads in a fresh process on a GPU (``cudamem.demo.seed001_runs``);
here that process's JSON is replaced by figures shaped like an H200's, to show what each
check reads and that each can fail. The GPU runs are in test_distributed_cuda.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from cudamem.allocator import backend as _backend
from cudamem.demo import registry as _registry
from cudamem.demo import render_experiment
from cudamem.demo import seed001 as _seed001
from cudamem.demo import seed001_runs as _seed001_runs
from cudamem.demo import seeds as demo

from ..fakes import FakeAllocator

MiB = 1024**2
CONTEXT_FREES = "only the process exiting (one context per device this process touched)"


def _line(key: str, label: str, nbytes: int | None, frees: str = "", note: str = "") -> Any:
    return {
        "key": key,
        "label": label,
        "nbytes": nbytes,
        "basis": "measured",
        "source": "test",
        "frees": frees,
        "group": "this process",
        "note": note,
    }


def _ledger(allocated: int, lines: list[Any], notes: Sequence[str] = ()) -> Any:
    return {
        "text": "ledger",
        "lines": lines,
        "notes": list(notes),
        "allocated": allocated,
        "reserved": allocated,
    }


def _out(
    levels: list[int],
    *,
    device: int = 0,
    cublas: int | None = None,
    cublas_note: str = "",
    warnings: Sequence[str] = (),
    contexts: list[int] | None = None,
    still: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    lines = [
        _line("context", "CUDA context and loaded kernels", 744 * MiB, CONTEXT_FREES),
        _line(
            "allocated_cublas",
            "allocated: cuBLAS workspaces",
            levels[-1] if cublas is None else cublas,
            note=cublas_note,
        ),
    ]
    out = {
        "case": "x",
        "device": device,
        "current_device": device,
        "runs": [{"allocated": v, "reserved": v + 2 * MiB} for v in levels],
        "leak_warnings": list(warnings),
        "contexts": [device] if contexts is None else contexts,
        "ledgers": {str(device): _ledger(levels[-1], lines)},
        "nvml_process": {str(device): 900 * MiB},
        "release": {
            "freed_allocated": levels[-1] - still,
            "freed_reserved": levels[-1],
            "still_allocated": still,
            "nvml_freed": levels[-1],
            "cublas_cleared": True,
        },
        "ledgers_after_release": {},
    }
    out.update(extra or {})
    return out


STREAM_WARNING = (
    "seed001 run retains +65.0 MiB per call (5 calls)\n  note: 325.0 MiB of the allocated "
    "memory on cuda:0 is 10 cuBLAS workspaces held by no tensor: ..."
)
#: The ledger's wording (its cuBLAS line's note, its label for a context on an unused device).
PER_STREAM_NOTE = (
    "10 workspaces, one per cuBLAS handle and stream, on 5 streams: a new "
    "torch.cuda.Stream (or thread) per run adds one each run"
)
UNUSED_LABEL = "CUDA context on a device this process never allocated on"


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[str, int], Any]]:
    """What each fresh process "printed", keyed by (case, device); two fake GPUs."""
    table: dict[tuple[str, int], Any] = {}

    def fresh(case: str, device: int) -> str:
        return json.dumps(table[(case, device)])

    monkeypatch.setattr(_seed001, "_fresh_run", fresh)
    with _backend.use(FakeAllocator(devices=2, contexts=())):
        yield table


def _checks(exp: _registry.Experiment) -> dict[str, bool]:
    assert exp.skipped is None, exp.skipped
    return {c.name: c.passed for c in exp.checks}


def test_stream_per_run_passes_with_the_per_stream_line(runs: dict[Any, Any]) -> None:
    levels = [65 * MiB * (k + 1) for k in range(6)]
    runs[("stream", 0)] = _out(levels, cublas_note=PER_STREAM_NOTE, warnings=[STREAM_WARNING])
    exp = _seed001.seed001_stream_per_run()
    assert all(_checks(exp).values()), render_experiment(exp)
    text = render_experiment(exp)
    assert "PASS: allocated rises by the same amount every run — +65.0 MiB, +65.0 MiB" in text
    assert exp.rows[1] == ("run 1", "130.0 MiB", "+65.0 MiB", "132.0 MiB")


def test_stream_per_run_checks_can_fail(runs: dict[Any, Any]) -> None:
    # Flat levels, the workspaces not in the cuBLAS line, no per-stream wording, no warning,
    # and memory left after release().
    runs[("stream", 0)] = _out([65 * MiB] * 6, cublas=0, still=4 * MiB)
    checks = _checks(_seed001.seed001_stream_per_run())
    assert checks == {
        "allocated rises by the same amount every run": False,
        "explain(): what stays allocated after the runs is cuBLAS workspaces": False,
        "release(clear_cublas=True) frees them: nothing stays allocated": False,
        "explain() says the workspaces are kept per stream": False,
        "a LeakWarning names the cuBLAS workspaces": False,
    }


def test_thread_per_run_grows_once_then_flat(runs: dict[Any, Any]) -> None:
    runs[("thread", 0)] = _out([65 * MiB] + [97 * MiB] * 5)
    assert all(_checks(_seed001.seed001_thread_per_run()).values())
    runs[("thread", 0)] = _out([65 * MiB * (k + 1) for k in range(6)], warnings=["grows"])
    checks = _checks(_seed001.seed001_thread_per_run())
    assert checks["the level stops rising: the last three runs are equal (±1 MiB)"] is False
    assert checks["no LeakWarning: growth that stops is not a leak"] is False


def _context_case(label: str, contexts: list[int]) -> dict[str, Any]:
    out = _out([65 * MiB] * 6, device=1, contexts=contexts)
    out["ledgers"]["0"] = _ledger(0, [_line("context", label, 524 * MiB, CONTEXT_FREES)])
    out["nvml_process"]["0"] = 524 * MiB
    return out


def test_context_on_gpu0_names_the_cause_and_the_fix(runs: dict[Any, Any]) -> None:
    runs[("stream", 1)] = _context_case(UNUSED_LABEL, [0, 1])
    runs[("stream-set-device", 1)] = _out([65 * MiB] * 6, device=1, contexts=[1])
    exp = demo.seed001_gpu1_context_on_gpu0()
    assert all(_checks(exp).values()), render_experiment(exp)
    assert exp.rows == (
        ("no set_device (current: cuda:0)", "cuda:0, cuda:1", "524.0 MiB", "524.0 MiB"),
        ("set_device(1) first", "cuda:1", "n/a", "n/a"),
    )
    # Without the ledger's wording, and with the fix not working, those checks fail.
    runs[("stream", 1)] = _context_case("CUDA context and loaded kernels", [0, 1])
    runs[("stream-set-device", 1)] = _out([65 * MiB] * 6, device=1, contexts=[0, 1])
    demo_checks = _checks(demo.seed001_gpu1_context_on_gpu0())
    assert demo_checks["explain() says this process never used cuda:0"] is False
    assert demo_checks["torch.cuda.set_device(1) first: no context on cuda:0"] is False
    assert demo_checks["without set_device, a CUDA context appears on cuda:0"] is True


def test_flat_loops(runs: dict[Any, Any]) -> None:
    runs[("plain", 1)] = _out([65 * MiB] * 6, device=1, contexts=[1])
    runs[("pin-memory", 1)] = _out([65 * MiB] * 6, device=1, contexts=[0, 1])
    plain = _checks(demo.seed001_gpu1_plain_loop())
    assert all(plain.values()) and "naming cuda:1 creates no context on cuda:0" in plain
    pinned = demo.seed001_gpu1_pin_memory()
    assert all(_checks(pinned).values())
    assert "contexts: cuda:0, cuda:1" in pinned.notes  # reported, not judged
    runs[("plain", 1)] = _out([65 * MiB * (k + 1) for k in range(6)], device=1, contexts=[0, 1])
    plain = _checks(demo.seed001_gpu1_plain_loop())
    assert plain["allocated is the same after every run (±1 MiB)"] is False
    assert plain["naming cuda:1 creates no context on cuda:0"] is False


def test_two_gpu_experiments_skip_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(_seed001, "_fresh_run", lambda *a: calls.append(a) or "{}")
    with _backend.use(FakeAllocator(devices=1, contexts=())):
        results = demo.run_demo(
            only=[
                "seed001-gpu1-stream-per-run",
                "seed001-gpu1-context-on-gpu0",
                "seed001-gpu1-thread-per-run",
                "seed001-gpu1-plain-loop",
                "seed001-gpu1-pin-memory",
            ]
        )
    assert len(results) == 5
    for exp in results:
        assert exp.skipped == (
            "needs two CUDA GPUs (this machine has 1); the single-GPU variants run on cuda:0"
        )
        assert "SKIP: needs two CUDA GPUs" in render_experiment(exp)
    assert calls == []  # nothing was started


def test_single_gpu_variants_skip_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        for fn in (_seed001.seed001_stream_per_run, _seed001.seed001_thread_per_run):
            assert fn().skipped == "needs a CUDA GPU"


def test_a_failing_fresh_process_is_a_failed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(case: str, device: int) -> str:
        raise RuntimeError(f"the {case} run failed: CUDA error")

    monkeypatch.setattr(_seed001, "_fresh_run", broken)
    with _backend.use(FakeAllocator(devices=2, contexts=())):
        (exp,) = demo.run_demo(only=["seed001-gpu1-plain-loop"])
    assert not exp.passed
    assert exp.checks[0].detail == "RuntimeError: the plain run failed: CUDA error"


def test_the_runs_module_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert _seed001_runs.main([]) == 2
    assert "usage: python -m cudamem.demo.seed001_runs" in capsys.readouterr().out
    assert _seed001_runs.main(["stream", "one"]) == 2
    with pytest.raises(ValueError, match="case must be one of"):
        _seed001_runs.run_case("bogus", 0)
