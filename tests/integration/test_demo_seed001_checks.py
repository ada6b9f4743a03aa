"""Seed 001's multi-run experiments judge what a fresh process printed: these tests feed
them recorded-shape outputs (no GPU, no subprocess) and check every verdict and note.

The outputs have the shape ``python -m cudamem.demo.seed001_runs CASE DEVICE`` prints: the
allocated/reserved level after each run, the ledgers ``explain()`` wrote, ``release()``'s
figures, the leak warnings and which devices had a context.
"""

from __future__ import annotations

from typing import Any

import pytest

from cudamem.demo import registry as _registry
from cudamem.demo import seed001 as _seed001
from cudamem.demo import seeds as demo

MiB = 1024**2


def _line(
    key: str, label: str, nbytes: int | None, note: str = "", frees: str = ""
) -> dict[str, Any]:
    return {"key": key, "label": label, "nbytes": nbytes, "note": note, "frees": frees}


def _out(
    levels: list[int], *, device: int = 0, warnings: tuple[str, ...] = (), **kw: Any
) -> dict[str, Any]:
    cublas = _line(
        "cublas_workspaces",
        "cuBLAS workspaces",
        levels[-1],
        note="kept per handle and stream: one set per stream that ran a matmul",
        frees="release(clear_cublas=True)",
    )
    out: dict[str, Any] = {
        "runs": [{"allocated": a, "reserved": a + 20 * MiB} for a in levels],
        "ledgers": {str(device): {"lines": [cublas], "notes": []}},
        "release": {"still_allocated": 0, "freed_allocated": levels[-1]},
        "leak_warnings": list(warnings),
        "contexts": [device],
        "nvml_process": {str(device): 600 * MiB},
    }
    out.update(kw)
    return out


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int], dict[str, Any]]:
    outputs: dict[tuple[str, int], dict[str, Any]] = {}
    monkeypatch.setattr(_registry, "_needs", lambda gpus: None)
    monkeypatch.setattr(_seed001, "_run", lambda case, device: outputs[(case, device)])
    return outputs


def _verdicts(e: _registry.Experiment) -> dict[str, bool]:
    return {c.name: c.passed for c in e.checks}


def test_a_stream_per_run_passes_when_each_run_adds_the_same_workspaces(fed: dict) -> None:
    levels = [65 * MiB, 130 * MiB, 195 * MiB]
    fed[("stream", 0)] = _out(levels, warnings=("span 'run' grows: cuBLAS workspaces pile up",))
    e = _seed001.seed001_stream_per_run()
    assert e.key == "seed001-stream-per-run" and e.skipped is None
    assert all(_verdicts(e).values()), e.checks
    assert len(e.checks) == 5
    assert e.rows[1] == ("run 1", "130.0 MiB", "+65.0 MiB", "150.0 MiB")
    assert e.notes[0].startswith("cuBLAS workspaces: 195.0 MiB (kept per handle and stream")
    assert e.notes[-1] == "LeakWarning: span 'run' grows: cuBLAS workspaces pile up"


def test_a_stream_per_run_fails_without_a_leak_warning_or_with_uneven_rises(fed: dict) -> None:
    fed[("stream", 0)] = _out([65 * MiB, 130 * MiB, 230 * MiB])
    verdicts = _verdicts(_seed001.seed001_stream_per_run())
    assert verdicts["allocated rises by the same amount every run"] is False
    assert verdicts["a LeakWarning names the cuBLAS workspaces"] is False
    assert verdicts["explain() says the workspaces are kept per stream"] is True


def test_a_thread_per_run_passes_when_the_level_stops_rising(fed: dict) -> None:
    fed[("thread", 1)] = _out([32 * MiB, 64 * MiB, 64 * MiB, 64 * MiB, 64 * MiB], device=1)
    e = demo.seed001_gpu1_thread_per_run()
    assert e.key == "seed001-gpu1-thread-per-run"
    assert all(_verdicts(e).values()), e.checks
    assert [c.name for c in e.checks][:2] == [
        "the level stops rising: the last three runs are equal (±1 MiB)",
        "no LeakWarning: growth that stops is not a leak",
    ]
    fed[("thread", 1)] = _out([32 * MiB, 64 * MiB, 96 * MiB], device=1, warnings=("grows",))
    verdicts = _verdicts(demo.seed001_gpu1_thread_per_run())
    assert verdicts["the level stops rising: the last three runs are equal (±1 MiB)"] is False
    assert verdicts["no LeakWarning: growth that stops is not a leak"] is False


@pytest.mark.parametrize(
    ("experiment", "case", "extra"),
    [(demo.seed001_gpu1_plain_loop, "plain", 1), (demo.seed001_gpu1_pin_memory, "pin-memory", 0)],
)
def test_the_flat_loops_pass_flat_and_fail_growing(
    fed: dict, experiment: Any, case: str, extra: int
) -> None:
    fed[(case, 1)] = _out([40 * MiB] * 4, device=1, contexts=[1])
    e = experiment()
    assert all(_verdicts(e).values()), e.checks
    assert len(e.checks) == 3 + extra
    assert e.notes[0] == "contexts: cuda:1"
    fed[(case, 1)] = _out([40 * MiB, 80 * MiB, 120 * MiB], device=1, contexts=[0, 1])
    e = experiment()
    failed = {name for name, ok in _verdicts(e).items() if not ok}
    assert "allocated is the same after every run (±1 MiB)" in failed
    assert ("naming cuda:1 creates no context on cuda:0" in failed) == (case == "plain")


def test_skipped_without_the_gpus_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_registry, "_needs", lambda gpus: f"needs {gpus} GPUs")
    for experiment in (
        _seed001.seed001_stream_per_run,
        demo.seed001_gpu1_thread_per_run,
        demo.seed001_gpu1_plain_loop,
        demo.seed001_gpu1_context_on_gpu0,
    ):
        e = experiment()
        assert e.skipped is not None and e.skipped.startswith("needs ")
        assert e.checks == ()


def test_each_experiment_is_registered_once_with_its_text_as_its_doc() -> None:
    """The key, title and explanation are said once (``@_experiment``); the demo's order is
    the registration order, and help() on an experiment shows what the demo prints."""
    keys = [k for k, _ in demo.experiments()]
    assert len(keys) == len(set(keys)) == 14
    assert keys[:2] == ["seed000-256mib", "seed000-who-holds"] and keys[-1] == "census"
    e = _seed001.seed001_gpu1_stream_per_run
    assert e.__doc__ is not None
    title, explanation = e.__doc__.split("\n\n")
    assert title == "Seed 001: a new torch.cuda.Stream per run on cuda:1"
    assert explanation.startswith("cuBLAS keeps a workspace per handle and stream, and ")
    assert "\n" not in explanation and "  " not in explanation


def test_the_text_and_the_device_reach_the_result(fed: dict) -> None:
    fed[("thread", 1)] = _out([32 * MiB] * 5, device=1)
    e = demo.seed001_gpu1_thread_per_run()
    assert e.key == "seed001-gpu1-thread-per-run"
    assert e.title == "Seed 001: a new thread per run on cuda:1"
    assert e.explanation.endswith("then the level stays flat: not a leak, and no LeakWarning.")
    assert e.notes == (
        "cuBLAS workspaces: 32.0 MiB (kept per handle and stream: one set per "
        "stream that ran a matmul)",
    )


def test_a_cpu_experiment_runs_without_a_gpu_and_names_its_storage() -> None:
    e = demo.census_now()
    assert e.skipped is None and e.key == "census" and e.passed
    assert e.checks[0].detail == "1 storage, 5 tensors"


def test_a_byte_figure_check_passes_within_its_tolerance_only() -> None:
    check = _registry._bytes_check
    assert check("exact", 20 * MiB, 20 * MiB).passed
    assert not check("off by a byte", 20 * MiB + 1, 20 * MiB).passed
    assert check("within", 21 * MiB, 20 * MiB, within=2 * MiB).passed
    unknown = check("unknown", None, 20 * MiB)
    assert not unknown.passed and unknown.detail == "n/a"
