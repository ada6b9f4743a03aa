"""Snapshots for PyTorch's memory viewer: holder frames, torch's own readers, automatic dumps.

The fake allocator hands out a synthetic snapshot whose blocks sit at the addresses of real
CPU tensors (its ``storage_device_type`` is ``cpu``), so the census names real holders.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.snapshot import CONTAINER_KEY, HOLDER_FILENAME
from cudamem.ledger.memviz import annotate_snapshot, auto_dump

from ..fakes import FakeAllocator

MiB = 1024**2

# What a training script keeps: the census names these module globals.
losses: list[torch.Tensor] = []
activations: dict[str, torch.Tensor] = {}


def segment(device: int, blocks: list[tuple[int, int, str]], stream: int = 0) -> dict[str, Any]:
    """A segment as ``torch.cuda.memory._snapshot()`` writes it, blocks back to back."""
    start = blocks[0][0]
    out = []
    for address, size, state in blocks:
        out.append(
            {
                "address": address,
                "size": size,
                "requested_size": size if state != "inactive" else 0,
                "state": state,
                "frames": [],
            }
        )
    total = sum(b[1] for b in blocks)
    live = sum(b[1] for b in blocks if b[2] != "inactive")
    return {
        "device": device,
        "address": start,
        "total_size": total,
        "stream": stream,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "allocated_size": live,
        "active_size": live,
        "requested_size": live,
        "is_expandable": False,
        "blocks": out,
    }


class SnapshotFake(FakeAllocator):
    """A fake GPU whose snapshot is built by the test, over real CPU tensors."""

    storages = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.snapshot: dict[str, Any] | None = None
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self.history: list[bool] = []

    def history_snapshot(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.snapshot)

    def cublas_workspace_sizes(self, device: int) -> tuple[int, ...]:
        return (4 * MiB,)

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        self.observers.append(observer)
        return True

    def is_recording_history(self) -> bool:
        return bool(self.history and self.history[-1])

    def set_history(
        self, enabled: bool, max_entries: int, still_wanted: Callable[[], bool] | None
    ) -> bool:
        self.history.append(enabled)
        return True


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def fake() -> Iterator[SnapshotFake]:
    losses.clear()
    activations.clear()
    cudamem.configure_leaks()
    alloc = SnapshotFake()
    with _backend.use(alloc):
        yield alloc
    cudamem.configure_leaks()
    losses.clear()
    activations.clear()


def scene(fake: SnapshotFake) -> dict[str, int]:
    """Two tensors held by globals, one block no tensor lives in, one free block."""
    losses.append(torch.ones(256, 1024))  # 1 MiB
    activations["layer1"] = torch.ones(512, 1024)  # 2 MiB
    a, b = ptr(losses[0]), ptr(activations["layer1"])
    fake.snapshot = {
        "segments": [
            segment(0, [(a, 1 * MiB, "active_allocated"), (a + MiB, 3 * MiB, "inactive")]),
            segment(0, [(b, 2 * MiB, "active_allocated")], stream=7),
            segment(0, [(1 << 40, 4 * MiB, "active_allocated")]),
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": a, "size": MiB, "stream": 0, "frames": []},
                {"action": "alloc", "addr": b, "size": 2 * MiB, "stream": 7, "frames": []},
                {"action": "free_requested", "addr": b, "size": 2 * MiB, "stream": 7},
                {"action": "free_completed", "addr": b, "size": 2 * MiB, "stream": 7},
                {"action": "alloc", "addr": b, "size": 2 * MiB, "stream": 7, "frames": []},
            ]
        ],
        "allocator_settings": {"expandable_segments": False},
    }
    return {"losses": a, "activations": b}


def first_frame(block: dict[str, Any]) -> dict[str, Any]:
    frames: list[dict[str, Any]] = block["frames"]
    return frames[0]


def test_live_blocks_are_named_by_their_holders(fake: SnapshotFake, tmp_path: Path) -> None:
    scene(fake)
    dump = cudamem.dump_snapshot(tmp_path / "snap.pickle")
    assert (dump.blocks, dump.named) == (3, 2)
    assert dump.nbytes == 7 * MiB and dump.named_bytes == 3 * MiB
    assert dump.trace_entries == 5 and dump.segments == 3
    snap = cudamem.load_snapshot(tmp_path / "snap.pickle")  # plain data only
    seg_a, seg_b, seg_w = snap["segments"]
    here = __name__
    assert first_frame(seg_a["blocks"][0]) == {
        "filename": HOLDER_FILENAME,
        "line": 0,
        "name": f"{here}.losses[0]",
        CONTAINER_KEY: f"{here}.losses",  # what cudamem.diff groups by
    }
    assert first_frame(seg_b["blocks"][0])["name"] == f"{here}.activations['layer1']"
    # A block no tensor lives in, of the cuBLAS workspace size.
    assert "cuBLAS workspace" in first_frame(seg_w["blocks"][0])["name"]
    # Free blocks are left as they were.
    assert seg_a["blocks"][1]["frames"] == []
    assert "wrote" in str(dump) and "2 named by holder" in str(dump)


def test_the_last_alloc_event_of_a_live_block_is_named_too(
    fake: SnapshotFake, tmp_path: Path
) -> None:
    scene(fake)
    cudamem.dump_snapshot(tmp_path / "snap.pickle")
    trace = cudamem.load_snapshot(tmp_path / "snap.pickle")["device_traces"][0]
    assert trace[0]["frames"][0]["name"].endswith("losses[0]")
    # The block at b was freed and allocated again: only the later alloc is today's block.
    assert trace[1]["frames"] == []
    assert trace[4]["frames"][0]["name"].endswith("activations['layer1']")
    assert "frames" not in trace[2]


def test_torch_memory_viz_reads_the_file(fake: SnapshotFake, tmp_path: Path) -> None:
    scene(fake)
    path = tmp_path / "snap.pickle"
    cudamem.dump_snapshot(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)  # what torch.cuda._memory_viz's command line does
    text = _memory_viz.segsum(snap)
    assert "total_allocated: 7.0MiB" in text
    flame = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert f"cudamem holder:0:{__name__}.losses[0] {MiB}" in flame
    assert "stream_7;active_allocated;cudamem holder:0:" in flame
    assert "cudamem holder:0:" in _memory_viz.segments(snap, format_flamegraph=lambda s: s)
    assert "Device 0" in _memory_viz.trace(snap)
    for plot in (_memory_viz.segment_plot, _memory_viz.trace_plot):
        html = plot(snap)
        assert "MemoryViz.js" in html and "snapshot.pickle" in html


def test_without_holders_the_snapshot_is_torchs_own(fake: SnapshotFake, tmp_path: Path) -> None:
    scene(fake)
    dump = cudamem.dump_snapshot(tmp_path / "plain.pickle", holders=False)
    assert dump.named == 0 and dump.blocks == 3
    snap = cudamem.load_snapshot(tmp_path / "plain.pickle")
    assert snap == fake.snapshot


def test_no_cuda_context_writes_an_empty_snapshot_the_viewer_opens(tmp_path: Path) -> None:
    dump = cudamem.dump_snapshot(tmp_path / "empty.pickle")  # the real backend, no GPU used
    assert dump.blocks == 0 and any("no CUDA context" in n for n in dump.notes)
    snap = cudamem.load_snapshot(tmp_path / "empty.pickle")
    # memory_viz indexes device_traces by device: at least one list is there.
    assert snap["segments"] == [] and snap["device_traces"] == [[]]
    assert "total_reserved: 0.0B" in _memory_viz.segsum(snap)


def test_device_traces_cover_every_device_shown(fake: SnapshotFake, tmp_path: Path) -> None:
    t = torch.ones(4)
    fake.snapshot = {
        "segments": [segment(2, [(ptr(t), 512, "active_allocated")])],
        "device_traces": [],
    }
    cudamem.dump_snapshot(tmp_path / "d2.pickle")
    assert len(cudamem.load_snapshot(tmp_path / "d2.pickle")["device_traces"]) == 3


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="path"):
        cudamem.dump_snapshot(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="holders"):
        cudamem.dump_snapshot(tmp_path / "x.pickle", holders="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_dumps"):
        auto_dump(tmp_path, max_dumps=0)
    with pytest.raises(TypeError, match="directory"):
        auto_dump(None)  # type: ignore[arg-type]


def test_annotate_handles_odd_snapshots() -> None:
    t = torch.ones(8)
    odd: dict[str, Any] = {
        "segments": [
            "not a segment",
            {"device": 0, "address": ptr(t), "blocks": [None, {"size": "big"}]},
            {"device": 0, "address": ptr(t), "blocks": [{"size": 32, "state": "active_allocated"}]},
        ],
        "device_traces": "nope",
    }
    assert annotate_snapshot(odd, [])[0] == 1  # the one readable live block


def test_auto_dump_on_oom(fake: SnapshotFake, tmp_path: Path) -> None:
    holds = scene(fake)
    with auto_dump(tmp_path / "dumps", max_dumps=2) as guard:
        assert len(fake.observers) == 1
        for _ in range(3):  # a retry loop that keeps failing
            fake.observers[0](0, 20 * 1024**3, 80 * 1024**3, 0)
        assert len(guard.files) == 2
    files = sorted((tmp_path / "dumps").glob("cudamem-oom-*.pickle"))
    assert [str(f) for f in files] == sorted(guard.files)
    snap = cudamem.load_snapshot(files[0])
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"]}
    assert first_frame(blocks[holds["losses"]])["name"].endswith("losses[0]")
    # After uninstall the observer stays attached (it cannot be detached) but does nothing.
    fake.observers[0](0, 1, 1, 0)
    assert len(list((tmp_path / "dumps").iterdir())) == 2


def test_auto_dump_on_a_leak_warning(fake: SnapshotFake, tmp_path: Path) -> None:
    scene(fake)
    guard = auto_dump(tmp_path, oom=False)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(6):
                with cudamem.track("step", sync=False):
                    losses.append(torch.ones(64, 1024))  # 256 KiB kept per step
                    fake.alloc(256 * 1024)  # the level the detector watches
    finally:
        guard.uninstall()
    assert any(isinstance(w.message, cudamem.LeakWarning) for w in record)
    assert len(guard.files) == 1 and "cudamem-leak-" in guard.files[0]
    assert fake.observers == []  # oom=False: no observer attached


def test_auto_dump_record_history_turns_it_off_again(fake: SnapshotFake, tmp_path: Path) -> None:
    guard = auto_dump(tmp_path, record_history=True)
    assert fake.history == [True]
    guard.uninstall()
    assert fake.history == [True, False]
    guard.uninstall()  # twice is harmless
    assert fake.history == [True, False]
    assert "uninstalled" in repr(guard)


def test_a_second_auto_dump_replaces_the_first(fake: SnapshotFake, tmp_path: Path) -> None:
    first = auto_dump(tmp_path / "a")
    second = auto_dump(tmp_path / "b")
    assert not first.installed and second.installed
    scene(fake)
    fake.observers[0](0, 1, 1, 0)
    assert first.files == () and len(second.files) == 1
    second.uninstall()


@pytest.mark.cuda
def test_cuda_dump_names_a_real_block(tmp_path: Path) -> None:
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        losses.append(torch.ones(1024, 1024, device="cuda"))
        dump = cudamem.dump_snapshot(tmp_path / "gpu.pickle")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert dump.named >= 1 and dump.trace_entries >= 1
    snap = cudamem.load_snapshot(tmp_path / "gpu.pickle")
    names = [
        b["frames"][0]["name"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["frames"]
    ]
    assert any(n.endswith("losses[0]") for n in names)
    assert "cudamem holder" in _memory_viz.memory(snap, format_flamegraph=lambda s: s)
    assert "total_allocated" in _memory_viz.segsum(snap)
    assert "Device 0 ---" in _memory_viz.trace(snap)
    for plot in (_memory_viz.segment_plot, _memory_viz.trace_plot):
        assert "snapshot.pickle" in plot(snap)
    losses.clear()
