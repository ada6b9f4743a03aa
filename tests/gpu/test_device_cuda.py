"""The device ledger on a real GPU (run by the lead on an H200; skipped without CUDA).

Scenarios that depend on what the *process* has done (its first context, its streams) run in a
fresh subprocess, so that this test process's own state cannot interfere. Each subprocess
prints the ledger (for the docs) and one JSON line that the test checks. The subprocesses
inherit the environment, so the whole GPU suite also runs under expandable segments with

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=. python3 -m pytest -m cuda

(the allocator reads that setting when CUDA initialises, hence the subprocesses); the expected
figures below hold in both modes (a 4 MiB request maps one 20 MiB page either way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.cuda

MiB = 1024**2

PRELUDE = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    import cudamem

    from cudamem.demo import NaiveN  # seed 001's model, bug included
    from cudamem.base.data import to_data

    def line(ledger, key):
        got = ledger.line(key)
        return None if got is None else got.nbytes

    def emit(**kw):
        print("RESULT " + json.dumps(kw))
    """
)


def run_script(body: str, timeout: int = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``body`` in a fresh interpreter (with ``env`` added to this environment) and return
    the last ``RESULT`` line's data."""
    code = PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
    sys.stdout.write(out.stdout)  # the ledger tables, for the docs (pytest -s shows them)
    assert out.returncode == 0, out.stderr[-4000:]
    results = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert results, out.stdout[-2000:]
    data: dict[str, Any] = json.loads(results[-1][len("RESULT ") :])
    return data


def _outside_bound(processes: int) -> int:
    """Driver memory NVML lists under no process, measured on the H200 (driver 580): 3.3 MiB
    idle plus ~5.6 MiB per process with a context. Allow 4 + 6 MiB per process."""
    return (4 + 6 * processes) * MiB


def test_seed001_numbers_explained() -> None:
    """A 4 MiB tensor: the ~0.5 GiB jump is the context, empty_cache frees a 20 MiB segment."""
    got = run_script(
        """
        x = torch.zeros(1024, 1024).to("cuda:0")   # 4 MiB
        e = cudamem.explain()
        print(e)
        ledger = e[0]
        del x
        gc.collect()
        r = cudamem.release()
        print(r)
        emit(
            devices=[d.device for d in e.devices],
            context=line(ledger, "context"),
            allocated=ledger.allocator.allocated,
            reserved=ledger.allocator.reserved,
            live=line(ledger, "allocated_live"),
            non_releasable=line(ledger, "cache_non_releasable"),
            unattributed=ledger.unattributed,
            procs=1 + sum(l.key.startswith("process:") for l in ledger.lines),
            accounted=ledger.accounted,
            nvml_used=ledger.nvml_used,
            freed=r[0].freed_reserved,
            nvml_freed=r[0].nvml_freed,
            recording=getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)(),
        )
        """
    )
    assert got["devices"] == [0]
    assert got["allocated"] == 4 * MiB
    assert got["reserved"] == 20 * MiB  # a 4 MiB request gets a 20 MiB segment
    assert got["live"] in (None, 4 * MiB)  # None only if the census is missing
    assert got["non_releasable"] == 16 * MiB  # the rest of that segment, while x lives
    assert 256 * MiB <= got["context"] <= 1536 * MiB  # the ~0.5 GiB jump
    # Every byte is on a named line; what NVML counts under no process is driver memory
    # (measured on the H200: 3.3 MiB idle, 8.8 MiB with one context).
    assert 0 <= got["unattributed"] <= _outside_bound(got["procs"])
    assert got["accounted"] == got["nvml_used"]
    assert got["freed"] == 20 * MiB  # what the seed saw empty_cache() give back
    assert got["nvml_freed"] is None or abs(got["nvml_freed"] - 20 * MiB) <= 2 * MiB
    assert got["recording"] is False  # explain() never leaves history recording on


def test_ledger_adds_up_to_nvml_used_within_2mib() -> None:
    got = run_script(
        """
        model = NaiveN(1024).cuda()
        opt = torch.optim.Adam(model.parameters())
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(torch.ones(1024, 1024, device="cuda")),
                                                torch.ones(1024, 1, device="cuda"))
            loss.backward()
            opt.step()
            opt.zero_grad()
        keep = [torch.empty(3 * 1024**2 + 5, dtype=torch.uint8, device="cuda")]  # odd sizes
        e = cudamem.explain()
        print(e)
        ledger = e[0]
        emit(
            unattributed=ledger.unattributed,
            procs=1 + sum(l.key.startswith("process:") for l in ledger.lines),
            accounted=ledger.accounted,
            nvml_used=ledger.nvml_used,
            keys=[l.key for l in ledger.lines],
            basis={l.key: l.basis for l in ledger.lines},
            cublas=line(ledger, "allocated_cublas"),
        )
        """
    )
    assert got["unattributed"] is not None
    assert 0 <= got["unattributed"] <= _outside_bound(got["procs"])
    assert got["accounted"] == got["nvml_used"]
    assert got["basis"]["context"] == "inferred"
    assert got["basis"]["driver_reserve"] == "measured"
    assert got["cublas"] is None or got["cublas"] >= 32 * MiB  # matmuls made a workspace


SEQUENTIAL = """
dev = torch.device("cuda:0")
nx = 1024
after = []
for k in range(3):
    model = NaiveN(nx)
    loss_func = torch.nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.ones(1024, nx).to(dev)
    y = torch.ones(1024, 1).to(dev)
    model.to(dev)
    optimizer.zero_grad()
    yp = model(x)
    loss = loss_func(yp, y)
    loss.backward()
    optimizer.step()
    del loss, yp, y, x, model
    if DEL_OPTIMIZER:
        del optimizer
    r = cudamem.release()
    print(r)
    d = r[0]
    after.append(dict(allocated=d.still_allocated, reserved=d.after.reserved,
                      holders=[p for s in d.remaining for p in s.paths[:5]],
                      largest=[s.nbytes for s in d.remaining]))
emit(after=after)
"""


def test_sequential_training_with_del_optimizer_gives_everything_back() -> None:
    got = run_script("DEL_OPTIMIZER = True\n" + SEQUENTIAL)
    for run in got["after"]:
        assert run["allocated"] == 0  # cuBLAS workspaces cleared too
        assert run["reserved"] == 0
        assert run["holders"] == []


def test_sequential_training_without_del_optimizer_names_the_optimizer() -> None:
    got = run_script("DEL_OPTIMIZER = False\n" + SEQUENTIAL)
    lin1 = 1024 * 1024 * 4
    for run in got["after"]:
        # the optimizer keeps the whole model: lin1.weight (4 MiB) is the largest storage
        assert run["allocated"] >= lin1
        assert run["largest"][0] == lin1
        joined = " | ".join(run["holders"])
        assert "optimizer" in joined, joined
        assert "param_groups" in joined or "state" in joined, joined
    # and it does not grow: the next run's assignment drops the previous optimizer
    assert got["after"][-1]["allocated"] == got["after"][0]["allocated"]


def test_new_stream_per_run_is_flagged_as_stranded_cache() -> None:
    got = run_script(
        """
        dev = torch.device("cuda:0")
        for k in range(3):
            s = torch.cuda.Stream(device=dev)   # a new stream per run: the known trap
            with torch.cuda.stream(s):
                model = NaiveN(1024).to(dev)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                x = torch.ones(1024, 1024, device=dev)
                loss = model(x).sum()
                loss.backward()
                opt.step()
                del model, opt, x, loss
            torch.cuda.current_stream(dev).wait_stream(s)
            del s
        gc.collect()
        e = cudamem.explain()
        print(e)
        ledger = e[0]
        emit(
            stranded=line(ledger, "cache_stranded"),
            streams=to_data(ledger.cache.streams),
            recording=getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)(),
        )
        """
    )
    stranded_streams = [s for s in got["streams"] if s["stranded"]]
    assert len(stranded_streams) == 3, got["streams"]
    assert got["stranded"] > 0
    assert got["recording"] is False


def test_explain_creates_no_context_and_syncs_nothing() -> None:
    got = run_script(
        """
        before = [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]
        e0 = cudamem.explain()           # nothing used yet
        cudamem.release()
        after = [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]
        emit(before=before, after=after, devices=[d.device for d in e0.devices],
             initialized=torch.cuda.is_initialized())
        """
    )
    assert got["devices"] == []
    assert got["after"] == got["before"] and not any(got["after"])


@pytest.mark.multigpu
def test_model_on_cuda1_gets_its_ledger_and_no_context_on_cuda0() -> None:
    got = run_script(
        """
        dev = torch.device("cuda:1")
        model = NaiveN(1024).to(dev)
        opt = torch.optim.Adam(model.parameters())
        loss = model(torch.ones(1024, 1024, device=dev)).sum()
        loss.backward()
        opt.step()
        assert not torch._C._cuda_hasPrimaryContext(0), "the test itself touched cuda:0"
        e = cudamem.explain()
        print(e)
        named = cudamem.explain("cuda:1")
        r = cudamem.release()
        ledger = e[1]
        emit(
            devices=[d.device for d in e.devices],
            named=[d.device for d in named.devices],
            ctx0=torch._C._cuda_hasPrimaryContext(0),
            unattributed=ledger.unattributed,
            procs=1 + sum(l.key.startswith("process:") for l in ledger.lines),
            accounted=ledger.accounted,
            nvml_used=ledger.nvml_used,
            context=line(ledger, "context"),
            released=[d.device for d in r.devices],
        )
        """
    )
    assert got["devices"] == [1] and got["named"] == [1]
    assert got["ctx0"] is False  # cudamem created no context on device 0
    assert got["released"] == [1]
    # Every byte is on a named line; what NVML counts under no process is driver memory
    # (measured on the H200: 3.3 MiB idle, 8.8 MiB with one context).
    assert 0 <= got["unattributed"] <= _outside_bound(got["procs"])
    assert got["accounted"] == got["nvml_used"]
    assert 256 * MiB <= got["context"] <= 1536 * MiB
