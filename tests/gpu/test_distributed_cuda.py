"""``cudamem.distributed`` on GPUs: NCCL under torchrun, one GPU and two.

Marked ``cuda`` (one GPU) or ``multigpu`` (two); they skip elsewhere. NVLink multicast stays
off (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.distributed import gather_report

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "dist_worker_cuda.py"


def run_torchrun(mode: str, nproc: int, out: Path, timeout: float = 240.0) -> dict[int, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        mode,
        str(out),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, and only it
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} hung:\n{output.decode()[-3000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}


def _own_checks(row: dict[str, Any], rank: int, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    assert row["errors"] == []
    assert row["own_device"] == rank and row["own_basis"] == f"LOCAL_RANK={rank}"
    assert row["current_device"] == rank
    (dev,) = [d for d in row["devices"] if d["device"] == rank]
    assert dev["uuid"] == row["own_uuid"] and dev["gpu"] is not None
    assert dev["allocated"] >= 4 * MiB  # x, and the cuBLAS workspace
    assert dev["peak"] >= dev["allocated"]
    assert dev["process_used"] is not None and dev["process_used"] > dev["reserved"]
    # The ledger's line: NVML's figure for the process minus the allocator's reserved bytes
    # (read a moment apart; nothing allocates in between).
    assert abs(dev["outside_allocator"] - (dev["process_used"] - dev["reserved"])) <= 2 * MiB
    assert dev["nccl"] is not None
    assert any(line["key"] == "context" for line in dev["ledger"])
    mine = [h for h in gpus if h["pid"] == row["pid"] and h["gpu"] == dev["gpu"]]
    assert len(mine) == 1 and mine[0]["rank"] == rank and mine[0]["own"] is True
    return dev


@pytest.mark.cuda
def test_one_gpu_nccl_world_of_one(tmp_path: Path) -> None:
    got = run_torchrun("own", 1, tmp_path)
    report = got[0]["report"]
    (row,) = report["ranks"]
    assert row["pid"] == got[0]["pid"] and row["backend"] == "nccl"
    dev = _own_checks(row, 0, report["gpus"])
    # A context at least, and NCCL's buffers on top of it.
    assert dev["outside_allocator"] > 256 * MiB
    assert report["strays"] == []
    assert "NCCL (inferred)" in got[0]["text"]


@pytest.mark.cuda
def test_one_gpu_in_process_gloo() -> None:
    import torch.distributed as dist

    x = torch.ones(2 * MiB // 4, device="cuda:0")
    with cudamem.track("step", device=0):
        y = x * 2
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        report = gather_report(timeout=30)
    finally:
        dist.destroy_process_group()
    assert report is not None
    row = report[0]
    dev = row.device(0)
    assert dev is not None
    assert dev.allocated >= 4 * MiB and dev.peak >= dev.allocated
    assert dev.nccl is None  # gloo: no communicator
    assert dev.line("allocated_live") is not None or dev.line("allocated") is not None
    assert "backend gloo: no NCCL communicator, so no NCCL buffers" in row.notes
    assert [s.name for s in row.spans] == ["step"]
    assert row.spans[0].level is not None and row.spans[0].level >= 4 * MiB
    del x, y


@pytest.mark.multigpu
def test_two_gpus_nccl_buffers_and_the_rank_pid_gpu_map(tmp_path: Path) -> None:
    got = run_torchrun("own", 2, tmp_path)
    assert got[1]["report"] is None
    report = got[0]["report"]
    rows = {r["rank"]: r for r in report["ranks"]}
    assert {r: rows[r]["pid"] for r in rows} == {0: got[0]["pid"], 1: got[1]["pid"]}
    gpus = {}
    for rank in (0, 1):
        dev = _own_checks(rows[rank], rank, report["gpus"])
        assert dev["nccl"] > 0, dev  # NCCL's buffers: memory outside the allocator
        gpus[rank] = dev["gpu"]
        assert [d["device"] for d in rows[rank]["devices"]] == [rank]  # nothing elsewhere
    assert gpus[0] != gpus[1]
    assert report["strays"] == []


@pytest.mark.multigpu
def test_two_gpus_without_set_device_memory_lands_on_gpu0(tmp_path: Path) -> None:
    got = run_torchrun("stray", 2, tmp_path)
    report = got[0]["report"]
    strays = [s for s in report["strays"] if s["rank"] == 1]
    assert strays, got[0]["text"]
    stray = next(s for s in strays if s["device"] == 0)
    assert stray["pid"] == got[1]["pid"] and stray["own_device"] == 1
    assert stray["allocated"] >= 4 * MiB
    assert "torch.cuda.set_device(1) was not called" in stray["cause"]
    assert "it has tensors there" in stray["cause"]
    on_gpu0 = {h["rank"] for h in report["gpus"] if h["gpu"] == stray["gpu"]}
    assert {0, 1} <= on_gpu0
    assert "memory on a GPU that is not the rank's own:" in got[0]["text"]


# --------------------------------------------------------------------------- seed 001's runs


def _seed001(case: str, device: int) -> dict[str, Any]:
    from cudamem.demo import seed001 as _seed001

    return _seed001._run(case, device)


def _allocated(out: dict[str, Any]) -> list[int]:
    return [r["allocated"] for r in out["runs"]]


def _cublas_bytes(out: dict[str, Any], device: int) -> int:
    lines = out["ledgers"][str(device)]["lines"]
    return sum(ln["nbytes"] or 0 for ln in lines if "cublas" in ln["key"].lower())


@pytest.mark.cuda
def test_seed001_new_stream_per_run_grows_by_cublas_workspaces() -> None:
    out = _seed001("stream", 0)
    levels = _allocated(out)
    rises = [levels[i + 1] - levels[i] for i in range(len(levels) - 1)]
    assert min(rises) >= 32 * MiB and max(rises) - min(rises) <= MiB, levels  # H200: 65 MiB
    assert abs(_cublas_bytes(out, 0) - levels[-1]) <= MiB
    assert any("cuBLAS workspaces held by no tensor" in w for w in out["leak_warnings"])
    assert out["release"]["still_allocated"] == 0
    assert out["release"]["freed_allocated"] >= levels[-1] - MiB


@pytest.mark.cuda
def test_seed001_new_thread_per_run_grows_once() -> None:
    out = _seed001("thread", 0)
    levels = _allocated(out)
    assert max(levels[-3:]) - min(levels[-3:]) <= MiB, levels
    assert out["leak_warnings"] == []
    assert abs(_cublas_bytes(out, 0) - levels[-1]) <= MiB
    assert out["release"]["still_allocated"] == 0


@pytest.mark.multigpu
def test_seed001_on_gpu1_stream_runs_make_a_context_on_gpu0() -> None:
    bad = _seed001("stream", 1)
    levels = _allocated(bad)
    assert levels[-1] - levels[0] >= (len(levels) - 1) * 32 * MiB, levels
    assert 0 in bad["contexts"]
    zero = bad["ledgers"]["0"]
    assert zero["allocated"] == 0 and zero["reserved"] == 0
    context = next(ln for ln in zero["lines"] if ln["key"].startswith("context"))
    assert 256 * MiB <= context["nbytes"] <= 1536 * MiB
    good = _seed001("stream-set-device", 1)
    assert 0 not in good["contexts"]


@pytest.mark.multigpu
@pytest.mark.parametrize("case", ["plain", "pin-memory"])
def test_seed001_on_gpu1_plain_and_pinned_loops_stay_flat(case: str) -> None:
    out = _seed001(case, 1)
    levels = _allocated(out)
    assert max(levels) - min(levels) <= MiB, levels
    assert out["leak_warnings"] == []
    assert out["release"]["still_allocated"] == 0
    if case == "plain":
        assert 0 not in out["contexts"]
