"""Allocator snapshots as ``torch.cuda.memory_snapshot()`` returns them on torch 2.11.

Each scenario is written out block by block from the allocator's rules
(``c10/cuda/CUDACachingAllocator.cpp``): segment and block addresses, sizes, states and pool
ids are what the allocator would report, so the arithmetic tests run on realistic input.
``tests/data/*.pickle`` hold the same dicts as ``_dump_snapshot()`` files (see
``test_recorded_files_match_the_builders``).
"""

from __future__ import annotations

from typing import Any

MiB = 1024**2
BASE = 0x7F2A00000000  # where the allocator's first segment of a device usually lands
SIDE = 0x5581C0DE0000  # a side stream's cudaStream_t
CAPTURE = 0x5581C0FF0000  # the stream a graph was captured on


def block(address: int, size: int, state: str, requested: int | None = None) -> dict[str, Any]:
    return {
        "address": address,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": [],
    }


def segment(
    address: int,
    blocks: list[tuple[int, str]],
    *,
    stream: int = 0,
    device: int = 0,
    expandable: bool = False,
    small: bool = False,
    pool: tuple[int, int] = (0, 0),
    requested: dict[int, int] | None = None,
) -> dict[str, Any]:
    """A segment at ``address`` tiled by ``blocks`` ``(size, state)`` in address order;
    ``requested`` maps a block index to its requested size."""
    out: list[dict[str, Any]] = []
    addr = address
    for i, (size, state) in enumerate(blocks):
        out.append(block(addr, size, state, (requested or {}).get(i)))
        addr += size
    total = sum(size for size, _ in blocks)
    allocated = sum(b["size"] for b in out if b["state"] == "active_allocated")
    active = sum(b["size"] for b in out if b["state"] != "inactive")
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in out if b["state"] != "inactive"),
        "stream": stream,
        "segment_type": "small" if small else "large",
        "segment_pool_id": pool,
        "is_expandable": expandable,
        "frames": [],
        "blocks": out,
    }


A, F, P = "active_allocated", "inactive", "active_pending_free"


def expandable_three_tensors() -> list[dict[str, Any]]:
    """``expandable_segments:True``; three 286 MiB tensors, then ``del`` of the middle one.

    The large pool maps 20 MiB pages: 286 MiB → 300 MiB mapped, the second needs 272 MiB more
    (14 pages, 580 MiB), the third 278 MiB more (860 MiB). The middle tensor's
    [286, 572) MiB holds 13 whole pages [300, 560): what empty_cache() unmaps (860 → 600).
    """
    return [
        segment(
            BASE,
            [(286 * MiB, A), (286 * MiB, F), (286 * MiB, A), (2 * MiB, F)],
            expandable=True,
        )
    ]


def expandable_three_tensors_after_empty_cache() -> list[dict[str, Any]]:
    """The same after ``empty_cache()``: one segment per mapped range, 28 MiB still mapped."""
    return [
        segment(BASE, [(286 * MiB, A), (14 * MiB, F)], expandable=True),
        segment(BASE + 560 * MiB, [(12 * MiB, F), (286 * MiB, A), (2 * MiB, F)], expandable=True),
    ]


def expandable_small_pool() -> list[dict[str, Any]]:
    """Small tensors under expandable segments (2 MiB pages): page 0 full, page 1 with a
    512 KiB hole between two live blocks (stays mapped), page 2 wholly free (unmapped)."""
    kib = 1024
    return [
        segment(
            BASE + 1024 * MiB,
            [
                (2 * MiB, A),  # page 0: full
                (512 * kib, A),  # page 1 starts
                (512 * kib, F),
                (1024 * kib, A),
                (2 * MiB, F),  # page 2: wholly free, unmapped by empty_cache()
            ],
            expandable=True,
            small=True,
        )
    ]


def cuda_graph_64mib() -> list[dict[str, Any]]:
    """``torch.cuda.graph`` capture of ``y = x @ w`` with 2048×8192 fp32 operands.

    Default pool: ``x`` and ``w`` (64 MiB each) and the eager warm-up's cuBLAS workspace on
    the side stream. The graph's private pool (id ``(1, 0)``: a capture without ``pool=``)
    on the capture stream: the 64 MiB output ``y`` and the capture's own cuBLAS workspace
    (32 MiB, requested 32 MiB), plus 8 MiB free that replays reuse.
    """
    return [
        segment(BASE, [(64 * MiB, A)]),
        segment(BASE + 64 * MiB, [(64 * MiB, A)]),
        segment(BASE + 128 * MiB, [(32 * MiB, A)], stream=SIDE),
        segment(BASE + 160 * MiB, [(64 * MiB, A)], stream=CAPTURE, pool=(1, 0)),
        segment(BASE + 224 * MiB, [(32 * MiB, A), (8 * MiB, F)], stream=CAPTURE, pool=(1, 0)),
    ]


GRAPH_OUTPUT = BASE + 160 * MiB
GRAPH_INPUTS = (BASE, BASE + 64 * MiB)


def cudagraph_tree() -> list[dict[str, Any]]:
    """``torch.compile(mode="reduce-overhead")`` after three calls: the tree manager's pool
    (``torch.cuda.graph_pool_handle()``: id ``(0, 1)``) holds the recorded graph's output
    (16 MiB) and its activations' free space; the input lives in the default pool."""
    return [
        segment(BASE, [(16 * MiB, A), (4 * MiB, F)]),
        segment(BASE + 20 * MiB, [(16 * MiB, A), (24 * MiB, F)], stream=SIDE, pool=(0, 1)),
        segment(BASE + 60 * MiB, [(2 * MiB, F)], stream=SIDE, pool=(0, 1), small=True),
    ]


def record_stream_pending() -> list[dict[str, Any]]:
    """A 32 MiB tensor used on a side stream (``record_stream``) and deleted while that
    stream still works: its block waits for the event (``active_pending_free``), alone in its
    segment; a 4 MiB tensor lives on in a 20 MiB segment."""
    return [
        segment(BASE, [(4 * MiB, A), (16 * MiB, F)]),
        segment(BASE + 20 * MiB, [(32 * MiB, P)]),
    ]


def stream_per_run() -> list[dict[str, Any]]:
    """Three runs, each on a new ``torch.cuda.Stream`` with a matmul: every stream keeps its
    cuBLAS workspace (32 MiB, requested exactly 32 MiB) and the run's freed cache."""
    segs = [segment(BASE, [(4 * MiB, A), (16 * MiB, F)])]
    for k in range(3):
        stream = SIDE + 0x100 * k
        segs.append(
            segment(
                BASE + (20 + 100 * k) * MiB,
                [(32 * MiB, A), (68 * MiB, F)],
                stream=stream,
                requested={0: 32 * MiB},
            )
        )
    return segs


SCENARIOS = {
    "expandable_three_tensors": expandable_three_tensors,
    "expandable_three_tensors_after_empty_cache": expandable_three_tensors_after_empty_cache,
    "cuda_graph_64mib": cuda_graph_64mib,
    "cudagraph_tree": cudagraph_tree,
    "record_stream_pending": record_stream_pending,
}


def as_dump(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``torch.cuda.memory._dump_snapshot()`` pickles (history off: empty traces)."""
    return {
        "segments": segments,
        "device_traces": [[]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None},
    }


def totals(segments: list[dict[str, Any]]) -> tuple[int, int, int]:
    """``(reserved, allocated, active)`` as the allocator's counters would report them."""
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    active = sum(s["active_size"] for s in segments)
    return reserved, allocated, active


if __name__ == "__main__":  # regenerate tests/data/*.pickle
    import pathlib
    import pickle

    here = pathlib.Path(__file__).parent / "data"
    here.mkdir(exist_ok=True)
    for name, make in SCENARIOS.items():
        (here / f"{name}.pickle").write_bytes(pickle.dumps(as_dump(make())))
