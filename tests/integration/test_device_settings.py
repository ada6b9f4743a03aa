"""The ledger under modern allocator settings, on recorded snapshots (CPU only).

Expandable segments, CUDA graph private pools, torch.compile's cudagraph pools, blocks awaiting
``record_stream`` events, cuBLAS workspaces per stream and contexts on devices the process
never used: each line's bytes against what the allocator's rules give, and every ledger adding
up to NVML's ``used``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import pickle
import sys
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import torch_backend as _torch_backend
from cudamem.allocator.backend_base import PoolOwners
from cudamem.allocator.cache_split import (
    graph_pool_blocks,
    pool_blocks_of,
    split_cache,
    workspace_streams,
)
from cudamem.allocator.snapshot import LARGE_PAGE, SMALL_PAGE, load_snapshot, segments_of
from cudamem.allocator.stats import AllocatorStats
from cudamem.allocator.torch_backend import instances_of
from cudamem.ledger import nvml as _nvml
from cudamem.ledger.device import AllocatedSplit, DeviceLedger
from cudamem.ledger.lines import build_ledger
from cudamem.render.json import to_json

from .. import snapshot_data as sd
from ..fakes import FakeAllocator
from ..nvml_fakes import FakeGpu, GiB, make_nvml

MiB = 1024**2
PID = 4242
UUID = "GPU-11111111-2222-3333-4444-555555555555"
CONTEXT = 520 * MiB
OUTSIDE = 8 * MiB + 819 * 1024  # driver memory NVML lists under no process (8.8 MiB)
DATA = Path(__file__).resolve().parents[1] / "data"


def counters(segments: list[dict[str, Any]], **kw: int) -> AllocatorStats:
    reserved, allocated, active = sd.totals(segments)
    values: dict[str, Any] = {
        "device": 0,
        "allocated": allocated,
        "reserved": reserved,
        "active": active,
        "requested": allocated,
        "peak_allocated": allocated,
        "peak_reserved": reserved,
        "inactive_split": 0,
        "alloc_count": 10,
        "free_count": 4,
        "segments": len(segments),
        "alloc_retries": 0,
        "ooms": 0,
        "timestamp_ns": 0,
    }
    values.update(kw)
    return AllocatorStats(**values)


def nvml_reading(reserved: int, context: int = CONTEXT) -> _nvml.NvmlDevice:
    own = context + reserved
    total = 140 * GiB
    used = 615 * MiB + own + OUTSIDE
    return _nvml.NvmlDevice(
        index=0,
        uuid=UUID,
        name="NVIDIA H200",
        memory=_nvml.DeviceMemory(total, total - used, used, 615 * MiB, "v2"),
        memory_reason=None,
        processes=(_nvml.GpuProcess(PID, "python", own, "compute"),),
        processes_reason=None,
        process_api="v3",
    )


def ledger_of(
    segments: list[dict[str, Any]],
    *,
    owners: PoolOwners | None = None,
    addresses: set[int] | None = None,
    split: AllocatedSplit | None = None,
) -> DeviceLedger:
    stats = counters(segments)
    cache = split_cache(segments, tensor_addresses=addresses, pool_owners=owners)
    rest = stats.allocated - cache.pools_allocated
    return build_ledger(
        0,
        stats=stats,
        nvml=nvml_reading(stats.reserved),
        pid=PID,
        cache=cache,
        allocated=split or AllocatedSplit(0, 0, 0, rest),
    )


def sizes(ledger: DeviceLedger) -> dict[str, int | None]:
    return {line.key: line.nbytes for line in ledger.lines}


def adds_up(ledger: DeviceLedger) -> None:
    assert ledger.accounted == ledger.nvml_used
    assert ledger.unattributed == OUTSIDE


# -- expandable segments ---------------------------------------------------------------


def test_expandable_split_is_what_empty_cache_unmaps() -> None:
    segs = sd.expandable_three_tensors()
    split = split_cache(segs)
    assert split.expandable
    assert split.reserved == 860 * MiB and split.live == 572 * MiB
    # 13 whole 20 MiB pages inside the deleted tensor's [286, 572) MiB: 860 → 600 MiB.
    assert split.releasable == 260 * MiB
    # 14 MiB + 12 MiB of that hole share pages with live tensors, plus the 2 MiB tail.
    assert split.non_releasable == 28 * MiB == split.partial_pages
    assert split.empty_cache_returns == 260 * MiB
    after = sd.expandable_three_tensors_after_empty_cache()
    assert sum(s["total_size"] for s in after) == 860 * MiB - split.releasable
    again = split_cache(after)
    assert again.releasable == 0 and again.partial_pages == 28 * MiB


def test_expandable_ledger_says_releasable_not_zero() -> None:
    ledger = ledger_of(sd.expandable_three_tensors())
    got = sizes(ledger)
    assert got["cache_releasable"] == 260 * MiB  # the "releasable 0 B" was wrong
    assert got["cache_non_releasable"] == 28 * MiB
    assert got["cache_stranded"] == 0
    assert got["context"] == CONTEXT
    adds_up(ledger)
    text = str(ledger)
    assert "approximate" not in text
    assert "20 MiB" in text and "expandable segments are on" in text
    non = ledger.line("cache_non_releasable")
    assert non is not None and "pages that also hold part of a live block" in non.note


def test_without_expandable_the_same_hole_is_not_releasable() -> None:
    # The same layout in an ordinary segment: cudaFree returns whole segments only.
    segs = sd.expandable_three_tensors()
    segs[0]["is_expandable"] = False
    split = split_cache(segs)
    assert split.releasable == 0
    assert split.non_releasable == 288 * MiB == split.in_live_segments
    assert split.partial_pages == 0


def test_small_pool_pages_are_2mib() -> None:
    split = split_cache(sd.expandable_small_pool())
    assert [SMALL_PAGE // MiB, LARGE_PAGE // MiB] == [2, 20]
    assert split.releasable == 2 * MiB  # page 2, wholly free
    assert split.partial_pages == 512 * 1024  # the hole inside page 1
    # read as a large-pool segment, no whole 20 MiB page is free at all
    segs = sd.expandable_small_pool()
    segs[0]["segment_type"] = "large"
    assert split_cache(segs).releasable == 0


def test_expandable_page_rule_on_unaligned_blocks() -> None:
    # A free run that starts 1 byte after a page boundary and ends 1 byte before the next-but-
    # two: only the one whole page between them goes back.
    base = sd.BASE
    segs = [
        sd.segment(
            base,
            [(20 * MiB + 1, sd.A), (40 * MiB - 2, sd.F), (1, sd.A), (19 * MiB, sd.F)],
            expandable=True,
        )
    ]
    segs[0]["total_size"] += 1 * MiB  # the allocator maps whole pages: 80 MiB
    segs[0]["blocks"][-1]["size"] += 1 * MiB
    split = split_cache(segs)
    assert split.releasable == 20 * MiB
    assert split.releasable + split.non_releasable == split.cached


def test_expandable_without_snapshot_is_one_unsplit_line() -> None:
    segs = sd.expandable_three_tensors()
    stats = counters(segs)
    ledger = build_ledger(
        0,
        stats=stats,
        nvml=nvml_reading(stats.reserved),
        pid=PID,
        expandable_segments=True,
    )
    got = sizes(ledger)
    assert got["cache"] == 288 * MiB
    assert "cache_releasable" not in got  # no guess: the counters cannot split it
    adds_up(ledger)


def test_expandable_segments_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudamem.ledger.lines import expandable_segments_configured

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert expandable_segments_configured()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments_configured()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:true")
    assert expandable_segments_configured()


# -- CUDA graph private pools ----------------------------------------------------------


GRAPH = PoolOwners(graphs={(1, 0): 1})


def test_graph_pool_line_holds_the_whole_pool() -> None:
    segs = sd.cuda_graph_64mib()
    ledger = ledger_of(segs, owners=GRAPH, addresses={sd.GRAPH_OUTPUT, *sd.GRAPH_INPUTS})
    got = sizes(ledger)
    assert got["graph_pools:cuda_graph"] == 64 * MiB + 40 * MiB
    line = ledger.line("graph_pools:cuda_graph")
    assert line is not None
    assert "1 pool, 1 graph" in line.label
    assert "only deleting the graph" in line.frees
    assert "64.0 MiB of it in tensors Python holds" in line.note
    assert "(1, 0)" in line.note
    # The pool's 8 MiB free is neither releasable nor non-releasable cache.
    assert got["cache_releasable"] == 0 and got["cache_non_releasable"] == 0
    # Outside the pool: x, w and the warm-up's workspace.
    assert ledger.cache is not None and ledger.cache.pools_allocated == 96 * MiB
    assert got["allocated_unaccounted"] == 160 * MiB
    adds_up(ledger)
    assert "CUDA graph private pools (1 pool, 1 graph)" in str(ledger)


def test_deleted_graph_pool_is_ordinary_cache_again() -> None:
    # No live graph uses the pool: empty_cache() frees it like any other (freeable pool).
    segs = sd.cuda_graph_64mib()
    split = split_cache(segs, tensor_addresses={sd.GRAPH_OUTPUT}, pool_owners=PoolOwners())
    assert split.pools_free == 0 and sum(p.reserved for p in split.held_pools) == 0
    assert not split.pools[0].held and split.pools[0].graphs == 0
    assert split.non_releasable == 8 * MiB  # beside the capture's live workspace


def test_snapshot_from_a_file_keeps_every_pool_held() -> None:
    snap = load_snapshot(DATA / "cuda_graph_64mib.pickle")
    split = split_cache(segments_of(snap, 0))
    (pool,) = split.pools
    assert pool.held and pool.graphs is None and pool.kind == "cuda_graph"
    assert pool.reserved == 104 * MiB and pool.allocated == 96 * MiB and pool.free == 8 * MiB
    assert split.pools_free == 8 * MiB


def test_graph_pool_excludes_its_workspace_from_the_cublas_line() -> None:
    segs = sd.cuda_graph_64mib()
    outside = [s for s in segs if s["segment_pool_id"] == (0, 0)]
    assert workspace_streams(outside, (32 * MiB,), set(sd.GRAPH_INPUTS)) == {sd.SIDE: 1}
    assert workspace_streams(segs, (32 * MiB,), set(sd.GRAPH_INPUTS)) == {sd.SIDE: 1, sd.CAPTURE: 1}


def test_pool_kinds_from_ids_and_owners() -> None:
    segs = sd.cudagraph_tree()
    tree = PoolOwners(graphs={(0, 1): 2}, trees={(0, 1): 0}, trees_loaded=True)
    ledger = ledger_of(segs, owners=tree)
    line = ledger.line("graph_pools:cudagraph_tree")
    assert line is not None and line.nbytes == 42 * MiB
    assert line.label == "torch.compile cudagraph pools (1 pool, 2 graphs)"
    assert "torch._dynamo.reset()" in line.frees
    adds_up(ledger)
    # A graph_pool_handle() pool that no tree manager claims, with torch.compile loaded:
    # the allocator cannot say whose it is, and the line says so.
    shared = ledger_of(segs, owners=PoolOwners(graphs={(0, 1): 1}, trees_loaded=True))
    line = shared.line("graph_pools:shared_graph")
    assert line is not None and "does not say" in line.note
    # Without torch.compile's trees imported, it can only be the user's own graphs.
    own = ledger_of(segs, owners=PoolOwners(graphs={(0, 1): 1}, trees_loaded=False))
    assert own.line("graph_pools:cuda_graph") is not None
    # A MemPool's pool
    mem = ledger_of(segs, owners=PoolOwners(mempools=frozenset({(0, 1)})))
    line = mem.line("graph_pools:mempool")
    assert line is not None and "MemPool" in line.label and line.nbytes == 42 * MiB


def test_pool_blocks_map_addresses_to_pools() -> None:
    blocks = pool_blocks_of(0, sd.cuda_graph_64mib(), GRAPH)
    inside = blocks.pool_of(sd.GRAPH_OUTPUT + 12345)
    assert inside is not None and inside.pool_id == (1, 0) and inside.kind == "cuda_graph"
    assert inside.size == 64 * MiB
    assert blocks.pool_of(sd.GRAPH_INPUTS[0]) is None  # x lives in the default pool
    assert blocks.pool_of(sd.GRAPH_OUTPUT + 64 * MiB + 32 * MiB + 1) is None  # the free 8 MiB
    assert blocks.pool_of(0) is None
    pool = blocks.pool((1, 0))
    assert pool is not None and pool.graphs == 1 and pool.held
    assert json.loads(to_json(blocks))["blocks"][0]["pool_id"] == [1, 0]


# -- record_stream: blocks awaiting events ---------------------------------------------


def test_pending_free_blocks_get_their_own_line() -> None:
    segs = sd.record_stream_pending()
    split = split_cache(segs)
    assert split.pending_free == 32 * MiB
    assert split.pending_releasable == 32 * MiB  # alone in its segment: empty_cache frees it
    assert split.non_releasable == 16 * MiB and split.releasable == 0
    ledger = ledger_of(segs)
    line = ledger.line("cache_pending_free")
    assert line is not None and line.nbytes == 32 * MiB
    assert "record_stream" in line.label
    adds_up(ledger)


def test_no_pending_line_when_there_is_none() -> None:
    assert ledger_of(sd.expandable_three_tensors()).line("cache_pending_free") is None


def test_pending_from_counters_without_snapshot() -> None:
    segs = sd.record_stream_pending()
    stats = counters(segs, inactive_split=16 * MiB)
    ledger = build_ledger(0, stats=stats, nvml=nvml_reading(stats.reserved), pid=PID)
    got = sizes(ledger)
    assert got["cache_pending_free"] == 32 * MiB  # active − allocated
    assert got["cache_non_releasable"] == 16 * MiB and got["cache_releasable"] == 0
    assert got["cache_stranded"] is None


# -- cuBLAS workspaces per stream, contexts on untouched devices -----------------------


def test_context_on_a_device_never_allocated_on() -> None:
    ledger = build_ledger(
        0,
        stats=AllocatorStats.zero(0),
        nvml=nvml_reading(0, context=524 * MiB),
        pid=PID,
    )
    line = ledger.line("context")
    assert line is not None and line.nbytes == 524 * MiB
    assert "never allocated" in line.label
    assert "torch.cuda.set_device" in line.frees
    assert any("thread" in n and "set_device" in n for n in ledger.notes)
    # a device that has been used keeps the plain label
    used = ledger_of(sd.record_stream_pending()).line("context")
    assert used is not None and used.label == "CUDA context and loaded kernels"


# -- explain() and release() end to end through the seams -------------------------------


class SnapshotAllocator(FakeAllocator):
    """A fake allocator whose counters and snapshot come from recorded segments."""

    def __init__(
        self,
        segments: list[dict[str, Any]],
        *,
        owners: PoolOwners | None = None,
        after: list[dict[str, Any]] | None = None,
        workspace: int | None = None,
    ) -> None:
        super().__init__(devices=1, contexts=(0,))
        self.segments = segments
        self.owners = owners
        self.after = after
        self.workspace = workspace
        self.owner_searches = 0

    def read(self, device: int) -> AllocatorStats:
        self.calls["read"] += 1
        return counters(self.segments)

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        return copy.deepcopy(self.segments)

    def private_pool_owners(self) -> PoolOwners | None:
        self.owner_searches += 1
        return self.owners

    def cublas_workspace_sizes(self, device: int) -> tuple[int, ...]:
        return () if self.workspace is None else (self.workspace,)

    def clear_cublas_workspaces(self) -> bool:
        # The workspaces' blocks go back to the cache (what _cuda_clearCublasWorkspaces does).
        for seg in self.segments:
            for b in seg["blocks"]:
                if b["state"] == sd.A and b["requested_size"] == self.workspace:
                    b["state"] = sd.F
            seg["allocated_size"] = sum(b["size"] for b in seg["blocks"] if b["state"] == sd.A)
            seg["active_size"] = sum(b["size"] for b in seg["blocks"] if b["state"] != sd.F)
        return self.workspace is not None

    def empty_cache(self) -> None:
        if self.after is not None:
            self.segments = self.after


@pytest.fixture
def nvml_for(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stack: list[Any] = []

    def use(alloc: SnapshotAllocator, context: int = CONTEXT) -> None:
        reserved = counters(alloc.segments).reserved
        own = context + reserved
        gpu = FakeGpu(UUID, used=615 * MiB + own + OUTSIDE, processes=[(os.getpid(), own)])
        cm = _nvml.use_module(make_nvml([gpu]))
        cm.__enter__()
        stack.append(cm)
        be = _backend.use(alloc)
        be.__enter__()
        stack.append(be)

    yield use
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def test_explain_expandable_end_to_end(nvml_for: Any) -> None:
    alloc = SnapshotAllocator(sd.expandable_three_tensors())
    nvml_for(alloc)
    ledger = cudamem.explain()[0]
    got = sizes(ledger)
    assert got["cache_releasable"] == 260 * MiB
    assert got["allocated_unaccounted"] == 572 * MiB  # no CUDA tensor in this process
    assert ledger.accounted == ledger.nvml_used
    assert alloc.owner_searches == 0  # no private pool: no heap scan for graphs


def test_explain_graph_pool_end_to_end(nvml_for: Any) -> None:
    alloc = SnapshotAllocator(sd.cuda_graph_64mib(), owners=GRAPH, workspace=32 * MiB)
    nvml_for(alloc)
    ledger = cudamem.explain()[0]
    got = sizes(ledger)
    assert got["graph_pools:cuda_graph"] == 104 * MiB
    # the census split only the allocated bytes outside the pool: x, w, one workspace
    assert got["allocated_cublas"] == 32 * MiB
    assert got["allocated_unaccounted"] == 128 * MiB
    assert ledger.accounted == ledger.nvml_used
    assert alloc.owner_searches == 1


def test_explain_cublas_workspaces_per_stream(nvml_for: Any) -> None:
    alloc = SnapshotAllocator(sd.stream_per_run(), workspace=32 * MiB)
    nvml_for(alloc)
    ledger = cudamem.explain()[0]
    line = ledger.line("allocated_cublas")
    assert line is not None and line.nbytes == 96 * MiB
    assert "3 workspaces" in line.note and "on 3 streams" in line.note
    assert sizes(ledger)["cache_stranded"] == 3 * 68 * MiB
    assert ledger.accounted == ledger.nvml_used
    assert "3 workspaces" in str(ledger)


def test_release_frees_workspaces_and_says_what_stays(nvml_for: Any) -> None:
    after = [sd.segment(sd.BASE, [(4 * MiB, sd.A), (16 * MiB, sd.F)])]
    alloc = SnapshotAllocator(sd.stream_per_run(), workspace=32 * MiB, after=after)
    nvml_for(alloc)
    result = cudamem.release(holders=False)
    rec = result[0]
    assert rec.cublas_freed == 96 * MiB
    assert rec.freed_reserved == 300 * MiB
    assert rec.still_cached == 16 * MiB
    assert rec.kept is not None and rec.kept.in_live_segments == 16 * MiB
    text = str(result)
    assert "96.0 MiB of it cuBLAS workspaces" in text
    assert "16.0 MiB free inside segments that still hold live blocks" in text
    data = json.loads(to_json(result))
    assert data["devices"][0]["cublas_freed"] == 96 * MiB
    assert data["devices"][0]["kept"]["in_live_segments"] == 16 * MiB


def test_release_under_expandable_segments_says_what_stays_mapped(nvml_for: Any) -> None:
    # The second release(): nothing left to free, and now it says why.
    segs = sd.expandable_three_tensors_after_empty_cache()
    alloc = SnapshotAllocator(segs, after=sd.expandable_three_tensors_after_empty_cache())
    nvml_for(alloc)
    rec = cudamem.release(holders=False)[0]
    assert rec.freed_reserved == 0
    assert rec.kept is not None and rec.kept.partial_pages == 28 * MiB
    text = str(cudamem.release(holders=False))
    assert "freed 0 B" in text
    assert "28.0 MiB stays mapped in expandable segments" in text
    assert "whole pages are unmapped: 20 MiB" in text


def test_release_names_graph_pools(nvml_for: Any) -> None:
    segs = sd.cuda_graph_64mib()
    alloc = SnapshotAllocator(segs, owners=GRAPH, after=sd.cuda_graph_64mib())
    nvml_for(alloc)
    result = cudamem.release(holders=False)
    rec = result[0]
    assert rec.kept is not None and rec.kept.pools_free == 8 * MiB
    text = str(result)
    assert "8.0 MiB free in private pool (1, 0)" in text
    assert "only deleting its graphs" in text


def test_graph_pool_blocks_through_the_backend(nvml_for: Any) -> None:
    alloc = SnapshotAllocator(sd.cuda_graph_64mib(), owners=GRAPH)
    nvml_for(alloc)
    blocks = graph_pool_blocks(0)
    hit = blocks.pool_of(sd.GRAPH_OUTPUT)
    assert hit is not None and hit.pool_id == (1, 0)
    assert alloc.owner_searches == 1
    assert graph_pool_blocks("cuda:0", owners=False).pools[0].graphs is None
    with pytest.raises(TypeError, match="owners"):
        graph_pool_blocks(0, owners="yes")  # type: ignore[arg-type]


def test_graph_pool_blocks_without_context_reads_nothing() -> None:
    with _backend.use(FakeAllocator(devices=1, contexts=())):
        assert graph_pool_blocks(0).blocks == ()


def test_public_arguments_are_checked() -> None:
    with _backend.use(FakeAllocator(devices=1, contexts=(0,))):
        with pytest.raises(TypeError, match="top"):
            cudamem.release(top="5")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="top"):
            cudamem.release(top=-1)
        with pytest.raises(TypeError, match="clear_cublas"):
            cudamem.release(clear_cublas=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="device"):
            cudamem.explain(1.5)  # type: ignore[arg-type]
    with _backend.use(FakeAllocator(devices=0, contexts=())), pytest.raises(TypeError):
        cudamem.explain([0])  # type: ignore[arg-type]


# -- finding who uses a pool -------------------------------------------------------------


class _GraphBase:
    def __init__(self, pool: tuple[int, int] | None) -> None:
        self._pool = pool

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._pool


class _Graph(_GraphBase):
    pass


class _HostileGraph(_Graph):
    def pool(self) -> tuple[int, int]:  # user code: must never run
        raise AssertionError("a subclass's pool() was called")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("__eq__ was called")

    __hash__ = None  # type: ignore[assignment]


class _PoolBase:
    def __init__(self, pid: tuple[int, int]) -> None:
        self._id = pid

    @property
    def id(self) -> tuple[int, int]:
        return self._id


class _MemPool(_PoolBase):
    pass


class _TreeManager:
    def __init__(self, pool: tuple[int, int]) -> None:
        self.cuda_graphs_thread_pool = pool
        self.device_index = 0

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"__getattr__({name!r}) was called")


def test_pool_owners_are_found_without_user_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_CUDAGraph", _GraphBase, raising=False)
    monkeypatch.setattr(torch._C, "_MemPool", _PoolBase, raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "MemPool", _MemPool, raising=False)
    trees = types.ModuleType("torch._inductor.cudagraph_trees")
    trees.CUDAGraphTreeManager = _TreeManager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    keep = [
        _Graph((1, 0)),
        _Graph((0, 7)),
        _HostileGraph((0, 7)),  # the base class's pool() is asked, not the override
        _Graph(None),  # not captured yet: no pool
        _MemPool((0, 9)),
        _TreeManager((0, 7)),
    ]
    owners = _torch_backend._find_pool_owners()
    assert owners.graphs == {(1, 0): 1, (0, 7): 2}
    assert owners.mempools == frozenset({(0, 9)})
    assert owners.trees == {(0, 7): 0}
    assert owners.trees_loaded
    # it keeps nothing alive
    ref = weakref.ref(keep[0])
    del keep
    gc.collect()
    assert ref() is None


def test_instances_of_finds_subclasses_and_slots() -> None:
    class Base:
        pass

    class Sub(Base):
        __slots__ = ("x",)

    objs = [Base(), Sub(), Base()]
    found = instances_of([Base])
    assert len(found) == 3 and all(any(f is o for o in objs) for f in found)


def test_pool_owners_on_this_machine_do_not_raise() -> None:
    # CPU torch: nothing initialised, so nothing is searched.
    assert _backend.get().private_pool_owners() is None or not torch.cuda.is_available()


# -- recorded files -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(sd.SCENARIOS))
def test_recorded_files_match_the_builders(name: str) -> None:
    snap = load_snapshot(DATA / f"{name}.pickle")
    assert snap == sd.as_dump(sd.SCENARIOS[name]())
    split = split_cache(segments_of(snap, 0))
    parts = (
        split.pools_free
        + split.pending_free
        + split.stranded
        + split.releasable
        + split.non_releasable
    )
    assert parts == split.cached


def test_hostile_segments_never_raise() -> None:
    garbage: list[Any] = [
        1,
        "x",
        {"blocks": "no"},
        {"total_size": "big", "blocks": [{"size": -5, "state": 7}, "block", None]},
        {"is_expandable": True, "segment_type": "large", "blocks": [{"size": 2**70}]},
        {"segment_pool_id": ("a", None), "blocks": [{"size": 10, "state": "active_allocated"}]},
        {"segment_pool_id": [3, 4, 5], "stream": True, "blocks": []},
    ]
    split = split_cache(garbage, pool_owners=PoolOwners())
    assert split.cached == split.reserved - split.live
    assert pool_blocks_of(0, garbage).blocks == ()
    # the one well-formed allocated block of requested size 10, on stream 0 (True is no int)
    assert workspace_streams(garbage, (10,), ()) == {0: 1}
    assert workspace_streams(garbage, (10,), (sd.BASE,)) == {0: 1}


def test_cache_split_is_json_ready() -> None:
    split = split_cache(sd.cuda_graph_64mib(), pool_owners=GRAPH)
    data = json.loads(to_json(split))
    assert data["pools"][0]["pool_id"] == [1, 0]
    assert data["pools_free"] == 8 * MiB
    assert pickle.loads(pickle.dumps(split)) == split


# -- snapshots recorded on the H200 (torch 2.11.0+cu130, driver 580) --------------------
#
# Each file (copied from the lead's probe) holds real torch.cuda.memory._snapshot() dicts and
# the allocator's counters read beside them: {"stats"/"before_stats"/...: {allocated,
# reserved, active, inactive_split}, "snap"/"before"/"after"/...: snapshot}.


def recorded(name: str) -> dict[str, Any]:
    from cudamem.allocator.snapshot import loads_snapshot

    data = loads_snapshot((DATA / f"h200_{name}.pkl").read_bytes())
    assert isinstance(data, dict)
    return data


def h200_counters(figures: dict[str, int], segments: list[dict[str, Any]]) -> AllocatorStats:
    stats = counters(segments, inactive_split=figures["inactive_split"])
    assert (stats.reserved, stats.allocated, stats.active) == (
        figures["reserved"],
        figures["allocated"],
        figures["active"],
    ), "the recorded snapshot and counters disagree"
    return stats


def test_h200_expandable_split_predicts_empty_cache() -> None:
    rec = recorded("expandable")
    before, after = rec["before"]["segments"], rec["after"]["segments"]
    h200_counters(rec["before_stats"], before)
    split = split_cache(before)
    freed = rec["before_stats"]["reserved"] - rec["after_stats"]["reserved"]
    assert freed == 260 * MiB  # what empty_cache() really returned on the H200
    assert split.releasable == split.empty_cache_returns == freed
    assert split.partial_pages == 28 * MiB
    kept = split_cache(after)
    assert kept.releasable == 0 and kept.partial_pages == 28 * MiB
    # and the builder's model of the same scenario is what the H200 did
    assert [s["total_size"] for s in after] == [
        s["total_size"] for s in sd.expandable_three_tensors_after_empty_cache()
    ]


def test_h200_default_allocator_frees_the_whole_segment() -> None:
    rec = recorded("default")
    before = rec["before"]["segments"]
    h200_counters(rec["before_stats"], before)
    split = split_cache(before)
    freed = rec["before_stats"]["reserved"] - rec["after_stats"]["reserved"]
    assert split.releasable == freed == 286 * MiB
    assert split.non_releasable == 0 and not split.expandable


def test_h200_graph_pool() -> None:
    rec = recorded("graph")
    segs = rec["snap"]["segments"]
    stats = h200_counters(rec["stats"], segs)
    owners = PoolOwners(graphs={(1, 0): 2})  # two graphs share the pool (pool=g.pool())
    cache = split_cache(segs, pool_owners=owners)
    (pool,) = cache.pools
    # A@A's output, the capture's own cuBLAS workspace, A+1's output
    assert pool.pool_id == (1, 0) and pool.reserved == 160 * MiB == pool.allocated
    ledger = build_ledger(
        0,
        stats=stats,
        nvml=nvml_reading(stats.reserved),
        pid=PID,
        cache=cache,
        allocated=AllocatedSplit(64 * MiB, 0, 32 * MiB, stats.allocated - 256 * MiB),
    )
    line = ledger.line("graph_pools:cuda_graph")
    assert line is not None and line.nbytes == 160 * MiB and "1 pool, 2 graphs" in line.label
    adds_up(ledger)
    # outputs deleted, graphs alive: the pool keeps every byte, empty_cache() returns none
    outputs_gone = rec["after_del_outputs"]["segments"]
    h200_counters(rec["after_del_stats"], outputs_gone)
    kept = split_cache(outputs_gone, pool_owners=owners)
    assert kept.pools_free == 128 * MiB and kept.empty_cache_returns == 0
    # graphs deleted too: the pool's free segments go back; the capture's cuBLAS workspace
    # stays allocated in the pool (cuBLAS keeps it per handle and stream) until cleared
    freed_pool = split_cache(outputs_gone, pool_owners=PoolOwners())
    assert freed_pool.releasable == 128 * MiB
    remaining = rec["after_del_graph"]["segments"]
    h200_counters(rec["after_del_graph_stats"], remaining)
    (left,) = split_cache(remaining, pool_owners=PoolOwners()).pools
    assert left.pool_id == (1, 0) and left.allocated == 32 * MiB
    assert workspace_streams(remaining, (32 * MiB,), ()) != {}


def test_h200_cudagraph_tree_pool() -> None:
    rec = recorded("compile")
    segs = rec["snap"]["segments"]
    stats = h200_counters(rec["stats"], segs)
    owners = PoolOwners(graphs={(0, 1): 2}, trees={(0, 1): 0}, trees_loaded=True)
    cache = split_cache(segs, pool_owners=owners)
    (pool,) = cache.pools
    assert pool.pool_id == (0, 1) and pool.kind == "cudagraph_tree"
    ledger = build_ledger(
        0,
        stats=stats,
        nvml=nvml_reading(stats.reserved),
        pid=PID,
        cache=cache,
        allocated=AllocatedSplit(0, 0, 0, stats.allocated - cache.pools_allocated),
    )
    line = ledger.line("graph_pools:cudagraph_tree")
    assert line is not None and line.nbytes == pool.reserved == 54 * MiB
    adds_up(ledger)
    # Without the tree manager, the same id reads as a shared graph_pool_handle() pool.
    assert split_cache(segs).pools[0].kind == "shared_graph"


def test_h200_record_stream_pending() -> None:
    rec = recorded("record_stream")
    for snap, figures in (("snap", "stats"), ("after_sync", "after_sync_stats")):
        segs = rec[snap]["segments"]
        stats = h200_counters(rec[figures], segs)
        split = split_cache(segs)
        # the counters' active − allocated is the snapshot's active_pending_free block, still
        # pending after synchronize() (events are processed at the next malloc/empty_cache)
        assert split.pending_free == stats.active - stats.allocated == 64 * MiB
        assert split.pending_releasable == 64 * MiB
        ledger = build_ledger(
            0,
            stats=stats,
            nvml=nvml_reading(stats.reserved),
            pid=PID,
            cache=split,
            allocated=AllocatedSplit(0, 0, 0, stats.allocated),
        )
        assert sizes(ledger)["cache_pending_free"] == 64 * MiB
        adds_up(ledger)


def test_remaining_storage_in_a_held_pool_is_named_so() -> None:
    from cudamem.allocator.cache_split import PoolBlock, PoolBlocks, PrivatePool
    from cudamem.ledger.reclaim import largest_storages

    big = torch.ones(3 * 1024 * 1024, dtype=torch.uint8)  # the largest CPU storage here
    ptr = big.untyped_storage().data_ptr()
    pool = PrivatePool((1, 0), "cuda_graph", 1, True, 1, 4 * MiB, 3 * MiB)
    blocks = PoolBlocks(0, (PoolBlock(ptr, 3 * MiB, (1, 0), "cuda_graph"),), (pool,))
    (top,) = largest_storages("cpu", 1, holders=False, pools=blocks)
    assert top.nbytes == 3 * MiB and top.pool == f"private pool (1, 0) of {pool.description}"
    assert top.describe() == (
        f"uint8[3145728] (in private pool (1, 0) of {pool.description}: freed only with the "
        "graphs that use it)"
    )
    assert "in private pool (1, 0) of a torch.cuda.graph" in top.describe()
    # a pool no graph uses any more is not worth the remark
    gone = PoolBlocks(0, blocks.blocks, (dataclasses.replace(pool, held=False, graphs=0),))
    (plain,) = largest_storages("cpu", 1, holders=False, pools=gone)
    assert plain.pool is None and plain.describe() == "uint8[3145728]"
    del big
