"""The device ledger and release() on recorded figures, at the NVML and allocator seams."""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.cache_split import split_cache
from cudamem.allocator.stats import AllocatorStats
from cudamem.ledger import nvml as _nvml
from cudamem.ledger.device import AllocatedSplit, DeviceLedger, Explanation
from cudamem.ledger.lines import build_ledger
from cudamem.ledger.reclaim import largest_storages
from cudamem.render.json import to_json

from ..fakes import FakeAllocator
from ..nvml_fakes import NO_PERMISSION, NOT_SUPPORTED, FakeGpu, GiB, MiB, make_nvml

PID = 4242
UUID = "GPU-11111111-2222-3333-4444-555555555555"


def stats(allocated: int, reserved: int, inactive_split: int = 0) -> AllocatorStats:
    return AllocatorStats(
        device=0,
        allocated=allocated,
        reserved=reserved,
        active=allocated,
        requested=allocated,
        peak_allocated=allocated,
        peak_reserved=reserved,
        inactive_split=inactive_split,
        alloc_count=0,
        free_count=0,
        segments=1,
        alloc_retries=0,
        ooms=0,
        timestamp_ns=0,
    )


def nvml_device(
    *,
    used: int,
    reserved: int | None = 615 * MiB,
    processes: list[tuple[int, int | None]] | None = None,
    processes_reason: str | None = None,
) -> _nvml.NvmlDevice:
    total = 140 * GiB
    procs = (
        None
        if processes is None
        else tuple(_nvml.GpuProcess(p, f"proc{p}", u, "compute") for p, u in processes)
    )
    return _nvml.NvmlDevice(
        index=0,
        uuid=UUID,
        name="NVIDIA H200",
        memory=_nvml.DeviceMemory(total, total - used, used, reserved, "v2" if reserved else "v1"),
        memory_reason=None,
        processes=procs,
        processes_reason=processes_reason,
        process_api="v3",
    )


def seg(stream: int, total: int, live: list[tuple[int, int]]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {"address": a, "size": s, "state": "active_allocated"} for a, s in live
    ]
    used = sum(s for _, s in live)
    if total > used:
        blocks.append({"address": 0, "size": total - used, "state": "inactive"})
    return {"device": 0, "stream": stream, "total_size": total, "blocks": blocks}


def sizes(ledger: DeviceLedger) -> dict[str, int | None]:
    return {line.key: line.nbytes for line in ledger.lines}


# -- seed 001: a 4 MiB tensor, nvidia-smi +1.2 GB --------------------------------------


def seed001_ledger(*, alive: bool) -> DeviceLedger:
    context = 520 * MiB
    live = [(0x1000, 4 * MiB)] if alive else []
    own = context + 20 * MiB
    return build_ledger(
        0,
        stats=stats(4 * MiB if alive else 0, 20 * MiB, 16 * MiB if alive else 0),
        nvml=nvml_device(used=615 * MiB + own, processes=[(PID, own)]),
        pid=PID,
        cache=split_cache([seg(0, 20 * MiB, live)]),
        allocated=AllocatedSplit(4 * MiB, 0, 0, 0) if alive else AllocatedSplit(0, 0, 0, 0),
    )


def test_seed001_the_jump_is_the_context_and_the_segment() -> None:
    ledger = seed001_ledger(alive=True)
    got = sizes(ledger)
    assert got["driver_reserve"] == 615 * MiB
    assert got["context"] == 520 * MiB  # inferred: NVML's 540 MiB − reserved 20 MiB
    assert got["allocated_live"] == 4 * MiB
    assert got["cache_non_releasable"] == 16 * MiB  # the rest of the 20 MiB segment
    assert got["cache_releasable"] == 0 and got["cache_stranded"] == 0
    assert got["unattributed"] == 0
    assert ledger.accounted == ledger.nvml_used
    assert ledger.smi_used == 540 * MiB  # what nvidia-smi shows: reserve excluded
    context = ledger.line("context")
    assert context is not None and context.basis == "inferred"
    assert "process exiting" in context.frees


def test_seed001_after_del_the_whole_segment_is_releasable() -> None:
    got = sizes(seed001_ledger(alive=False))
    assert got["cache_releasable"] == 20 * MiB  # what empty_cache() gave back in the seed
    assert got["cache_non_releasable"] == 0
    line = seed001_ledger(alive=False).line("cache_releasable")
    assert line is not None and "empty_cache" in line.frees


def test_every_line_says_what_frees_it() -> None:
    for line in seed001_ledger(alive=True).lines:
        assert line.frees
        assert line.basis in ("measured", "inferred")


def test_lines_add_up_with_other_processes_and_stranded_streams() -> None:
    own = 600 * MiB + 200 * MiB
    others = [(7, 3 * GiB), (8, 1 * GiB)]
    used = 615 * MiB + own + 4 * GiB + 1 * MiB  # 1 MiB NVML does not attribute
    segments = [
        seg(0, 100 * MiB, [(0x1000, 60 * MiB)]),
        seg(0xA1, 60 * MiB, []),
        seg(0xA2, 40 * MiB, [(0xB000, 32 * MiB)]),  # only a cuBLAS workspace lives there
    ]
    split = AllocatedSplit(
        live_tensors=50 * MiB, autograd_saved=10 * MiB, cublas_workspaces=32 * MiB, unaccounted=0
    )
    ledger = build_ledger(
        0,
        stats=stats(92 * MiB, 200 * MiB, 40 * MiB),
        nvml=nvml_device(used=used, processes=[(PID, own), *others]),
        pid=PID,
        cache=split_cache(segments, tensor_addresses={0x1000}),
        allocated=split,
        other_in_process=[("CuPy memory pool", 100 * MiB)],
    )
    got = sizes(ledger)
    assert got["context"] == own - 200 * MiB - 100 * MiB
    assert got["other_nonpytorch:CuPy memory pool"] == 100 * MiB
    assert got["cache_stranded"] == 60 * MiB + 8 * MiB
    assert got["cache_non_releasable"] == 40 * MiB
    assert got["cache_releasable"] == 0
    assert got["allocated_autograd"] == 10 * MiB
    assert got["allocated_cublas"] == 32 * MiB
    assert got["process:7"] == 3 * GiB and got["process:8"] == 1 * GiB
    assert got["unattributed"] == 1 * MiB
    assert ledger.accounted == used
    assert ledger.cache is not None and ledger.cache.stranded_in_live_segments == 8 * MiB
    text = str(ledger)
    assert (
        "stranded" in text
        and "pid 7 proc7" in text
        and "driver memory outside every process" in text
    )


def test_without_snapshot_the_counters_split_the_cache() -> None:
    ledger = build_ledger(
        0,
        stats=stats(4 * MiB, 20 * MiB, 16 * MiB),
        nvml=nvml_device(used=615 * MiB + 540 * MiB, processes=[(PID, 540 * MiB)]),
        pid=PID,
    )
    got = sizes(ledger)
    assert got["cache_non_releasable"] == 16 * MiB and got["cache_releasable"] == 0
    assert got["cache_stranded"] is None  # unknown without the snapshot, not 0
    assert got["allocated"] == 4 * MiB
    assert "unattributed" not in got  # cannot be computed with an unknown line
    line = ledger.line("allocated")
    assert line is not None and "census" in line.note


def test_census_split_that_disagrees_falls_back_to_one_line() -> None:
    ledger = build_ledger(
        0,
        stats=stats(8 * MiB, 20 * MiB),
        nvml=None,
        pid=PID,
        allocated=AllocatedSplit(4 * MiB, 0, 0, 0),
    )
    assert sizes(ledger)["allocated"] == 8 * MiB


def test_nvml_unavailable_keeps_allocator_lines_and_says_why() -> None:
    ledger = build_ledger(
        0, stats=stats(4 * MiB, 20 * MiB), nvml=None, pid=PID, nvml_reason="driver not loaded"
    )
    got = sizes(ledger)
    assert got["context"] is None and got["driver_reserve"] is None
    assert got["allocated"] == 4 * MiB
    assert ledger.nvml_used is None
    assert any("driver not loaded" in n for n in ledger.notes)
    assert "n/a" in str(ledger)


def test_pid_not_visible_gives_device_level_figures() -> None:
    # In a container NVML lists host PIDs: ours (4242) is not among them.
    used = 615 * MiB + 540 * MiB + 2 * GiB
    ledger = build_ledger(
        0,
        stats=stats(4 * MiB, 20 * MiB, 16 * MiB),
        nvml=nvml_device(used=used, processes=[(99001, 540 * MiB), (99002, 2 * GiB)]),
        pid=PID,
    )
    got = sizes(ledger)
    assert "context" not in got
    assert got["context_and_processes"] == 540 * MiB + 2 * GiB - 20 * MiB
    assert ledger.accounted == used
    assert any("PID namespace" in n for n in ledger.notes)
    assert any("99001" in n for n in ledger.notes)
    assert not any(k.startswith("process:") for k in got)


def test_process_list_not_supported() -> None:
    ledger = build_ledger(
        0,
        stats=stats(0, 0),
        nvml=nvml_device(used=1 * GiB, processes=None, processes_reason="not supported (MIG)"),
        pid=PID,
    )
    assert any("not supported" in n for n in ledger.notes)
    assert sizes(ledger)["context_and_processes"] == 1 * GiB - 615 * MiB


def test_wddm_own_figure_unknown() -> None:
    ledger = build_ledger(
        0,
        stats=stats(0, 20 * MiB),
        nvml=nvml_device(used=2 * GiB, processes=[(PID, None)]),
        pid=PID,
    )
    got = sizes(ledger)
    assert "context" not in got  # our own figure is unknown: one device-level line instead
    assert got["context_and_processes"] == 2 * GiB - 615 * MiB - 20 * MiB
    assert any("WDDM" in n for n in ledger.notes)


def test_v1_only_reserve_is_inferred() -> None:
    own = 540 * MiB
    ledger = build_ledger(
        0,
        stats=stats(4 * MiB, 20 * MiB, 16 * MiB),
        nvml=nvml_device(used=615 * MiB + own, reserved=None, processes=[(PID, own)]),
        pid=PID,
    )
    line = ledger.line("driver_reserve")
    assert line is not None and line.nbytes == 615 * MiB and line.basis == "inferred"
    assert ledger.smi_used is None


def test_device_without_context_uses_nothing() -> None:
    ledger = build_ledger(
        1,
        stats=AllocatorStats.zero(1),
        nvml=nvml_device(used=615 * MiB, processes=[]),
        pid=PID,
        has_context=False,
    )
    assert sizes(ledger)["context"] == 0
    assert sizes(ledger)["unattributed"] == 0


def test_suspicious_context_is_flagged() -> None:
    own = 2 * GiB
    ledger = build_ledger(
        0,
        stats=stats(0, 0),
        nvml=nvml_device(used=615 * MiB + own, processes=[(PID, own)]),
        pid=PID,
    )
    assert any("NCCL" in n for n in ledger.notes)


def test_ledger_is_json_ready() -> None:
    ledger = seed001_ledger(alive=True)
    data = json.loads(to_json(ledger))
    assert data["nvml_used"] == ledger.nvml_used
    assert sum(line["nbytes"] for line in data["lines"]) == ledger.nvml_used
    assert {line["basis"] for line in data["lines"]} == {"measured", "inferred"}
    explanation = Explanation((ledger,), _nvml.NvmlStatus(True, None, "580"))
    assert json.loads(to_json(explanation))["devices"][0]["device"] == 0
    assert explanation[0] is ledger


# -- explain() and release() end to end through the seams -----------------------------


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    alloc = FakeAllocator(devices=2, contexts=())
    alloc.alloc(4 * MiB, 0)
    alloc.reserved[0] = 20 * MiB
    own = 520 * MiB + 20 * MiB
    gpus = [
        FakeGpu(UUID, used=615 * MiB + own + 1 * GiB, processes=[(os.getpid(), own), (7, GiB)]),
        FakeGpu("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", used=615 * MiB),
    ]
    with _backend.use(alloc), _nvml.use_module(make_nvml(gpus, names={7: "other"})):
        yield alloc


def test_explain_covers_only_devices_this_process_uses(fake_gpu: FakeAllocator) -> None:
    result = cudamem.explain()
    assert [d.device for d in result.devices] == [0]
    ledger = result[0]
    got = sizes(ledger)
    assert got["context"] == 520 * MiB
    assert got["process:7"] == GiB
    assert ledger.accounted == ledger.nvml_used
    assert fake_gpu.calls["synchronize"] == 0  # explain() never synchronizes
    assert 1 not in fake_gpu.contexts  # ... nor touches another device
    text = str(result)
    assert "CUDA context" in text and "freed by" in text


class SegmentsFake(FakeAllocator):
    """The fixture's GPU with the snapshot of its cache: a 4 MiB tensor in a 20 MiB segment."""

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        return [seg(0, 20 * MiB, [(0x1000, 4 * MiB)])] if device == 0 else []


def test_explain_carries_the_fragmentation_beside_lines_that_still_add_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    alloc = SegmentsFake(devices=1, contexts=())
    alloc.alloc(4 * MiB, 0)
    alloc.reserved[0] = 20 * MiB
    own = 520 * MiB + 20 * MiB
    gpu = FakeGpu(UUID, used=615 * MiB + own, processes=[(os.getpid(), own)])
    with _backend.use(alloc), _nvml.use_module(make_nvml([gpu])):
        ledger = cudamem.explain()[0]
    frag = ledger.fragmentation
    assert frag is not None and frag.device == 0
    assert (frag.reserved, frag.allocated, frag.stranded, frag.largest_free) == (
        20 * MiB,
        4 * MiB,
        16 * MiB,
        16 * MiB,
    )
    assert ledger.accounted == ledger.nvml_used  # no fragmentation figure is a line
    assert sizes(ledger)["cache_non_releasable"] == 16 * MiB
    text = str(ledger)
    assert "cuda:0 fragmentation: 16.0 MiB of 20.0 MiB reserved is unallocated (80%)" in text
    assert "stranded: 16.0 MiB free beside live blocks" in text


def test_explain_a_named_device_without_context(fake_gpu: FakeAllocator) -> None:
    result = cudamem.explain("cuda:1")
    assert [d.device for d in result.devices] == [1]
    assert any("no CUDA context" in n for n in result[1].notes)
    assert 1 not in fake_gpu.contexts


def test_explain_nothing_used_yet() -> None:
    with _backend.use(FakeAllocator(devices=1, contexts=())):
        result = cudamem.explain()
    assert result.devices == ()
    assert "no CUDA context" in str(result)


@pytest.mark.parametrize("code", [NOT_SUPPORTED, NO_PERMISSION])
def test_explain_with_failing_process_list(code: int) -> None:
    alloc = FakeAllocator(devices=1, contexts=(0,))
    gpus = [FakeGpu(UUID, used=2 * GiB, processes=[(os.getpid(), GiB)])]
    nvml = make_nvml(gpus, errors={"nvmlDeviceGetComputeRunningProcesses_v3": code})
    with _backend.use(alloc), _nvml.use_module(nvml):
        ledger = cudamem.explain()[0]
    assert ledger.line("context_and_processes") is not None
    assert ledger.accounted == ledger.nvml_used


def test_explain_without_driver_is_one_line_not_an_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No nvidia-ml-py (import pynvml fails) on a machine with one used device, then none.
    monkeypatch.setattr(_nvml, "_state", _nvml._State())
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with _backend.use(FakeAllocator(devices=1, contexts=(0,))):
        result = cudamem.explain()
    assert not result.nvml.available
    reason = result.nvml.reason
    assert reason is not None and "nvidia-ml-py is not installed" in reason and "\n" not in reason
    assert [d.device for d in result.devices] == [0]
    assert result[0].nvml_used is None  # unknown, not 0
    assert f"NVML unavailable: {reason}" in str(result).splitlines()
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        named = cudamem.explain("cuda:0")
    assert named.devices == () and "cuda:0 cannot be explained: torch sees no CUDA device" in str(
        named
    )


def test_release_reports_what_was_freed(fake_gpu: FakeAllocator) -> None:
    # 100 self-referencing lists only a collection frees (automatic collection held off).
    gc.disable()
    try:
        for _ in range(100):
            cycle: list[object] = []
            cycle.append(cycle)
        del cycle
        result = cudamem.release(holders=False)
    finally:
        gc.enable()
    rec = result[0]
    assert rec.freed_reserved == 16 * MiB  # the cache around the live 4 MiB
    assert rec.still_allocated == 4 * MiB
    assert rec.nvml_used_before is not None  # NVML figures come with it
    assert result.gc_collected >= 100
    assert "still allocated" in str(result)
    json.loads(to_json(result))


def test_release_of_one_device_empties_every_cache(fake_gpu: FakeAllocator) -> None:
    # empty_cache() has no device argument: asking about cuda:0 empties cuda:1's cache too.
    fake_gpu.alloc(2 * MiB, 1)
    fake_gpu.reserved[1] = 10 * MiB
    result = cudamem.release("cuda:0", holders=False)
    assert [d.device for d in result.devices] == [0]
    assert result[0].freed_reserved == 16 * MiB
    assert fake_gpu.reserved == {0: 4 * MiB, 1: 2 * MiB}
    assert fake_gpu.calls["empty_cache"] == 1


def test_fake_empty_cache_empties_every_device() -> None:
    fake = FakeAllocator(devices=3, contexts=(0, 1, 2))
    for device, (live, cached) in enumerate([(1, 3), (0, 5), (2, 0)]):
        fake.alloc(live * MiB, device)
        fake.reserved[device] += cached * MiB
    fake.empty_cache()
    assert fake.reserved == {0: 1 * MiB, 1: 0, 2: 2 * MiB}
    assert fake.allocated == {0: 1 * MiB, 1: 0, 2: 2 * MiB}


def test_release_without_context_does_nothing() -> None:
    with _backend.use(FakeAllocator(devices=1, contexts=())):
        result = cudamem.release()
    assert result.devices == () and "nothing to release" in str(result)


# -- seed 001's second loop: `del optimizer` forgotten ---------------------------------


from cudamem.demo import NaiveN  # noqa: E402  (seed 001's model, bug included)


def test_forgotten_optimizer_is_named_as_holder_cpu() -> None:
    nx = 2048  # lin1.weight: 16 MiB, larger than any other CPU tensor of the test process
    model = NaiveN(nx)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.ones(64, nx), torch.ones(64, 1)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    del loss, x, y, model  # ... but not the optimizer
    largest = largest_storages("cpu", top=1)
    assert largest and largest[0].nbytes == nx * nx * 4
    assert largest[0].describe() == f"float32[{nx}, {nx}]"
    held = " | ".join(largest[0].paths[:5])  # what release() prints
    assert "optimizer" in held, held
    assert "param_groups" in held or "state" in held or "Adam" in held, held


def test_holder_search_keeps_no_deleted_local_alive() -> None:
    # Before 3.13 reading frame.f_locals leaves a snapshot dict on the frame; a holder search
    # that kept it would keep `optimizer` alive after the `del` below (a cudamem-made leak).
    nx = 2048
    model = NaiveN(nx)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    weight = weakref.ref(model.lin1.weight)
    x, y = torch.ones(64, nx), torch.ones(64, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    del loss, x, y, model
    assert largest_storages("cpu", top=1)[0].holders
    del optimizer
    gc.collect()
    assert weight() is None
