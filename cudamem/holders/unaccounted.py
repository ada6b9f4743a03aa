"""What the allocator holds beyond the live storages: ``unaccounted(device)`` sets its
``allocated`` bytes against the census (``census.gather``). With the allocator's snapshot it
works per block: every active block is attributed to the storages that live inside it (so
allocator rounding is attributed too), and blocks no storage lives in are cuBLAS workspaces
when they match PyTorch's workspace size rule, else unknown.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..allocator import backend as _backend
from ..allocator.device_arg import DeviceLike, resolve_device
from ..allocator.snapshot import Block, allocated_blocks
from ..base.format import plural
from ..base.present import Presented
from ._autograd import StorageKey
from .census import Acc, gather

__all__ = ["Unaccounted", "classify_blocks", "is_workspace", "ledger_view", "unaccounted"]


@dataclass(frozen=True, slots=True)
class Unaccounted(Presented):
    """A device's allocated bytes, split by what holds them. Bytes are ints."""

    device: int
    #: The allocator's ``allocated_bytes`` now.
    allocated: int
    #: Bytes of storages a Python tensor object refers to.
    python: int
    #: Bytes of storages only autograd graphs hold (saved tensors with no Python object).
    autograd: int
    #: Bytes of cuBLAS/cuBLASLt workspaces (one per handle and stream).
    cublas_workspaces: int
    workspace_count: int
    #: The rest: no live storage found in it (saved tensors with no Python object at all,
    #: C++ extensions, blocks freed on another stream but not yet reusable).
    unknown: int
    #: ``snapshot`` (per allocator block) or ``counters`` (storage bytes against the total).
    method: str
    notes: tuple[str, ...] = ()


def unaccounted(device: DeviceLike = "cuda") -> Unaccounted:
    """The allocator's allocated bytes on ``device``, split by what holds them.

    Storages a Python tensor refers to, storages only autograd graphs hold, cuBLAS workspaces,
    and the rest as unknown. Reads only a device that already has a CUDA context.
    """
    return ledger_view(device)[0]


def ledger_view(
    device: DeviceLike = "cuda",
    *,
    segments: Sequence[Any] | None = None,
    allocated: int | None = None,
) -> tuple[Unaccounted, frozenset[int]]:
    """``unaccounted`` and the ``data_ptr`` of every live storage on ``device``, from one
    heap scan (``explain()`` needs both).

    ``segments`` are snapshot segments to attribute instead of reading them now (the ledger
    reads one snapshot for everything and leaves out the private pools it reports apart);
    ``allocated`` is the figure they add up to (default: the allocator's counter).
    """
    index = resolve_device(device)
    backend = _backend.get()
    notes: list[str] = []
    stats = backend.read(index)
    if allocated is not None:
        stats = stats._replace(allocated=allocated)
    acc, gather_notes = gather(f"cuda:{index}")
    for a in acc.values():
        a.first = None
    notes.extend(gather_notes)
    addresses = frozenset(k[2] for k in acc)
    if segments is None:
        segments = backend.memory_segments(index)
    blocks = None if segments is None else allocated_blocks(segments)
    sizes = backend.cublas_workspace_sizes(index)
    if blocks is None:
        python = sum(a.nbytes for a in acc.values() if a.tensors > 0)
        autograd = sum(a.nbytes for a in acc.values() if a.tensors == 0)
        notes.append("no allocator snapshot: cuBLAS workspaces are counted as unknown")
        split = Unaccounted(
            index,
            stats.allocated,
            python,
            autograd,
            0,
            0,
            max(0, stats.allocated - python - autograd),
            "counters",
            tuple(notes),
        )
        return split, addresses
    return classify_blocks(index, stats.allocated, blocks, acc, sizes, notes), addresses


def classify_blocks(
    index: int,
    allocated: int,
    blocks: Sequence[Block],
    acc: dict[StorageKey, Acc],
    workspace_sizes: tuple[int, ...],
    notes: list[str],
) -> Unaccounted:
    """Attribute each active block to the storages inside it, or to a cuBLAS workspace.

    cuBLAS workspaces are allocated by ``CublasHandlePool.cpp`` through the caching allocator
    (``getChosenWorkspaceSize()`` bytes per (handle, stream), and ``getCUDABlasLtWorkspace``
    for cuBLASLt) and no tensor ever refers to them, so no live storage points into their
    block. PyTorch exposes neither their addresses nor their size to Python, so a block is a
    workspace when (1) the allocator recorded its allocation stack (memory history on) and a
    frame names the workspace functions, or (2) no storage lives in it and its requested size
    is exactly the workspace size PyTorch chooses for this GPU (see
    ``cudamem.allocator.torch_backend.TorchBackend.cublas_workspace_sizes``).
    """
    ordered = sorted(blocks, key=lambda b: b.address)
    starts = [b.address for b in ordered]
    python_blocks: set[int] = set()
    saved_blocks: set[int] = set()
    for key, a in acc.items():
        ptr = key[2]
        pos = bisect.bisect_right(starts, ptr) - 1
        if pos < 0:
            continue
        block = ordered[pos]
        if ptr >= block.address + block.size:
            continue
        (python_blocks if a.tensors > 0 else saved_blocks).add(block.address)
    python = autograd = workspaces = count = unknown = 0
    by_size = 0
    for b in ordered:
        if b.address in python_blocks:
            python += b.size
        elif b.address in saved_blocks:
            autograd += b.size
        elif is_workspace(b, workspace_sizes):
            workspaces += b.size
            count += 1
            if not b.frames:
                by_size += 1
        else:
            unknown += b.size
    covered = python + autograd + workspaces + unknown
    if covered != allocated:
        notes.append(
            f"allocator blocks add up to {covered} B, allocated is {allocated} B "
            "(allocations between the two reads, or blocks pending free)"
        )
        unknown = max(0, unknown + allocated - covered)
    if by_size:
        notes.append(
            f"{plural(by_size, 'workspace')} recognised by size "
            f"({', '.join(map(str, workspace_sizes))} B)"
            "; torch.cuda.memory._record_memory_history() makes this certain"
        )
    return Unaccounted(
        index, allocated, python, autograd, workspaces, count, unknown, "snapshot", tuple(notes)
    )


WORKSPACE_FRAMES = (
    "CublasHandlePool",
    "getCurrentCUDABlasHandle",
    "getCUDABlasLtWorkspace",
    "setWorkspaceForHandle",
    "getNewWorkspace",
    "allocateCUDABlasWorkspace",
)


def is_workspace(block: Block, sizes: tuple[int, ...]) -> bool:
    if block.frames:
        return any(w in f.name for f in block.frames for w in WORKSPACE_FRAMES)
    return block.requested in sizes
