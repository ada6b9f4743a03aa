"""Splitting the allocator's cache exactly as ``torch.cuda.empty_cache()`` would treat it.

``split_cache`` reads segments (from a loaded file or ``torch.cuda.memory_snapshot()``). The
rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (``release_cached_blocks``):

* ``empty_cache()`` first waits for the stream events of blocks freed after ``record_stream``
  (state ``active_pending_free``), then frees them;
* an ordinary segment goes back to CUDA only when no block in it is allocated (``cudaFree`` of
  the whole segment);
* an *expandable* segment (``expandable_segments:True``) is unmapped page by page: every page
  that lies entirely inside a free block goes back, the rest of the free block stays mapped.
  Pages are 20 MiB in the large pool and 2 MiB in the small one (``kLargeBuffer`` and
  ``kSmallBuffer``, the ``segment_size`` of ``ExpandableSegment``). The snapshot reports one
  segment per contiguous mapped range, so every segment starts on a page boundary;
* the private pools of CUDA graphs (``segment_pool_id`` other than ``(0, 0)``) are left alone
  while a graph (or a ``torch.cuda.MemPool``) still uses them; once the last graph is gone,
  their free blocks are returned like any other.

What sits on streams that hold no live tensor is reported apart: the signature of "a new
``torch.cuda.Stream`` per run grows memory by one run".

``graph_pool_blocks`` maps live blocks to the private pool that holds them, for callers
that annotate storages (a graph's outputs live in its pool).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..base.args import check_bool
from . import backend as _backend
from .backend_base import PoolOwners
from .device_arg import DeviceLike, resolve_device
from .snapshot import (
    NO_POOL,
    Block,
    _int,
    _returnable,
    blocks_of,
    has_private_pools,
    page_size,
    segment_pool_id,
)

__all__ = [
    "CacheSplit",
    "PoolBlock",
    "PoolBlocks",
    "PrivatePool",
    "StreamCache",
    "graph_pool_blocks",
    "pool_blocks_of",
    "split_cache",
    "workspace_streams",
]


@dataclass(frozen=True, slots=True)
class StreamCache:
    """The allocator's segments on one CUDA stream of one device. Bytes are ints.

    ``stranded`` streams are not this thread's current stream and hold no live tensor: their
    cached blocks can only be reused by allocations on that same stream, which usually no
    longer exists (a ``torch.cuda.Stream`` made per run). ``empty_cache()`` returns them.
    Segments of private pools still in use are not counted here.
    """

    stream: int
    segments: int
    reserved: int
    live: int
    cached: int
    current: bool
    stranded: bool


#: What created a private pool, as far as cudamem can tell.
POOL_KINDS = {
    "cuda_graph": "a torch.cuda.graph / CUDAGraph capture",
    "shared_graph": (
        "a pool from torch.cuda.graph_pool_handle(): graphs captured with pool=, "
        "make_graphed_callables or torch.compile's cudagraph trees (the allocator does not "
        "say which)"
    ),
    "cudagraph_tree": 'torch.compile(mode="reduce-overhead") cudagraph trees',
    "mempool": "a torch.cuda.MemPool",
}


@dataclass(frozen=True, slots=True)
class PrivatePool:
    """One private memory pool of the allocator (a CUDA graph's, or a ``MemPool``).

    ``held`` pools keep every byte until their owner goes: ``empty_cache()`` skips them.
    ``graphs`` counts the live ``torch.cuda.CUDAGraph`` objects that use the pool (``None``
    when nobody looked, e.g. for a snapshot loaded from a file).
    """

    json_properties: ClassVar[tuple[str, ...]] = ("free",)

    pool_id: tuple[int, int]
    kind: str
    graphs: int | None
    held: bool
    segments: int
    reserved: int
    allocated: int
    #: Allocated bytes in blocks a live storage starts in (graph outputs, static inputs);
    #: ``None`` without the storages' addresses.
    in_tensors: int | None = None

    @property
    def free(self) -> int:
        """Reserved but not allocated: what the graphs reuse on replay."""
        return self.reserved - self.allocated

    @property
    def description(self) -> str:
        """What created the pool, in words."""
        return POOL_KINDS.get(self.kind, "an unknown owner")


@dataclass(frozen=True, slots=True)
class CacheSplit:
    """Where the cache (reserved − allocated) of one device sits, as ``empty_cache()`` sees it.

    The parts add up to ``cached``: ``pools_free`` (free blocks inside private pools still in
    use), ``pending_free`` (blocks freed after ``record_stream`` whose stream events have not
    completed), ``stranded`` (free blocks on idle streams), ``releasable`` (what
    ``empty_cache()`` returns of the rest) and ``non_releasable`` (free bytes that stay: beside
    live blocks in ordinary segments, or in partial pages of expandable segments).
    """

    json_properties: ClassVar[tuple[str, ...]] = ("cached", "empty_cache_returns")

    reserved: int
    live: int
    stranded: int
    #: Part of ``stranded`` inside segments that still hold a live block (e.g. a cuBLAS
    #: workspace): ``empty_cache()`` cannot return it until that block is freed.
    stranded_in_live_segments: int
    releasable: int
    non_releasable: int
    streams: tuple[StreamCache, ...]
    pending_free: int = 0
    #: Of ``pending_free``, what ``empty_cache()`` returns once the events complete.
    pending_releasable: int = 0
    #: Of ``stranded``, what ``empty_cache()`` returns.
    stranded_releasable: int = 0
    #: Free bytes inside private pools that a graph or MemPool still uses.
    pools_free: int = 0
    #: Every private pool seen (held or not).
    pools: tuple[PrivatePool, ...] = ()
    #: Whether any segment is expandable (``expandable_segments:True``).
    expandable: bool = False
    #: Of ``non_releasable``, free bytes of expandable segments that stay mapped because
    #: their page also holds part of a live block (pages are unmapped whole).
    partial_pages: int = 0
    #: Of ``non_releasable``, free bytes of ordinary segments that hold a live block.
    in_live_segments: int = 0

    @property
    def cached(self) -> int:
        """Reserved but not allocated."""
        return self.reserved - self.live

    @property
    def held_pools(self) -> tuple[PrivatePool, ...]:
        """The private pools ``empty_cache()`` leaves alone (a graph or MemPool uses them)."""
        return tuple(p for p in self.pools if p.held)

    @property
    def pools_allocated(self) -> int:
        """Allocated bytes inside the held private pools."""
        return sum(p.allocated for p in self.pools if p.held)

    @property
    def empty_cache_returns(self) -> int:
        """What ``torch.cuda.empty_cache()`` would hand back to CUDA now."""
        return self.releasable + self.pending_releasable + self.stranded_releasable


def _pool_kind(pool_id: tuple[int, int], owners: PoolOwners | None) -> str:
    if owners is not None:
        if pool_id in owners.trees:
            return "cudagraph_tree"
        if pool_id in owners.mempools:
            return "mempool"
    if pool_id[0] != 0:
        # capture_begin() without pool= makes an id whose first half is set.
        return "cuda_graph"
    if owners is not None and not owners.trees_loaded:
        # graph_pool_handle() ids (second half set) are shared pools; without torch.compile's
        # cudagraph trees imported, only the user's own graphs can have made it.
        return "cuda_graph"
    return "shared_graph"


def _starts_in(blocks: Sequence[Block], addresses: Sequence[int]) -> list[bool]:
    """Whether a live storage starts inside each block (``addresses`` sorted)."""
    out = []
    for b in blocks:
        k = bisect.bisect_left(addresses, b.address)
        out.append(k < len(addresses) and addresses[k] < b.address + b.size)
    return out


@dataclass
class _Totals:
    """The free bytes of the streams' segments (outside held pools), by where they sit."""

    stranded: int = 0
    stranded_live_seg: int = 0
    stranded_ret: int = 0
    releasable: int = 0
    non_releasable: int = 0
    partial_pages: int = 0
    in_live_segments: int = 0
    pending: int = 0
    pending_ret: int = 0
    pools_free: int = 0
    streams: list[StreamCache] = field(default_factory=list)


def split_cache(
    segments: Iterable[Mapping[str, Any]],
    *,
    current_streams: Iterable[int] = (0,),
    tensor_addresses: Iterable[int] | None = None,
    pool_owners: PoolOwners | None = None,
) -> CacheSplit:
    """Split the cache described by snapshot ``segments`` (one device's).

    A stream is *stranded* when it is not among ``current_streams`` and none of its live
    blocks starts at an address in ``tensor_addresses`` (the ``data_ptr`` of every storage
    a Python tensor holds; allocator blocks start where their storage starts). Without
    ``tensor_addresses`` only streams with no live block at all count, so a stream whose only
    live block is a cuBLAS workspace is then not flagged.

    ``pool_owners`` says which private pools still have a live graph or MemPool; without it
    (a snapshot from a file) every private pool counts as held.
    """
    segs = [s for s in segments if isinstance(s, Mapping)]
    current = set(current_streams)
    addresses = None if tensor_addresses is None else sorted(set(tensor_addresses))

    def held(pool: tuple[int, int]) -> bool:
        if pool == NO_POOL:
            return False
        if pool_owners is None:
            return True
        return pool_owners.graphs.get(pool, 0) > 0 or pool in pool_owners.mempools

    parsed = [(seg, blocks_of(seg), segment_pool_id(seg)) for seg in segs]
    per_pool: dict[tuple[int, int], list[tuple[list[Block], int, int]]] = {}
    per_stream: dict[int, list[tuple[Mapping[str, Any], list[Block]]]] = {}
    reserved = live = 0
    expandable = False
    t = _Totals()
    for seg, blocks, pool in parsed:
        size = _int(seg.get("total_size")) or sum(b.size for b in blocks)
        seg_live = sum(b.size for b in blocks if b.allocated)
        reserved += size
        live += seg_live
        expandable = expandable or seg.get("is_expandable") is True
        if pool != NO_POOL:
            per_pool.setdefault(pool, []).append((blocks, size, seg_live))
            if held(pool):
                t.pools_free += size - seg_live
                continue
        per_stream.setdefault(_int(seg.get("stream")), []).append((seg, blocks))

    for stream, members in sorted(per_stream.items()):
        _split_stream(stream, members, current, addresses, t)

    private = tuple(
        _private_pool(pid, members, held(pid), pool_owners, addresses)
        for pid, members in sorted(per_pool.items())
    )
    return CacheSplit(
        reserved=reserved,
        live=live,
        stranded=t.stranded,
        stranded_in_live_segments=t.stranded_live_seg,
        releasable=t.releasable,
        non_releasable=t.non_releasable,
        streams=tuple(t.streams),
        pending_free=t.pending,
        pending_releasable=t.pending_ret,
        stranded_releasable=t.stranded_ret,
        pools_free=t.pools_free,
        pools=private,
        expandable=expandable,
        partial_pages=t.partial_pages,
        in_live_segments=t.in_live_segments,
    )


def _private_pool(
    pool_id: tuple[int, int],
    members: Sequence[tuple[list[Block], int, int]],
    held: bool,
    owners: PoolOwners | None,
    addresses: Sequence[int] | None,
) -> PrivatePool:
    """One private pool from its segments' ``(blocks, size, allocated bytes)``."""
    in_tensors = None
    if addresses is not None:
        in_tensors = sum(
            b.size
            for blocks, _, _ in members
            for b, hit in zip(blocks, _starts_in(blocks, addresses), strict=True)
            if hit and b.allocated
        )
    return PrivatePool(
        pool_id=pool_id,
        kind=_pool_kind(pool_id, owners),
        graphs=None if owners is None else owners.graphs.get(pool_id, 0),
        held=held,
        segments=len(members),
        reserved=sum(size for _, size, _ in members),
        allocated=sum(live for _, _, live in members),
        in_tensors=in_tensors,
    )


def _split_stream(
    stream: int,
    members: Sequence[tuple[Mapping[str, Any], list[Block]]],
    current: set[int],
    addresses: Sequence[int] | None,
    t: _Totals,
) -> None:
    """Add one stream's segments (outside held pools) to the totals."""
    reserved = sum(_int(s.get("total_size")) or sum(b.size for b in bl) for s, bl in members)
    live_blocks = [b for _, bl in members for b in bl if b.allocated]
    live = sum(b.size for b in live_blocks)
    if addresses is None:
        holds_tensor = bool(live_blocks)
    else:
        holds_tensor = any(_starts_in(live_blocks, addresses))
    is_current = stream in current
    stranded = not is_current and not holds_tensor and reserved > live
    t.streams.append(
        StreamCache(
            stream=stream,
            segments=len(members),
            reserved=reserved,
            live=live,
            cached=reserved - live,
            current=is_current,
            stranded=stranded,
        )
    )
    for seg, blocks in members:
        returned = _returnable(seg, blocks)
        seg_live = any(b.allocated for b in blocks)
        is_expandable = page_size(seg) is not None
        for b, ret in zip(blocks, returned, strict=True):
            if b.allocated:
                continue
            if b.pending:
                t.pending += b.size
                t.pending_ret += ret
            elif stranded:
                t.stranded += b.size
                t.stranded_ret += ret
                if seg_live:
                    t.stranded_live_seg += b.size
            else:
                t.releasable += ret
                t.non_releasable += b.size - ret
                if is_expandable:
                    t.partial_pages += b.size - ret
                else:
                    t.in_live_segments += b.size - ret
        # Bytes of the segment no block describes (a damaged file): keep the sum exact.
        gap = (_int(seg.get("total_size")) or 0) - sum(b.size for b in blocks)
        if gap > 0:
            t.non_releasable += gap


def workspace_streams(
    segments: Iterable[Mapping[str, Any]],
    sizes: Iterable[int],
    tensor_addresses: Iterable[int],
) -> dict[int, int]:
    """``stream → count`` of allocated blocks that look like cuBLAS workspaces: no live
    storage starts in them and their requested size is a workspace size (the census's rule).
    cuBLAS keeps one workspace per (handle, stream), so a new stream per run adds one."""
    wanted = set(sizes)
    addresses = sorted(set(tensor_addresses))
    out: dict[int, int] = {}
    for seg in segments:
        if not isinstance(seg, Mapping):
            continue
        blocks = [b for b in blocks_of(seg) if b.allocated and b.requested in wanted]
        hits = _starts_in(blocks, addresses)
        n = sum(1 for hit in hits if not hit)
        if n:
            stream = _int(seg.get("stream"))
            out[stream] = out.get(stream, 0) + n
    return out


@dataclass(frozen=True, slots=True)
class PoolBlock:
    """An allocated block inside a private pool: ``[address, address + size)``."""

    address: int
    size: int
    pool_id: tuple[int, int]
    kind: str


@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """Allocated blocks of private pools on one device, by address (``graph_pool_blocks``).

    ``pool_of(storage.data_ptr())`` says whether a storage lives in a CUDA graph's pool: then
    deleting every Python reference returns it to the pool, not to the cache, and only
    deleting the graph frees the pool.
    """

    device: int
    blocks: tuple[PoolBlock, ...]
    pools: tuple[PrivatePool, ...]
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def pool_of(self, address: int) -> PoolBlock | None:
        """The pool block containing ``address``, ``None`` outside every private pool."""
        starts = self._starts or tuple(b.address for b in self.blocks)
        k = bisect.bisect_right(starts, address) - 1
        if k < 0:
            return None
        block = self.blocks[k]
        return block if address < block.address + block.size else None

    def pool(self, pool_id: tuple[int, int]) -> PrivatePool | None:
        """The summary of one pool."""
        for p in self.pools:
            if p.pool_id == pool_id:
                return p
        return None


def pool_blocks_of(
    device: int, segments: Iterable[Mapping[str, Any]], owners: PoolOwners | None = None
) -> PoolBlocks:
    """``PoolBlocks`` from snapshot ``segments`` (pure; see ``graph_pool_blocks``)."""
    segs = [s for s in segments if isinstance(s, Mapping) and segment_pool_id(s) != NO_POOL]
    blocks = sorted(
        (
            PoolBlock(b.address, b.size, segment_pool_id(s), _pool_kind(segment_pool_id(s), owners))
            for s in segs
            for b in blocks_of(s)
            if b.allocated
        ),
        key=lambda b: b.address,
    )
    pools = split_cache(segs, pool_owners=owners).pools
    return PoolBlocks(device, tuple(blocks), pools, tuple(b.address for b in blocks))


def graph_pool_blocks(device: DeviceLike = "cuda", *, owners: bool = True) -> PoolBlocks:
    """Where the private pools of CUDA graphs (and ``torch.cuda.MemPool``) sit on ``device``.

    Reads ``torch.cuda.memory_snapshot()`` (no history recording, no context created: a
    device without a context has no pools). With ``owners=True`` it also finds the live
    ``torch.cuda.CUDAGraph``, ``MemPool`` and torch.compile cudagraph-tree objects that use
    each pool (one ``gc.get_referrers`` scan, only when a private pool exists).

    Args:
        device: a CUDA device (``0``, ``'cuda:1'``, ``torch.device``).
        owners: look for the graphs that keep each pool alive.

    Returns:
        ``PoolBlocks``; ``pool_of(address)`` maps a storage's ``data_ptr`` to its pool.
    """
    check_bool("owners", owners)
    index = resolve_device(device)
    be = _backend.get()
    if not be.has_context(index):
        return PoolBlocks(index, (), ())
    segments = be.memory_segments(index) or []
    found = be.private_pool_owners() if owners and has_private_pools(segments) else None
    return pool_blocks_of(index, segments, found)
