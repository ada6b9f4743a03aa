"""Allocator snapshots: loading them safely and reading where the cache sits.

``torch.cuda.memory._dump_snapshot()`` writes a pickle, and unpickling runs whatever the file
names: a snapshot from a colleague or a bug report could call ``os.system``. :func:`load_snapshot`
uses a restricted unpickler that builds plain data only (dict, list, tuple, str, int, float,
bool, None, bytes) and refuses every global with :class:`UnsafeSnapshotError`.

:func:`split_cache` reads segments (from a loaded file or ``torch.cuda.memory_snapshot()``) and
splits the allocator's cache into what ``empty_cache()`` can return, what it cannot (free blocks
inside segments that still hold live blocks), and what is stranded on streams that hold no
live tensor, the signature of "a new ``torch.cuda.Stream`` per run grows memory by one run".
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = [
    "MAX_SNAPSHOT_BYTES",
    "CacheSplit",
    "StreamCache",
    "UnsafeSnapshotError",
    "load_snapshot",
    "loads_snapshot",
    "segments_of",
    "split_cache",
]

#: Files larger than this are refused unless ``max_bytes`` says otherwise (a snapshot with a
#: long history can reach GBs; reading one should be a decision).
MAX_SNAPSHOT_BYTES = 2 * 1024**3


class UnsafeSnapshotError(pickle.UnpicklingError):
    """The file asks the unpickler for something other than plain data."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, str, bytes, int, float, bool and None; nothing else.

    Those types come from pickle opcodes, never from ``find_class``; so refusing every
    global (and every persistent id) leaves no way to construct or call any object.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeSnapshotError(
            f"refusing to load {module}.{name}: a memory snapshot holds plain data only "
            "(dict, list, tuple, str, int, float, bool, None, bytes), and this file asks for "
            "a Python object. It may run code when unpickled; open it only if you trust it."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeSnapshotError("refusing a persistent id: not a plain-data snapshot")


def loads_snapshot(data: bytes) -> Any:
    """Unpickle ``data`` as plain data; :class:`UnsafeSnapshotError` for anything else."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()


def load_snapshot(
    source: str | os.PathLike[str] | BinaryIO, *, max_bytes: int = MAX_SNAPSHOT_BYTES
) -> dict[str, Any]:
    """Load a ``torch.cuda.memory._dump_snapshot()`` file without running code from it.

    Returns the snapshot dict (``segments``, ``device_traces``, …). Raises
    :class:`UnsafeSnapshotError` when the file names any global (a class or function),
    ``ValueError`` when it is larger than ``max_bytes`` or is not a snapshot dict.
    """
    if isinstance(source, (str, os.PathLike)):
        size = os.path.getsize(source)
        if size > max_bytes:
            raise ValueError(
                f"{os.fspath(source)} is {size} bytes, over max_bytes={max_bytes}; "
                "pass a larger max_bytes to read it"
            )
        with open(source, "rb") as f:
            data = f.read()
    else:
        data = source.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"snapshot is over max_bytes={max_bytes}")
    obj = loads_snapshot(data)
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise ValueError("not a memory snapshot: expected a dict with a 'segments' list")
    return obj


# --------------------------------------------------------------------------- analysis

_LIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})


@dataclass(frozen=True, slots=True)
class StreamCache:
    """The allocator's segments on one CUDA stream of one device. Bytes are ints.

    ``stranded`` streams are not this thread's current stream and hold no live tensor: their
    cached blocks can only be reused by allocations on that same stream, which usually no
    longer exists (a ``torch.cuda.Stream`` made per run). ``empty_cache()`` returns them.
    """

    stream: int
    segments: int
    reserved: int
    live: int
    cached: int
    current: bool
    stranded: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "stream": self.stream,
            "segments": self.segments,
            "reserved": self.reserved,
            "live": self.live,
            "cached": self.cached,
            "current": self.current,
            "stranded": self.stranded,
        }


@dataclass(frozen=True, slots=True)
class CacheSplit:
    """Where the cache (reserved − live) of one device sits. The three parts add up to
    ``cached``: ``stranded`` (on idle streams), ``releasable`` (whole free segments elsewhere,
    which ``empty_cache()`` returns) and ``non_releasable`` (free blocks inside segments that
    still hold live blocks, which stay until those blocks are freed)."""

    reserved: int
    live: int
    stranded: int
    #: Part of ``stranded`` inside segments that still hold a live block (e.g. a cuBLAS
    #: workspace): ``empty_cache()`` cannot return it until that block is freed.
    stranded_in_live_segments: int
    releasable: int
    non_releasable: int
    streams: tuple[StreamCache, ...]

    @property
    def cached(self) -> int:
        """Reserved but not live."""
        return self.reserved - self.live

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "reserved": self.reserved,
            "live": self.live,
            "cached": self.cached,
            "stranded": self.stranded,
            "stranded_in_live_segments": self.stranded_in_live_segments,
            "releasable": self.releasable,
            "non_releasable": self.non_releasable,
            "streams": [s.to_dict() for s in self.streams],
        }


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _live_blocks(segment: Mapping[str, Any]) -> list[tuple[int, int]]:
    blocks = segment.get("blocks")
    if not isinstance(blocks, list):
        return []
    return [
        (_int(b.get("address")), _int(b.get("size")))
        for b in blocks
        if isinstance(b, Mapping) and b.get("state") in _LIVE_STATES
    ]


def split_cache(
    segments: Iterable[Mapping[str, Any]],
    *,
    current_streams: Iterable[int] = (0,),
    tensor_addresses: Iterable[int] | None = None,
) -> CacheSplit:
    """Split the cache described by snapshot ``segments`` (one device's).

    A stream is *stranded* when it is not among ``current_streams`` and none of its live
    blocks starts at an address in ``tensor_addresses`` (the ``data_ptr`` of every storage
    a Python tensor holds; allocator blocks start where their storage starts). Without
    ``tensor_addresses`` only streams with no live block at all count, so a stream whose only
    live block is a cuBLAS workspace is then not flagged.
    """
    current = set(current_streams)
    addresses = None if tensor_addresses is None else set(tensor_addresses)
    per_stream: dict[int, list[Mapping[str, Any]]] = {}
    for seg in segments:
        per_stream.setdefault(_int(seg.get("stream")), []).append(seg)

    streams: list[StreamCache] = []
    totals = {"reserved": 0, "live": 0, "stranded": 0, "stranded_live_seg": 0}
    releasable = non_releasable = 0
    for stream, segs in sorted(per_stream.items()):
        reserved = sum(_int(s.get("total_size")) for s in segs)
        live_blocks = [blk for s in segs for blk in _live_blocks(s)]
        live = sum(size for _, size in live_blocks)
        if addresses is None:
            holds_tensor = bool(live_blocks)
        else:
            holds_tensor = any(addr in addresses for addr, _ in live_blocks)
        is_current = stream in current
        stranded = not is_current and not holds_tensor and reserved > live
        streams.append(
            StreamCache(
                stream=stream,
                segments=len(segs),
                reserved=reserved,
                live=live,
                cached=reserved - live,
                current=is_current,
                stranded=stranded,
            )
        )
        totals["reserved"] += reserved
        totals["live"] += live
        for seg in segs:
            size = _int(seg.get("total_size"))
            seg_live = sum(s for _, s in _live_blocks(seg))
            free = size - seg_live
            if stranded:
                totals["stranded"] += free
                if seg_live:
                    totals["stranded_live_seg"] += free
            elif seg_live == 0:
                releasable += free
            else:
                non_releasable += free
    return CacheSplit(
        reserved=totals["reserved"],
        live=totals["live"],
        stranded=totals["stranded"],
        stranded_in_live_segments=totals["stranded_live_seg"],
        releasable=releasable,
        non_releasable=non_releasable,
        streams=tuple(streams),
    )


def segments_of(snapshot: Mapping[str, Any], device: int) -> Sequence[Mapping[str, Any]]:
    """The segments of ``device`` in a loaded snapshot dict."""
    segs = snapshot.get("segments")
    if not isinstance(segs, list):
        return []
    return [s for s in segs if isinstance(s, Mapping) and _int(s.get("device")) == device]
