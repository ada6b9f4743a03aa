"""Allocator snapshots: loading them safely and reading their segments and blocks.

``torch.cuda.memory._dump_snapshot()`` writes a pickle, and unpickling runs whatever the file
names: a snapshot from a colleague or a bug report could call ``os.system``. ``load_snapshot``
uses a restricted unpickler that builds plain data only (dict, list, tuple, str, int, float,
bool, None, bytes) and refuses every global with ``UnsafeSnapshotError``.

The readers here (``blocks_of``, ``segment_pool_id``, ``page_size``, ``returnable``, ...)
follow the allocator's rules; ``cache_split`` applies them to a whole cache.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from ..base.args import check_int
from ..base.format import plural

#: The ``filename`` of the synthetic frames that name a block's holder (what
#: ``cudamem.ledger.memviz`` writes into a dump and ``cudamem.diff`` reads back).
HOLDER_FILENAME = "cudamem holder"
#: The ``filename`` of the synthetic frames that say no holder was found.
NOTE_FILENAME = "cudamem"
#: The key of a holder frame that names the holder's container (``cudamem.diff`` groups by it).
CONTAINER_KEY = "cudamem_container"
#: The block states of live (allocated) memory.
LIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})

__all__ = [
    "CONTAINER_KEY",
    "HOLDER_FILENAME",
    "LARGE_PAGE",
    "LIVE_STATES",
    "MAX_SNAPSHOT_BYTES",
    "NOTE_FILENAME",
    "SMALL_PAGE",
    "Block",
    "Frame",
    "UnsafeSnapshotError",
    "allocated_blocks",
    "blocks_of",
    "has_private_pools",
    "largest_free",
    "load_snapshot",
    "loads_snapshot",
    "page_size",
    "returnable",
    "segment_pool_id",
    "segments_of",
]


#: Files larger than this are refused unless ``max_bytes`` says otherwise (a snapshot with a
#: long history can reach GBs; reading one should be a decision).
MAX_SNAPSHOT_BYTES = 2 * 1024**3


#: Page size of an expandable segment in the large pool (``kLargeBuffer``, 20 MiB).
LARGE_PAGE = 20 * 1024**2


#: Page size of an expandable segment in the small pool (``kSmallBuffer``, 2 MiB).
SMALL_PAGE = 2 * 1024**2


NO_POOL = (0, 0)


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


# What a damaged or foreign file makes the unpickler raise: an empty file (EOFError), JSON or
# text ("invalid load key", UnpicklingError), a truncated pickle (EOFError, UnpicklingError,
# struct.error, IndexError, ValueError), opcodes in a nonsensical order (TypeError, KeyError).
_CORRUPT = (
    EOFError,
    pickle.UnpicklingError,
    struct.error,
    IndexError,
    KeyError,
    ValueError,
    TypeError,
    AttributeError,
    UnicodeDecodeError,
    OverflowError,
    RecursionError,
    MemoryError,
)


def _unpickle(data: bytes, name: str) -> Any:
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except UnsafeSnapshotError:
        raise
    except _CORRUPT as exc:
        what = "an empty file" if not data else _sniff(data)
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(
            f"{name} is not a pickled memory snapshot ({what}; the unpickler said {reason}). "
            "torch.cuda.memory._dump_snapshot() writes the format load_snapshot() reads."
        ) from exc


def _sniff(data: bytes) -> str:
    head = data[:64].lstrip()
    if head[:1] in (b"{", b"["):
        return "it looks like JSON"
    if data[:1] == b"\x80":
        return "a pickle that ends early or is damaged"
    return "its first bytes are not a pickle's"


def loads_snapshot(data: bytes) -> Any:
    """Unpickle ``data`` as plain data.

    Raises:
        UnsafeSnapshotError: the data names a global (a class or function).
        ValueError: the data is empty, truncated or not a pickle.
        TypeError: ``data`` is not bytes.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    return _unpickle(bytes(data), "the data")


def _source_name(source: Any) -> str:
    try:
        name = getattr(source, "name", None)
    except Exception:
        name = None
    return repr(name) if isinstance(name, str) else "the snapshot stream"


def load_snapshot(
    source: str | os.PathLike[str] | BinaryIO, *, max_bytes: int = MAX_SNAPSHOT_BYTES
) -> dict[str, Any]:
    """Load a ``torch.cuda.memory._dump_snapshot()`` file without running code from it.

    Args:
        source: a path, or a binary file object opened for reading.
        max_bytes: refuse files larger than this (snapshots with long histories get big).

    Returns:
        The snapshot dict (``segments``, ``device_traces``, …).

    Raises:
        UnsafeSnapshotError: the file names a global (a class or function).
        ValueError: the file is empty, truncated, not a pickle (JSON, text), larger than
            ``max_bytes``, or not a snapshot dict; the message names the file.
        TypeError: ``source`` is not a path or a binary file, or ``max_bytes`` is not an int.
        OSError: the file cannot be read (missing, a directory, no permission).
    """
    check_int("max_bytes", max_bytes, minimum=0)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not isinstance(path, str):
            raise TypeError(f"source must be a str path, not {type(path).__name__}")
        name = repr(path)
        size = os.path.getsize(path)
        if size > max_bytes:
            raise ValueError(
                f"{name} is {plural(size, 'byte')}, over max_bytes={max_bytes}; "
                "pass a larger max_bytes to read it"
            )
        with open(path, "rb") as f:
            data = f.read()
    elif callable(getattr(type(source), "read", None)):
        name = _source_name(source)
        data = source.read(max_bytes + 1)
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(
                f"{name} returned {type(data).__name__} from read(): open the file in binary "
                "mode ('rb')"
            )
        if len(data) > max_bytes:
            raise ValueError(f"{name} is over max_bytes={max_bytes}")
        data = bytes(data)
    else:
        raise TypeError(
            f"source must be a path or a binary file object, not {type(source).__name__}"
        )
    obj = _unpickle(data, name)
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise ValueError(
            f"{name} is not a memory snapshot: expected a dict with a 'segments' list, "
            f"got {type(obj).__name__}"
        )
    return obj


_ALLOCATED = "active_allocated"


_INACTIVE = "inactive"


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


class Frame(NamedTuple):
    """One frame of a block's allocation stack (recorded while memory history is on)."""

    name: str
    filename: str
    line: int


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a snapshot segment: where it starts, its size, what was asked for."""

    address: int
    size: int
    requested: int
    #: Its allocation stack, innermost first (only while memory history is recorded).
    frames: tuple[Frame, ...] = ()
    #: ``active_allocated``, ``inactive``, ``active_pending_free``, ...
    state: str = _ALLOCATED

    @property
    def allocated(self) -> bool:
        """Held by a live allocation."""
        return self.state == _ALLOCATED

    @property
    def free(self) -> bool:
        """Cached: free for the allocator to reuse."""
        return self.state == _INACTIVE

    @property
    def pending(self) -> bool:
        """Freed by the program, still waiting for the events of the streams it was recorded
        on (``record_stream``). Any other active state counts alike."""
        return self.state != _ALLOCATED and self.state.startswith("active")


def _frames(raw: Any) -> tuple[Frame, ...]:
    if not isinstance(raw, list):
        return ()
    return tuple(
        Frame(str(f.get("name", "")), str(f.get("filename", "")), _int(f.get("line")))
        for f in raw
        if isinstance(f, Mapping)
    )


def blocks_of(segment: Mapping[str, Any]) -> list[Block]:
    """The segment's blocks in address order; addresses are reconstructed when missing (as
    PyTorch's own viewer does: blocks tile their segment)."""
    raw = segment.get("blocks")
    if not isinstance(raw, list):
        return []
    address = _int(segment.get("address"))
    out = []
    for b in raw:
        if not isinstance(b, Mapping):
            continue
        size = max(0, _int(b.get("size")))
        addr = b.get("address")
        start = _int(addr) or address
        state = b.get("state")
        out.append(
            Block(
                start,
                size,
                _int(b.get("requested_size")) or size,
                _frames(b.get("frames")),
                state if isinstance(state, str) else _INACTIVE,
            )
        )
        address = start + size
    return out


def allocated_blocks(segments: Iterable[Mapping[str, Any]]) -> list[Block]:
    """Every allocated block of ``segments`` (``torch.cuda.memory_snapshot()`` segments)."""
    return [
        b for seg in segments if isinstance(seg, Mapping) for b in blocks_of(seg) if b.allocated
    ]


def largest_free(segments: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(largest free block, total free bytes)`` over the segments' cached blocks."""
    sizes = [
        b.size for seg in segments if isinstance(seg, Mapping) for b in blocks_of(seg) if b.free
    ]
    return max(sizes, default=0), sum(sizes)


def segment_pool_id(segment: Mapping[str, Any]) -> tuple[int, int]:
    """The private pool a snapshot segment belongs to; ``(0, 0)`` for the ordinary pools."""
    raw = segment.get("segment_pool_id")
    if isinstance(raw, (tuple, list)) and len(raw) == 2:
        return (_int(raw[0]), _int(raw[1]))
    return NO_POOL


def page_size(segment: Mapping[str, Any]) -> int | None:
    """The unmapping granularity of an expandable segment, ``None`` for an ordinary one."""
    if segment.get("is_expandable") is not True:
        return None
    return SMALL_PAGE if segment.get("segment_type") == "small" else LARGE_PAGE


def _returnable(segment: Mapping[str, Any], blocks: Sequence[Block]) -> list[int]:
    """Per block, the bytes ``empty_cache()`` hands back to CUDA (0 for allocated blocks).

    Pending blocks count as free: ``empty_cache()`` waits for their events first, and a freed
    block merges with its free neighbours before anything is released.
    """
    out = [0] * len(blocks)
    page = page_size(segment)
    if page is None:
        if blocks and not any(b.allocated for b in blocks):
            out = [b.size for b in blocks]  # the whole segment is cudaFree'd
        return out
    base = _int(segment.get("address")) or (blocks[0].address if blocks else 0)
    i = 0
    while i < len(blocks):
        if blocks[i].allocated:
            i += 1
            continue
        j = i
        while j < len(blocks) and not blocks[j].allocated:
            j += 1
        start, end = blocks[i].address, blocks[j - 1].address + blocks[j - 1].size
        lo = base + -(-(start - base) // page) * page  # first page boundary at or after start
        hi = base + ((end - base) // page) * page  # last page boundary at or before end
        for k in range(i, j):
            b = blocks[k]
            out[k] = max(0, min(b.address + b.size, hi) - max(b.address, lo))
        i = j
    return out


def returnable(segment: Mapping[str, Any], blocks: Sequence[Block]) -> list[int]:
    """Per block of ``segment`` (``blocks_of(segment)``), the bytes ``empty_cache()`` hands
    back to CUDA: the whole segment when no block is allocated, whole pages of free ranges
    in an expandable segment; 0 for allocated blocks."""
    return _returnable(segment, blocks)


def segments_of(snapshot: Mapping[str, Any], device: int) -> Sequence[Mapping[str, Any]]:
    """The segments of ``device`` in a loaded snapshot dict."""
    segs = snapshot.get("segments")
    if not isinstance(segs, list):
        return []
    return [s for s in segs if isinstance(s, Mapping) and _int(s.get("device")) == device]


def has_private_pools(segments: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any segment belongs to a private pool (a CUDA graph's or a MemPool's)."""
    return any(segment_pool_id(s) != NO_POOL for s in segments if isinstance(s, Mapping))
