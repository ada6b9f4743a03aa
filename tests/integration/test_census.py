"""CPU tests of the live-tensor census and of unaccounted() through a fake allocator."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.snapshot import Block, Frame, allocated_blocks
from cudamem.holders import census
from cudamem.holders._storages import ref_of
from cudamem.holders.census import Census, LiveStorage
from cudamem.holders.unaccounted import classify_blocks
from cudamem.render.json import to_json
from tests.fakes import FakeAllocator

M = __name__
MiB = 1024**2


def _mine(c: Census, *tensors: torch.Tensor) -> list[LiveStorage]:
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    return [s for s in c if s.data_ptr in ptrs]


def test_every_storage_once_largest_first_with_nbytes() -> None:
    big = torch.ones(300, 300)
    view = big[10:20]  # shares big's storage: counted once
    small = torch.ones(5, dtype=torch.float64)
    c = cudamem.live_tensors("cpu")
    mine = _mine(c, big, small)
    assert [s.nbytes for s in mine] == [300 * 300 * 4, 5 * 8]
    assert mine[0].shape == (300, 300) and mine[0].dtype == "float32" and mine[0].tensors == 2
    assert mine[0].device == "cpu" and mine[0].python and not mine[0].saved_by_autograd
    sizes = [s.nbytes for s in c]
    assert sizes == sorted(sizes, reverse=True)
    assert mine[0].holders is None
    del view


def test_nbytes_is_storage_size_not_numel() -> None:
    base = torch.ones(1000)
    sliced = base[:10].clone()
    strided = torch.ones(100, 100).t()
    c = cudamem.live_tensors("cpu")
    assert {s.nbytes for s in _mine(c, base, sliced, strided)} == {4000, 40, 40000}


def test_nbytes_is_the_storage_where_numel_times_itemsize_differs() -> None:
    """A view of a larger storage, an expanded tensor and the 0-d loss ``F.mse_loss`` leaves
    in a 2 MiB storage: the census counts the storage each sits in, never numel × itemsize
    (4 B, 400 B and 40 B here)."""
    base = torch.ones(1000)
    view = base[:10]  # no clone: 40 B of a 4,000 B storage
    del base
    row = torch.ones(1, 100)
    expanded = row.expand(1000, 100)  # 100,000 elements over a 400 B storage
    del row
    a, b = torch.randn(512, 1024), torch.randn(512, 1024)
    loss = torch.nn.functional.mse_loss(a, b)
    del a, b
    assert loss.dim() == 0 and loss.untyped_storage().nbytes() == 2 * 1024**2
    c = cudamem.live_tensors("cpu")
    got = {s.data_ptr: s.nbytes for s in _mine(c, view, expanded, loss)}
    assert got == {
        view.untyped_storage().data_ptr(): 4000,
        expanded.untyped_storage().data_ptr(): 400,
        loss.untyped_storage().data_ptr(): 2 * 1024**2,
    }


def test_storages_only_autograd_holds() -> None:
    global losses
    x = torch.randn(32, 32, requires_grad=True)
    losses = [torch.sigmoid(x * 2).mean() for _ in range(3)]
    try:
        saved = [s for s in cudamem.live_tensors("cpu", holders=True) if s.saved_by_autograd]
        results = [s for s in saved if s.shape == (32, 32) and s.tensors == 0]
        assert len(results) == 3  # sigmoid outputs: no Python object, saved by each graph
        paths = sorted(s.holders.paths[0] for s in results if s.holders is not None)
        assert paths == [
            f"{M}.losses[{i}] → grad_fn MeanBackward0 → SigmoidBackward0 saved result"
            for i in range(3)
        ]
    finally:
        globals().pop("losses", None)


def test_holders_for_many_storages_in_one_search() -> None:
    global pool
    pool = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(50)}
    try:
        c = cudamem.live_tensors("cpu", holders=True)
        mine = _mine(c, *pool.values())
        assert len(mine) == 50
        for s in mine:
            assert s.holders is not None
            i = s.nbytes // 4 - 1
            assert f"{M}.pool['t{i}']" in s.holders.paths
    finally:
        globals().pop("pool", None)


def test_census_render_and_json() -> None:
    keep = torch.ones(256, 256)
    c = cudamem.live_tensors("cpu")
    text = str(c)
    assert text.splitlines()[0].split() == [
        "bytes",
        "device",
        "dtype",
        "shape",
        "tensors",
        "autograd",
        "held",
        "by",
    ]
    # Column widths depend on whatever else is alive: compare the cells, not the spacing.
    assert any(
        line.split()[:5] == ["256.0", "KiB", "cpu", "float32", "256×256"]
        for line in text.splitlines()
    )
    data = json.loads(to_json(c))
    assert data["total"] == c.total and data["by_device"]["cpu"] == c.total
    assert str(_mine(c, keep)[0]) == "256.0 KiB float32[256×256] on cpu"


def test_live_storage_keys_and_adapter_contract() -> None:
    t = torch.ones(7)
    keys = census.live_storage_keys("cpu")
    assert keys[("cpu", t.untyped_storage().data_ptr())] == 28
    entry = _mine(cudamem.live_tensors("cpu"), t)[0]
    assert (entry.device, entry.data_ptr) == ("cpu", t.untyped_storage().data_ptr())
    assert entry.ref == ref_of(t) and not entry.truncated


def test_device_argument() -> None:
    with pytest.raises(ValueError):
        cudamem.live_tensors("cuda:99")


# --------------------------------------------------------------------------- unaccounted


def _segments(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"device": 0, "blocks": list(blocks)}]


def test_active_blocks_from_snapshot_segments() -> None:
    segs = _segments(
        {"address": 100, "size": 512, "requested_size": 500, "state": "active_allocated"},
        {"address": 612, "size": 512, "state": "inactive"},
        {
            "address": 2000,
            "size": 32 * MiB,
            "requested_size": 32 * MiB,
            "state": "active_allocated",
            "frames": [{"name": "at::cuda::getCurrentCUDABlasHandle()", "filename": "x"}],
        },
    )
    blocks = allocated_blocks(segs)
    assert blocks == [
        Block(100, 512, 500),
        Block(2000, 32 * MiB, 32 * MiB, (Frame("at::cuda::getCurrentCUDABlasHandle()", "x", 0),)),
    ]


def _acc(ptr: int, nbytes: int, tensors: int) -> tuple[tuple[str, int, int], census.Acc]:
    return ("cuda", 0, ptr), census.Acc(nbytes, "float32", (1,), 1, tensors, tensors == 0, None)


def test_classify_blocks() -> None:
    ws = 32 * MiB
    blocks = [
        Block(0, 4 * MiB, 4 * MiB),  # a Python tensor
        Block(10 * MiB, 2 * MiB, 2 * MiB),  # saved by a graph only
        Block(20 * MiB, ws, ws),  # workspace, by size
        Block(60 * MiB, ws, ws, (Frame("setWorkspaceForHandle", "", 0),)),  # by its stack
        Block(100 * MiB, 512, 400),  # nobody
    ]
    acc = dict([_acc(0, 4 * MiB, 1), _acc(10 * MiB + 512, 1000, 0)])
    allocated = sum(b.size for b in blocks)
    u = classify_blocks(0, allocated, blocks, acc, (ws, MiB), [])
    assert (u.python, u.autograd, u.cublas_workspaces, u.workspace_count, u.unknown) == (
        4 * MiB,
        2 * MiB,
        2 * ws,
        2,
        512,
    )
    assert u.method == "snapshot"
    assert any("recognised by size" in n for n in u.notes)
    text = str(u)
    line = next(ln for ln in text.splitlines() if ln.startswith("cuBLAS workspaces (2)"))
    assert line.split()[-2:] == ["64.0", "MiB"]
    assert json.loads(to_json(u))["cublas_workspaces"] == 2 * ws


class _FakeWithSnapshot(FakeAllocator):
    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        return _segments(
            {
                "address": 4096,
                "size": 32 * MiB,
                "requested_size": 32 * MiB,
                "state": "active_allocated",
            }
        )

    def cublas_workspace_sizes(self, device: int) -> tuple[int, ...]:
        return (32 * MiB, MiB)


def test_unaccounted_through_backend() -> None:
    fake = _FakeWithSnapshot()
    fake.alloc(32 * MiB)
    with _backend.use(fake):
        u = cudamem.unaccounted(0)
    assert u.allocated == 32 * MiB and u.cublas_workspaces == 32 * MiB and u.unknown == 0


def test_unaccounted_without_snapshot_counts_the_rest_unknown() -> None:
    fake = FakeAllocator()
    fake.alloc(3 * MiB)
    with _backend.use(fake):
        u = cudamem.unaccounted("cuda:0")
    assert (u.method, u.python, u.unknown, u.cublas_workspaces) == ("counters", 0, 3 * MiB, 0)


# -- tensors only an autograd graph keeps (their Python objects preserved by PyTorch) --------

_graph_model = torch.nn.Linear(64, 64)
_graph_kept: list[torch.Tensor] = []


def _input_rows(inputs: list[int]) -> list[tuple[int, bool]]:
    rows = cudamem.live_tensors("cpu")
    return [(s.tensors, s.saved_by_autograd) for s in rows if s.data_ptr in inputs]


def test_inputs_only_a_graph_keeps_count_as_saved_not_python() -> None:
    losses, ptrs = [], []
    for _ in range(3):
        x = torch.randn(128, 64)
        ptrs.append(x.untyped_storage().data_ptr())
        losses.append(_graph_model(x).sum())
    del x
    # The inputs' Python objects still exist (PyTorch preserves them for the graph), but
    # nothing in Python refers to them: the graph holds that memory.
    assert _input_rows(ptrs) == [(0, True)] * 3
    census = cudamem.live_tensors("cpu", holders=True)
    mine = [s for s in census if s.data_ptr in ptrs]
    assert all(s.holders is not None and "grad_fn" in s.holders.paths[0] for s in mine)
    del losses


def test_inputs_still_referenced_from_python_count_as_python() -> None:
    losses, ptrs = [], []
    for _ in range(2):
        x = torch.randn(128, 64)
        ptrs.append(x.untyped_storage().data_ptr())
        _graph_kept.append(x)  # a module-level list keeps the first two
        losses.append(_graph_model(x).sum())
    local_x = torch.randn(128, 64)  # a running frame's local keeps the third
    ptrs.append(local_x.untyped_storage().data_ptr())
    losses.append(_graph_model(local_x).sum())
    del x
    assert _input_rows(ptrs) == [(1, True)] * 3
    _graph_kept.clear()
    del losses, local_x


def test_no_cyclic_collection_runs_during_a_census_and_gc_is_left_as_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The census's own bookkeeping (a listing of the whole heap) is never traversed by a
    collection it triggers: gc is off while it gathers and as it was afterwards."""
    import gc

    from cudamem.holders import census

    seen: list[bool] = []
    gather_from = census._gather_from

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return gather_from(*args, **kwargs)

    monkeypatch.setattr(census, "_gather_from", spy)
    keep = torch.ones(1024)
    assert gc.isenabled()
    found = cudamem.live_tensors(holders=True)
    assert gc.isenabled() and seen == [False]
    assert any(s.nbytes == keep.untyped_storage().nbytes() for s in found)
    gc.disable()
    try:
        census.live_refs()
        assert not gc.isenabled() and seen == [False, False]
    finally:
        gc.enable()
