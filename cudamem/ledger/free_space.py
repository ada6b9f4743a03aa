"""Fragmentation as a number: where the allocator's free bytes sit, and whether they could
have held the request that ran out of memory.

Read from one allocator snapshot (``torch.cuda.memory_snapshot()``'s segments), per pool
(the default pool; the private pools of CUDA graphs and ``MemPool``\\ s):

* ``reserved``, ``allocated`` and the cache between them;
* ``stranded``: free bytes the cache cannot give back with ``empty_cache()`` because live
  blocks sit beside them: free blocks of an ordinary segment that still holds an allocated
  (or pending) block, and the free parts of expandable segments' pages that also hold one;
* ``releasable``: free bytes in wholly free segments (whole free pages under expandable
  segments), what ``empty_cache()`` returns unless a graph holds the pool;
* the largest free block, and the count of segments.

"At peak" comes from the counters, not the snapshot: peak reserved minus peak allocated.
The two peaks may come from different moments; at the moment of the reserved peak, at least
that much was cached.

``judge_oom`` is the one rule that says whether an out-of-memory error was fragmentation
(the request fits in the free bytes — the cache's plus the device's — but in no single free
block: ``expandable_segments:True`` would have avoided it) or not (the request is more than
all of them). ``oom.py``'s advice uses it too. ``oom_verdict`` applies it to what a ledger
can read without the exception: the allocator's OOM count, the stranded bytes against the
largest free block, the last OOM the observer recorded, and says how sure it is.

Pure: no torch, no backend. ``cudamem.fragmentation()`` (``ledger.py``) collects the inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..allocator.backend_base import PoolOwners
from ..allocator.cache_split import POOL_KINDS, split_cache
from ..allocator.snapshot import NO_POOL, blocks_of, returnable, segment_pool_id
from ..allocator.stats import AllocatorStats
from ..base.present import Presented, PresentedHtml

__all__ = [
    "CERTAIN",
    "FITS_NOW",
    "FRAGMENTATION",
    "LIKELY",
    "LIKELY_RATIO",
    "NOT_FRAGMENTATION",
    "UNKNOWN",
    "UNSURE",
    "Fragmentation",
    "OomFacts",
    "OomJudgement",
    "OomVerdict",
    "PoolFragmentation",
    "analyze",
    "headroom",
    "judge_oom",
    "oom_verdict",
]

#: The request fits in the free bytes together, in no single free block.
FRAGMENTATION = "fragmentation"
#: The request is more than every free byte together: fragmentation did not cause it.
NOT_FRAGMENTATION = "not_fragmentation"
#: A free block holds the request now: memory was freed after the OOM (or the request was
#: on another stream or in another pool).
FITS_NOW = "fits_now"
#: Not enough known (the device's free memory) to tell.
UNKNOWN = "unknown"

# How sure an ``OomVerdict`` is.
#: The request's size and the device's free memory are known (the observer recorded them,
#: or the exception's message states them): ``judge_oom`` decides.
CERTAIN = "certain"
#: Only the allocator's count says an OOM happened, and the cache's stranded bytes hold a
#: request ``LIKELY_RATIO`` times the largest free block that no free block holds.
LIKELY = "likely"
#: An OOM happened, but what is known does not tell its cause.
UNSURE = "unsure"

#: Without the request's size, ``oom_verdict`` asks ``judge_oom`` about a request this many
#: times the largest free block: when the stranded bytes hold it, any request from the
#: largest free block up to that size ran out of memory by fragmentation.
LIKELY_RATIO = 4


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


# --------------------------------------------------------------------------- the rule


def headroom(device_free: int | None, limit: int | None, reserved: int) -> int | None:
    """What the allocator could still have taken from the device: its free memory, capped
    by ``limit - reserved`` where a limit (``set_per_process_memory_fraction``'s allowed
    maximum, or the device's capacity) is known; ``None`` when the free memory is unknown."""
    if device_free is None:
        return None
    room = device_free if limit is None else min(device_free, limit - reserved)
    return max(room, 0)


def judge_oom(
    requested: int, *, largest_free: int, cache_free: int, device_free: int | None
) -> str:
    """Whether fragmentation caused an out-of-memory error for ``requested`` bytes.

    ``largest_free`` is the largest free block the request could have used, ``cache_free``
    every free byte of the cache outside pools a graph holds, ``device_free`` what the
    allocator could still take from the device (``headroom``). Returns:

    * ``FITS_NOW``: a free block holds the request (the cache changed since the OOM);
    * ``NOT_FRAGMENTATION``: more than the cache's and the device's free bytes together;
    * ``FRAGMENTATION``: it fits in those free bytes together but in no single block;
    * ``UNKNOWN``: more than the cache holds, and the device's free memory is unknown.
    """
    if requested <= largest_free:
        return FITS_NOW
    if requested <= cache_free:
        return FRAGMENTATION
    if device_free is None:
        return UNKNOWN
    if requested > cache_free + device_free:
        return NOT_FRAGMENTATION
    return FRAGMENTATION


def oom_verdict(
    device: int,
    *,
    ooms: int,
    judged: OomJudgement | None,
    stranded: int,
    largest_free: int,
    expandable: bool,
) -> OomVerdict | None:
    """Why the device ran out of memory, from what can be read without the exception.

    ``ooms`` is the allocator's count (``num_ooms``), ``judged`` the last OOM the observer
    recorded (or the exception's message gave) judged against the cache, ``stranded`` the
    free bytes beside live blocks outside pools graphs hold, ``largest_free`` the largest
    free block the request could have used, ``expandable`` whether expandable segments are
    on (configured, or in the snapshot). ``None`` when no OOM happened: no count and nothing
    recorded. Otherwise:

    * ``CERTAIN``: the request and the device's free memory are known, and ``judge_oom``
      says fragmentation or not;
    * ``LIKELY`` fragmentation: only the count, and ``judge_oom`` calls a request of
      ``LIKELY_RATIO`` times the largest free block fragmentation against the stranded
      bytes (they exceed the largest free block by that much);
    * ``UNSURE``: anything else (the cause is ``judged``'s verdict, or ``UNKNOWN``).
    """
    if ooms <= 0 and judged is None:
        return None
    requested = None if judged is None else judged.requested
    source = "" if judged is None else judged.source
    if judged is not None and judged.verdict in (FRAGMENTATION, NOT_FRAGMENTATION):
        cause, confidence = judged.verdict, CERTAIN
    elif (
        judged is None
        and largest_free > 0
        and (
            judge_oom(
                LIKELY_RATIO * largest_free,
                largest_free=largest_free,
                cache_free=stranded,
                device_free=None,
            )
            == FRAGMENTATION
        )
    ):
        cause, confidence = FRAGMENTATION, LIKELY
    else:
        cause, confidence = (UNKNOWN if judged is None else judged.verdict), UNSURE
    return OomVerdict(
        device=device,
        cause=cause,
        confidence=confidence,
        ooms=max(ooms, 0),
        stranded=stranded,
        largest_free=largest_free,
        expandable=expandable,
        requested=requested,
        source=source,
    )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class OomFacts:
    """An out-of-memory error as the allocator stated it: the bytes requested (after its
    rounding), the limit it ran into (capacity, or the allowed maximum under a memory
    fraction) and the device's free memory. ``None`` where unknown."""

    device: int
    requested: int
    total: int | None
    free: int | None
    #: Where the figures come from: ``"the allocator's OOM observer"``, ``"the message"``.
    source: str
    #: Seconds between the OOM and the snapshot read (``None`` when unknown).
    seconds_ago: float | None = None


@dataclass(frozen=True, slots=True)
class OomJudgement(Presented):
    """The last OOM against the cache: would ``expandable_segments:True`` have avoided it?

    The cache is read after the OOM (the allocator has by then returned every wholly free
    segment and retried): if memory was freed in between, the verdict is ``fits_now``.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("total_free", "expandable_would_help")

    device: int
    requested: int
    #: The largest free block of the default pool on the current streams.
    largest_free: int
    #: Free bytes of the cache outside the private pools graphs hold.
    cache_free: int
    #: What the allocator could still take from the device (``headroom``).
    device_free: int | None
    #: Whether expandable segments are on already (the cache's segments, or configured).
    expandable: bool
    #: ``judge_oom``'s verdict: ``fragmentation``, ``not_fragmentation``, ``fits_now``,
    #: ``unknown``.
    verdict: str
    source: str = ""
    seconds_ago: float | None = None

    @property
    def total_free(self) -> int | None:
        """The cache's free bytes plus the device's."""
        return None if self.device_free is None else self.cache_free + self.device_free

    @property
    def expandable_would_help(self) -> bool:
        """Fragmentation, and expandable segments are not on yet."""
        return self.verdict == FRAGMENTATION and not self.expandable


@dataclass(frozen=True, slots=True)
class OomVerdict(Presented):
    """Why the device ran out of memory, and how sure that is (``oom_verdict``): carried by
    ``Fragmentation.verdict``, so ``cudamem.explain()``'s ledger states it after an OOM
    that nothing recorded. ``None`` there when no OOM happened."""

    json_properties: ClassVar[tuple[str, ...]] = ("expandable_would_help",)

    device: int
    #: ``judge_oom``'s verdict: ``fragmentation``, ``not_fragmentation``, ``fits_now``,
    #: ``unknown``.
    cause: str
    #: ``certain``, ``likely`` or ``unsure``.
    confidence: str
    #: Out-of-memory errors the allocator counted on the device (``num_ooms``).
    ooms: int
    #: Free bytes beside live blocks, outside pools graphs hold.
    stranded: int
    #: The largest free block of the default pool on the current streams.
    largest_free: int
    #: Whether expandable segments are on (configured, or in the snapshot).
    expandable: bool
    #: The request that failed, where recorded (``None``: only the count is known).
    requested: int | None = None
    #: Where the request's figures come from (``""``: the allocator's count alone).
    source: str = ""

    @property
    def expandable_would_help(self) -> bool:
        """Fragmentation (certain or likely), and expandable segments are not on yet."""
        return self.cause == FRAGMENTATION and not self.expandable


@dataclass(frozen=True, slots=True)
class PoolFragmentation:
    """One pool of one device: where its reserved bytes sit. Bytes are ints.

    ``reserved = allocated + pending + stranded + releasable``.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("cached", "free", "empty_cache_returns")

    #: ``(0, 0)`` for the default pool, a private pool's id otherwise.
    pool_id: tuple[int, int]
    #: ``"default"``, or what made the private pool (``snapshot.POOL_KINDS``' keys).
    kind: str
    #: A graph or ``MemPool`` still uses it: ``empty_cache()`` returns none of it.
    held: bool
    segments: int
    reserved: int
    allocated: int
    #: Free bytes beside live blocks: inside ordinary segments that still hold an allocated
    #: or pending block, and free parts of expandable pages that also hold one.
    stranded: int
    #: Free bytes of wholly free segments (whole free pages of expandable ones).
    releasable: int
    #: Freed blocks still waiting for their streams' events (``record_stream``).
    pending: int
    largest_free: int
    free_blocks: int

    @property
    def cached(self) -> int:
        """Reserved but not allocated."""
        return self.reserved - self.allocated

    @property
    def free(self) -> int:
        """Free bytes (the cache less the pending blocks)."""
        return self.stranded + self.releasable

    @property
    def empty_cache_returns(self) -> int:
        """What ``empty_cache()`` would give back of this pool now (pending blocks aside)."""
        return 0 if self.held else self.releasable

    @property
    def description(self) -> str:
        """The pool in words."""
        if self.pool_id == NO_POOL:
            return "default pool"
        return POOL_KINDS.get(self.kind, "an unknown owner")


@dataclass(frozen=True, slots=True)
class Fragmentation(PresentedHtml):
    """How fragmented one device's cache is (``cudamem.fragmentation()``, and each ledger
    of ``cudamem.explain()``). Bytes are ints; ``None`` is unknown.

    ``pools`` lists the default pool first (when it has segments), then the private pools.
    """

    json_properties: ClassVar[tuple[str, ...]] = (
        "reserved",
        "allocated",
        "cached",
        "stranded",
        "releasable",
        "largest_free",
        "peak_cached",
    )

    device: int
    pools: tuple[PoolFragmentation, ...]
    #: Whether the segments are expandable (``expandable_segments:True``).
    expandable: bool
    peak_reserved: int | None = None
    peak_allocated: int | None = None
    #: The last out-of-memory error on the device, judged against this cache.
    oom: OomJudgement | None = None
    notes: tuple[str, ...] = ()
    #: Why the device ran out of memory and how sure that is; ``None`` when it never did.
    verdict: OomVerdict | None = None

    @property
    def reserved(self) -> int:
        """Every pool's reserved bytes."""
        return sum(p.reserved for p in self.pools)

    @property
    def allocated(self) -> int:
        """Every pool's allocated bytes."""
        return sum(p.allocated for p in self.pools)

    @property
    def cached(self) -> int:
        """Reserved minus allocated."""
        return self.reserved - self.allocated

    @property
    def stranded(self) -> int:
        """Free bytes beside live blocks, every pool."""
        return sum(p.stranded for p in self.pools)

    @property
    def releasable(self) -> int:
        """Free bytes of wholly free segments (pages), every pool."""
        return sum(p.releasable for p in self.pools)

    @property
    def largest_free(self) -> int:
        """The largest free block of any pool."""
        return max((p.largest_free for p in self.pools), default=0)

    @property
    def peak_cached(self) -> int | None:
        """Peak reserved minus peak allocated: at the reserved peak at least this much was
        cached (the two peaks may come from different moments)."""
        if self.peak_reserved is None or self.peak_allocated is None:
            return None
        return max(self.peak_reserved - self.peak_allocated, 0)

    def pool(self, pool_id: tuple[int, int] = NO_POOL) -> PoolFragmentation | None:
        """One pool (the default pool without an argument), ``None`` if it has no segment."""
        for p in self.pools:
            if p.pool_id == pool_id:
                return p
        return None


# --------------------------------------------------------------------------- analysis


@dataclass
class _Pool:
    segments: int = 0
    reserved: int = 0
    allocated: int = 0
    pending: int = 0
    releasable: int = 0
    largest: int = 0
    free_blocks: int = 0


def _add(acc: _Pool, segment: Mapping[str, Any]) -> int:
    """Add one segment to its pool's sums; the largest free block in it."""
    blocks = blocks_of(segment)
    size = _int(segment.get("total_size")) or sum(b.size for b in blocks)
    returned = returnable(segment, blocks)
    largest = 0
    acc.segments += 1
    acc.reserved += size
    for b, ret in zip(blocks, returned, strict=True):
        if b.allocated:
            acc.allocated += b.size
        elif b.free:
            acc.releasable += ret
            acc.free_blocks += 1
            largest = max(largest, b.size)
        else:
            acc.pending += b.size
    acc.largest = max(acc.largest, largest)
    return largest


def analyze(
    device: int,
    segments: Iterable[Mapping[str, Any]],
    *,
    stats: AllocatorStats | None = None,
    owners: PoolOwners | None = None,
    current_streams: Iterable[int] | None = None,
    oom: OomFacts | None = None,
    notes: Sequence[str] = (),
    expandable_configured: bool = False,
) -> Fragmentation:
    """``Fragmentation`` of one device's snapshot ``segments`` (pure).

    Args:
        device: the device the segments belong to.
        segments: ``torch.cuda.memory_snapshot()`` segments of that device.
        stats: the allocator's counters, for the peaks.
        owners: who uses the private pools (``None``: every private pool counts as held,
            as for a snapshot loaded from a file).
        current_streams: the streams a new request can take free blocks from (``None``:
            every stream); the OOM judgement's largest free block is theirs.
        oom: the last out-of-memory error, judged against this cache.
        notes: carried into the result.
        expandable_configured: whether ``expandable_segments:True`` is configured (the
            verdict then suggests nothing the process has on already).
    """
    segs = [s for s in segments if isinstance(s, Mapping)]
    private = {p.pool_id: p for p in split_cache(segs, pool_owners=owners).pools}
    streams = None if current_streams is None else set(current_streams)
    acc: dict[tuple[int, int], _Pool] = {}
    usable_largest = 0
    for seg in segs:
        pool = segment_pool_id(seg)
        largest = _add(acc.setdefault(pool, _Pool()), seg)
        if pool == NO_POOL and (streams is None or _int(seg.get("stream")) in streams):
            usable_largest = max(usable_largest, largest)
    pools = []
    for pid in sorted(acc, key=lambda p: (p != NO_POOL, p)):
        a = acc[pid]
        info = private.get(pid)
        pools.append(
            PoolFragmentation(
                pool_id=pid,
                kind="default" if info is None else info.kind,
                held=False if info is None else info.held,
                segments=a.segments,
                reserved=a.reserved,
                allocated=a.allocated,
                stranded=a.reserved - a.allocated - a.pending - a.releasable,
                releasable=a.releasable,
                pending=a.pending,
                largest_free=a.largest,
                free_blocks=a.free_blocks,
            )
        )
    expandable = any(s.get("is_expandable") is True for s in segs)
    judged = None
    if oom is not None:
        reserved = sum(p.reserved for p in pools)
        cache_free = sum(p.free for p in pools if not p.held)
        room = headroom(oom.free, oom.total, reserved)
        judged = OomJudgement(
            device=device,
            requested=oom.requested,
            largest_free=usable_largest,
            cache_free=cache_free,
            device_free=room,
            expandable=expandable or expandable_configured,
            verdict=judge_oom(
                oom.requested,
                largest_free=usable_largest,
                cache_free=cache_free,
                device_free=room,
            ),
            source=oom.source,
            seconds_ago=oom.seconds_ago,
        )
    verdict = oom_verdict(
        device,
        ooms=0 if stats is None else stats.ooms,
        judged=judged,
        stranded=sum(p.stranded for p in pools if not p.held),
        largest_free=usable_largest,
        expandable=expandable or expandable_configured,
    )
    return Fragmentation(
        device=device,
        pools=tuple(pools),
        expandable=expandable,
        peak_reserved=None if stats is None else stats.peak_reserved,
        peak_allocated=None if stats is None else stats.peak_allocated,
        oom=judged,
        notes=tuple(notes),
        verdict=verdict,
    )
