"""The report across ranks: two real gloo processes under torchrun, and the pure analysis.

The two-process tests launch ``tests/dist_worker.py`` with ``torchrun --standalone`` (a free
port picked by the rendezvous), each guarded by a timeout. The worker measures real CPU
tensors through a stand-in allocator (``tests.fakes.CpuStorageBackend``): rank 1 keeps one
1 MiB tensor per step, so it grows for real and its leak detector names the list.
"""

from __future__ import annotations

import dataclasses
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
import cudamem.distributed as cdist
from cudamem.base.data import to_data
from cudamem.distributed import (
    HostGpu,
    RankDevice,
    RankGrowth,
    RankReport,
    RankSpan,
    _collect,
    _transport,
    build_report,
    collect_rank,
    gather_report,
)
from cudamem.distributed.results import absent_row
from cudamem.ledger import nvml as _nvml
from cudamem.ledger.device import LedgerLine
from cudamem.render.distributed import render_distributed
from cudamem.render.json import to_json
from cudamem.spans import history as _history

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "dist_worker.py"


def run_torchrun(mode: str, out: Path, *, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
    """``torchrun --standalone --nproc_per_node=2 dist_worker.py MODE OUT``; each rank's file."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
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
        pytest.fail(f"torchrun {mode} hung for {timeout} s:\n{output.decode()[-3000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    results = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing:\n{text[-3000:]}"
        results[rank] = json.loads(path.read_text())
    return results


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return run_torchrun("ok", tmp_path_factory.mktemp("dist-ok"))


# --------------------------------------------------------------------------- two processes


def test_rank0_gets_every_rank_and_the_others_none(ok_run: dict[int, dict[str, Any]]) -> None:
    report = ok_run[0]["report"]
    assert report is not None
    assert ok_run[1]["report"] is None  # only the collector gets the report
    assert report["world_size"] == 2
    assert report["collector"] == 0
    pids = {row["rank"]: row["pid"] for row in report["ranks"]}
    assert pids == {0: ok_run[0]["pid"], 1: ok_run[1]["pid"]}
    assert ok_run[0]["pid"] != ok_run[1]["pid"]
    for row in report["ranks"]:
        assert row["errors"] == []
        assert row["backend"] == "gloo"
        assert row["local_rank"] == row["rank"]
        assert row["host"]


def test_rank1_grows_and_is_named_the_outlier(ok_run: dict[int, dict[str, Any]]) -> None:
    report = ok_run[0]["report"]
    rows = {row["rank"]: row for row in report["ranks"]}
    step0 = next(s for s in rows[0]["spans"] if s["name"] == "step")
    step1 = next(s for s in rows[1]["spans"] if s["name"] == "step")
    assert step0["calls"] == step1["calls"] == 8
    assert step0["growth_per_call"] == 0
    assert step1["growth_per_call"] == 1 * MiB  # one kept 1 MiB tensor per step
    assert step1["level"] == 8 * MiB
    assert report["growth_outlier"]["rank"] == 1
    assert report["growth_outlier"]["value"] == 1 * MiB
    assert report["peak_outlier"]["rank"] == 1
    # The leak detector's finding travels with the row, culprit named.
    assert rows[0]["growth"] == []
    (finding,) = rows[1]["growth"]
    assert finding["name"] == "step"
    assert finding["holders"] == ["__main__.kept"]
    assert any("__main__.kept" in w for w in ok_run[1]["leak_warnings"])
    assert ok_run[0]["leak_warnings"] == []


def test_the_report_renders_a_table_per_rank(ok_run: dict[int, dict[str, Any]]) -> None:
    text = ok_run[0]["text"]
    assert text.startswith("cudamem distributed report: 2 ranks on 1 host, gathered on rank 0")
    assert f"rank 0 (pid {ok_run[0]['pid']}" in text
    assert f"rank 1 (pid {ok_run[1]['pid']}" in text
    assert (
        "outlier: rank 1: highest growth, +1.0 MiB per call of 'step'; held by __main__.kept"
        in text
    )
    assert "LeakWarning: step +1.0 MiB per call" in text
    # Without NVML nothing is guessed: the figures it would give are n/a, not 0.
    summary = text.splitlines()[3]
    assert summary.split()[0] == "0" and "n/a" in summary


def test_all_ranks_get_the_report(tmp_path: Path) -> None:
    got = run_torchrun("all", tmp_path)
    for rank in (0, 1):
        report = got[rank]["report"]
        assert report is not None
        assert report["collector"] == rank
        assert {r["pid"] for r in report["ranks"]} == {got[0]["pid"], got[1]["pid"]}
        assert report["growth_outlier"]["rank"] == 1


def test_without_the_store_the_rows_go_over_the_group_itself(tmp_path: Path) -> None:
    got = run_torchrun("fallback", tmp_path)
    assert got[1]["report"] is None
    report = got[0]["report"]
    assert {r["rank"]: r["pid"] for r in report["ranks"]} == {0: got[0]["pid"], 1: got[1]["pid"]}
    assert report["growth_outlier"]["rank"] == 1
    assert all(r["errors"] == [] for r in report["ranks"])


def test_a_rank_raising_inside_collection_still_yields_a_report(tmp_path: Path) -> None:
    got = run_torchrun("raise", tmp_path)
    report = got[0]["report"]
    rows = {row["rank"]: row for row in report["ranks"]}
    assert rows[1]["pid"] == got[1]["pid"]
    assert rows[1]["errors"] == [
        "spans (cudamem.history): RuntimeError: history exploded on purpose"
    ]
    assert rows[1]["spans"] == []
    # The rest of its row is there: devices, and the detector's finding.
    assert rows[1]["devices"][0]["allocated"] == 8 * MiB
    assert rows[1]["growth"][0]["holders"] == ["__main__.kept"]
    assert rows[0]["errors"] == []
    assert report["growth_outlier"]["rank"] == 1
    assert "error: spans (cudamem.history): RuntimeError" in got[0]["text"]


def test_a_rank_that_never_answers_times_out_into_a_row(tmp_path: Path) -> None:
    got = run_torchrun("absent", tmp_path)
    report = got[0]["report"]
    rows = {row["rank"]: row for row in report["ranks"]}
    assert rows[0]["pid"] == got[0]["pid"]
    assert rows[1]["pid"] is None
    assert rows[1]["errors"][0].startswith("no answer within 4 s")
    assert "no row from rank 1" in report["notes"]
    assert "no answer" in got[0]["text"]


# --------------------------------------------------------------------------- one process


def test_without_torch_distributed_the_report_is_this_process() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with cudamem.track("alone"):
        pass
    report = gather_report()
    assert report is not None
    assert len(report) == 1
    assert report[0].pid == os.getpid()
    assert report[0].backend is None
    assert "torch.distributed is not initialised: this process only" in report.notes
    assert [s.name for s in report[0].spans] == ["alone"]


def test_cpu_spans_are_not_measured_not_zero() -> None:
    """Spans that measured no CUDA device have no delta, level or growth: the report shows
    n/a for them (never +0 B) and says growth was not measured (never "no rank grows")."""
    from cudamem.distributed.results import RankSpan

    for _ in range(4):
        with cudamem.track("cpu_step"):
            torch.ones(1024)
    report = gather_report()
    assert report is not None
    (span,) = [s for s in report[0].spans if s.name == "cpu_step"]
    assert (span.mean_allocated_delta, span.level, span.growth_per_call) == (None, None, None)
    assert RankSpan.from_dict(to_data(span)) == span  # rows travel between ranks as JSON
    text = str(report)
    row = next(line for line in text.splitlines() if line.strip().startswith("cpu_step"))
    assert row.split() == ["cpu_step", "4", "n/a", "n/a", "n/a", "n/a"]
    assert "+0 B" not in text
    assert (
        "note: growth not measured: no rank's spans measured a CUDA device (n/a, not 0)"
    ) in text.splitlines()


def test_world_of_one_in_process_gloo() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with cudamem.track("step"):
            pass
        report = gather_report(timeout=10)
        again = gather_report(timeout=10, all_ranks=True)  # the side group is reused
    finally:
        dist.destroy_process_group()
    assert report is not None and again is not None
    assert report[0].backend == "gloo"
    assert report[0].pid == os.getpid()
    assert report[0].errors == ()
    assert again[0].pid == os.getpid()
    assert report.collector == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": True}, ValueError, "timeout"),
        ({"timeout": "10"}, ValueError, "timeout"),
        ({"all_ranks": 1}, TypeError, "all_ranks"),
        ({"ledger": None}, TypeError, "ledger"),
        ({"context_estimate": -1}, ValueError, "context_estimate"),
        ({"context_estimate": 1.5}, ValueError, "context_estimate"),
        ({"group": object()}, ValueError, "group"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], exc: type, word: str) -> None:
    with pytest.raises(exc, match=word):
        gather_report(**kwargs)


def test_collect_rank_survives_every_part_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object, **__: object) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(_history, "history", boom)
    monkeypatch.setattr(_nvml, "status", boom)
    monkeypatch.setattr(_collect, "_collect_growth", boom)
    row = collect_rank(3, 4)
    assert row.rank == 3 and row.world_size == 4 and row.pid == os.getpid()
    assert row.errors == (
        "NVML process lists: RuntimeError: boom",
        "spans (cudamem.history): RuntimeError: boom",
        "leak findings: RuntimeError: boom",
    )
    # It still travels and comes back whole.
    assert RankReport.from_dict(json.loads(cdist._encode(row))) == row


def test_a_crashing_collection_still_sends_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    def crash(*_: object, **__: object) -> RankReport:
        raise MemoryError("no room")

    monkeypatch.setattr(cdist, "collect_rank", crash)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        report = gather_report(timeout=10)
    finally:
        dist.destroy_process_group()
    assert report is not None
    assert report[0].pid == os.getpid()
    assert report[0].errors == ("collecting this rank's row: MemoryError: no room",)


def _as_rank(store: Any, payload: str, members: tuple[int, ...], me: int, **kw: Any) -> Any:
    """One simulated rank's first call (each rank counts its own calls)."""
    _transport._calls.counts.clear()
    return _transport._via_store(store, payload, members, me, **kw)


def test_the_store_exchange_reads_every_row_and_cleans_up() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    members = (0, 1, 2)
    assert _as_rank(store, "one", members, 1, timeout=1, all_ranks=False) is None
    assert _as_rank(store, "two", members, 2, timeout=1, all_ranks=False) is None
    got = _as_rank(store, "zero", members, 0, timeout=1, all_ranks=False)
    assert got == (["zero", "one", "two"], None)
    assert not any(store.check([k]) for k in _keys(members, 1))


def test_the_store_exchange_times_out_into_what_arrived() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    members = (0, 1, 2)
    _as_rank(store, "one", members, 1, timeout=1, all_ranks=False)
    payloads, error = _as_rank(store, "zero", members, 0, timeout=0.5, all_ranks=False)
    assert payloads == ["zero", "one", None]
    assert error == "1 of 3 rows missing"


def test_each_call_has_its_own_keys() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    members = (0, 1)
    _transport._calls.counts.clear()
    for n in (1, 2):
        _transport._calls.counts[members] = n - 1
        _transport._via_store(store, f"rank 1, call {n}", members, 1, timeout=1, all_ranks=False)
    _transport._calls.counts[members] = 1  # the collector's second call reads call 2's row
    got = _transport._via_store(store, "rank 0", members, 0, timeout=1, all_ranks=False)
    assert got == (["rank 0", "rank 1, call 2"], None)
    assert store.check([_keys(members, 1)[1]])  # call 1's row is still there, unread


def _keys(members: tuple[int, ...], n: int) -> list[str]:
    import zlib

    tag = f"{zlib.crc32(','.join(map(str, members)).encode()):08x}-{len(members)}"
    return [f"cudamem/report/{tag}/{n}/{r}" for r in members]


def test_the_store_exchange_for_all_ranks_is_cleaned_by_the_last_reader() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    members = (4, 5)
    store.set(_keys(members, 1)[1], "five")  # rank 5's row is there already
    first = _as_rank(store, "four", members, 4, timeout=1, all_ranks=True)
    assert first == (["four", "five"], None)
    assert store.check(_keys(members, 1))  # rank 5 has not read yet
    second = _as_rank(store, "five", members, 5, timeout=1, all_ranks=True)
    assert second == (["four", "five"], None)
    assert not store.check([_keys(members, 1)[0]])


@pytest.mark.parametrize(
    "raw",
    [None, 42, "not json", json.dumps({"rank": 1}), json.dumps({"rank": "x", "world_size": 2})],
)
def test_an_unreadable_row_becomes_an_error_row(raw: Any) -> None:
    row = cdist._decode(raw, 1, 2)
    assert row.rank == 1 and row.pid is None
    assert row.errors and row.errors[0].startswith("rank 1 sent")


# --------------------------------------------------------------------------- analysis


def _dev(
    device: int,
    *,
    gpu: int | None,
    uuid: str | None,
    allocated: int = 0,
    reserved: int = 0,
    peak: int = 0,
    used: int | None = None,
    outside: int | None = None,
    nccl: int | None = None,
) -> RankDevice:
    return RankDevice(
        device=device,
        gpu=gpu,
        uuid=uuid,
        allocated=allocated,
        reserved=reserved,
        peak=peak,
        process_used=used,
        outside_allocator=outside,
        nccl=nccl,
        context_estimate=cdist.CONTEXT_ESTIMATE,
        ledger=(LedgerLine("context", "CUDA context", outside, "inferred", "NVML", "me", ""),),
    )


def _row(
    rank: int,
    pid: int,
    *,
    devices: tuple[RankDevice, ...] = (),
    own: int | None = None,
    current: int | None = None,
    growth: float | None = None,
    gpus: tuple[HostGpu, ...] = (),
    host: str = "node1",
    leak: RankGrowth | None = None,
) -> RankReport:
    span = RankSpan("step", 10, 0.0, None, 0, growth)
    return RankReport(
        rank=rank,
        world_size=2,
        pid=pid,
        host=host,
        local_rank=rank,
        backend="nccl",
        current_device=current,
        own_device=own,
        own_basis=f"LOCAL_RANK={rank}",
        own_uuid=None if own is None else f"uuid{own}",
        devices=devices,
        spans=(span,),
        growth=() if leak is None else (leak,),
        gpus=gpus,
    )


def _gpus(*procs: tuple[int, tuple[tuple[int, int | None], ...]]) -> tuple[HostGpu, ...]:
    return tuple(
        HostGpu(
            gpu,
            f"uuid{gpu}",
            "H200",
            tuple(_nvml.GpuProcess(p, "python", u, "compute") for p, u in plist),
        )
        for gpu, plist in procs
    )


def test_why_there_is_memory_on_gpu0_from_every_rank() -> None:
    # Rank 1 forgot torch.cuda.set_device: its current device is 0, where a context (no
    # tensors) appeared beside its real work on cuda:1.
    gpus = _gpus((0, ((100, 2000 * MiB), (101, 524 * MiB))), (1, ((101, 1500 * MiB),)))
    r0 = _row(
        0,
        100,
        own=0,
        current=0,
        devices=(_dev(0, gpu=0, uuid="uuid0", allocated=900 * MiB, peak=1000 * MiB),),
        gpus=gpus,
    )
    r1 = _row(
        1,
        101,
        own=1,
        current=0,
        devices=(
            _dev(0, gpu=0, uuid="uuid0", used=524 * MiB, outside=524 * MiB),
            _dev(1, gpu=1, uuid="uuid1", allocated=800 * MiB, peak=900 * MiB),
        ),
        gpus=gpus,
    )
    report = build_report([r0, r1])
    (stray,) = report.strays
    assert (stray.rank, stray.pid, stray.device, stray.gpu, stray.own_device) == (1, 101, 0, 0, 1)
    assert stray.nbytes == 524 * MiB
    assert "torch.cuda.set_device(1) was not called" in stray.cause
    assert "a CUDA context only, no tensors" in stray.cause
    holdings = {(h.gpu, h.pid): h for h in report.gpus}
    assert holdings[(0, 100)].rank == 0 and holdings[(0, 100)].own is True
    assert holdings[(0, 101)].rank == 1 and holdings[(0, 101)].own is False
    assert holdings[(1, 101)].own is True
    assert "GPU 0 holds memory of 1 rank not its own (1): see the causes below" in report.notes
    text = str(report)
    assert "memory on a GPU that is not the rank's own:" in text
    assert "rank 1 (pid 101) holds 524.0 MiB on cuda:0:" in text
    assert "no: stray" in text


def test_a_stray_tensor_is_told_from_a_stray_context() -> None:
    r1 = _row(
        1,
        7,
        own=1,
        current=1,
        devices=(
            _dev(0, gpu=0, uuid="uuid0", allocated=4 * MiB, reserved=20 * MiB),
            _dev(1, gpu=1, uuid="uuid1"),
        ),
    )
    (stray,) = build_report([r1]).strays
    assert "it has tensors there (4.0 MiB allocated, 20.0 MiB reserved)" in stray.cause
    assert "torch.load without map_location" in stray.cause
    assert "set_device" not in stray.cause.split(";")[0]  # its current device is right


def test_a_pid_only_nvml_sees_on_another_gpu_is_a_stray() -> None:
    gpus = _gpus((0, ((5, 300 * MiB),)), (1, ((5, 600 * MiB),)))
    r = _row(1, 5, own=1, current=1, devices=(_dev(1, gpu=1, uuid="uuid1"),), gpus=gpus)
    (stray,) = build_report([r]).strays
    assert stray.device is None and stray.gpu == 0 and stray.nbytes == 300 * MiB
    assert "NVML lists the process there" in stray.cause


def test_container_pids_leave_the_map_to_the_ranks_own_contexts() -> None:
    gpus = _gpus((0, ((999_000, 2 * 1024 * MiB),)))
    r = _row(0, 12, own=0, current=0, devices=(_dev(0, gpu=0, uuid="uuid0"),), gpus=gpus)
    report = build_report([r])
    assert report.gpus[0].rank is None and report.gpus[0].own is None
    assert any("inside containers NVML reports host PIDs" in n for n in report.notes)
    assert report.strays == ()
    assert "not a rank" in str(report)


def test_processes_are_matched_per_host() -> None:
    # The same pid on two hosts is two processes.
    a = _row(
        0,
        50,
        own=0,
        current=0,
        devices=(_dev(0, gpu=0, uuid="a0"),),
        host="a",
        gpus=(HostGpu(0, "a0", None, (_nvml.GpuProcess(50, None, MiB, "compute"),)),),
    )
    b = _row(
        1,
        50,
        own=0,
        current=0,
        devices=(_dev(0, gpu=0, uuid="b0"),),
        host="b",
        gpus=(HostGpu(0, "b0", None, (_nvml.GpuProcess(50, None, MiB, "compute"),)),),
    )
    a = dataclasses.replace(a, own_uuid="a0")
    b = dataclasses.replace(b, own_uuid="b0")
    report = build_report([a, b])
    assert {(h.host, h.rank, h.own) for h in report.gpus} == {("a", 0, True), ("b", 1, True)}
    assert report.strays == ()


def test_outliers_need_a_clear_winner() -> None:
    same = [
        _row(
            r,
            10 + r,
            own=0,
            current=0,
            growth=float(MiB),
            devices=(_dev(0, gpu=0, uuid="u", peak=5 * MiB),),
        )
        for r in range(2)
    ]
    report = build_report(same)
    assert report.peak_outlier is None and report.growth_outlier is None
    assert "the fastest-growing ranks grow alike: no outlier" in report.notes
    flat = [_row(r, 10 + r, growth=1000.0) for r in range(3)]
    report = build_report(flat)
    assert report.growth_outlier is None
    assert "no rank grows by 64.0 KiB or more per call" in report.notes


def test_the_growth_outlier_comes_from_spans_or_the_leak_detector() -> None:
    leak = RankGrowth("val", 3 * MiB, 20, ("__main__.outputs",))
    rows = [
        _row(0, 1, growth=float(MiB)),
        _row(1, 2, growth=None, leak=leak),
        _row(2, 3, growth=0.0),
    ]
    report = build_report(rows)
    out = report.growth_outlier
    assert out is not None and out.rank == 1 and out.value == 3 * MiB
    assert out.runner_up == MiB
    assert out.detail == (
        "highest growth, +3.0 MiB per call of 'val'; held by __main__.outputs "
        "(next: +1.0 MiB per call)"
    )


def test_unknown_stays_unknown_in_the_table() -> None:
    known = _dev(0, gpu=0, uuid="u", outside=700 * MiB, nccl=182 * MiB)
    unknown = _dev(1, gpu=1, uuid="v")
    report = build_report([_row(0, 1, own=0, current=0, devices=(known, unknown))])
    text = render_distributed(report)
    summary = text.splitlines()[3]
    # One device's NVML figures are unknown: the rank's sums are n/a, not 182 MiB.
    assert "182.0 MiB" not in summary and summary.count("n/a") >= 2
    block = text[text.index("rank 0 (pid 1") :]
    assert "700.0 MiB" in block and "182.0 MiB" in block
    assert (
        "NCCL (inferred) = outside allocator − a bare CUDA context (518.0 MiB: cudamem's "
        "default, measured on an H200 with CUDA 13, not on this card; context_estimate= sets "
        "yours)" in block
    )
    # An estimate the user gave is theirs: no card named.
    mine = dataclasses.replace(known, context_estimate=600 * MiB)
    text = render_distributed(build_report([_row(0, 1, own=0, current=0, devices=(mine,))]))
    assert "a bare CUDA context (600.0 MiB: context_estimate=)" in text
    assert "H200" not in text


def test_missing_ranks_and_round_trips() -> None:
    rows = [_row(0, 1), absent_row(1, 2, "no answer within 5 s (timeout)")]
    report = build_report(rows, world_size=2)
    assert report.pids == {0: 1, 1: None}
    assert "no row from rank 1" in report.notes
    assert "no answer" in str(report)
    data = json.loads(to_json(report))
    assert data["ranks"][1]["errors"] == ["no answer within 5 s (timeout)"]
    for row in report.ranks:
        assert RankReport.from_dict(json.loads(json.dumps(to_data(row)))) == row
    with pytest.raises(KeyError, match="rank 5"):
        report[5]


def test_collect_rank_on_the_cpu_creates_nothing() -> None:
    row = collect_rank()
    assert row.devices == () and row.current_device is None
    if not torch.cuda.is_available():
        assert row.own_device is None and row.own_basis == "no CUDA device"
