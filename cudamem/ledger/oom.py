"""Out-of-memory post-mortems: what was asked for, what was there, who held it, what to do.

Where the report is made, and why there:

* **Inside a span.** An OOM that leaves a ``track()`` span is reported from the span's exit,
  while the exception is still propagating: the user's frames are alive, so holders include
  their locals. (Turn off with ``cudamem.configure_leaks(span_oom_reports=False)``.)
* **Anywhere, once** ``on_oom`` **is installed.** The allocator's OOM observer
  (``torch._C._cuda_attach_out_of_memory_observer``) runs *inside* ``malloc``, on the failing
  thread, half-way through raising: walking holders there could run for seconds while the
  allocator is mid-error and would see cudamem's own frames. So the observer only records
  four numbers (device, bytes requested, capacity, free); the full report comes later from
  ``sys.excepthook`` (uncaught in the main thread; ``sys.last_traceback`` is set, so the
  failing frames' locals are still named), ``threading.excepthook`` (other threads),
  IPython's custom exception handler (notebooks, where ``sys.excepthook`` is not used), or
  the guard used as a context manager (``with cudamem.on_oom(...):``). An OOM that user code
  catches and handles is only recorded (``guard.events``), never printed.

The exception is never changed, swallowed or re-raised differently: hooks report, then
hand the exception to the previous hook. ``OomGuard.uninstall`` restores every hook
cudamem replaced (and turns allocation-history recording off again if cudamem turned it on);
the allocator has no way to detach an observer, so cudamem's stays attached but idle.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..allocator import backend as _backend
from ..allocator import backend_base as _backend_base
from ..allocator.cache_split import split_cache
from ..allocator.snapshot import Frame, allocated_blocks, largest_free, segments_of
from ..base.format import format_bytes, plural
from ..base.frames import is_library_file
from ..base.present import Presented
from ..holders import census
from ..holders.census import LiveStorage
from ..holders.culprits import NO_HOLDER, Culprit, group_culprits
from .free_space import FRAGMENTATION, headroom, judge_oom

if TYPE_CHECKING:
    pass


__all__ = ["OomEvent", "OomReport", "last_event", "oom_report", "parse_oom_message"]


#: Observer events kept (the allocator may OOM repeatedly in a retry loop).
MAX_EVENTS = 32


#: An observer event this recent (seconds) describes the exception being reported.
EVENT_MAX_AGE = 60.0
#: How far the live allocator's reserved bytes may stand from the message's (which rounds
#: to two decimals of its unit) and still be the allocator the message describes.
SAME_CACHE = 16 << 20
SAME_CACHE_SHARE = 0.01


_SIZE = r"([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)"


_UNITS = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def _size(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class ParsedOom:
    """What PyTorch's OOM message states (sizes are rounded to two decimals there)."""

    requested: int | None = None
    device: int | None = None
    total: int | None = None
    free: int | None = None
    allowed: int | None = None
    process_in_use: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    #: ``(pid, bytes)`` for every process the message lists.
    processes: tuple[tuple[int, int], ...] = ()


_PATTERNS: dict[str, re.Pattern[str]] = {
    "requested": re.compile(r"Tried to allocate " + _SIZE),
    "device_total": re.compile(r"GPU (\d+) has a total capacity of " + _SIZE),
    "free": re.compile(r"of which " + _SIZE + r" is free"),
    "allowed": re.compile(_SIZE + r" allowed;"),
    "process": re.compile(r"this process has " + _SIZE + r" memory in use"),
    "allocated": re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch"),
    "unallocated": re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),
    # PyTorch < 2.1: "(GPU 0; 10.76 GiB total capacity; 9.50 GiB already allocated; ...)"
    "old_device": re.compile(r"\(GPU (\d+); " + _SIZE + r" total capacity"),
    "old_allocated": re.compile(_SIZE + r" already allocated"),
    "old_free": re.compile(_SIZE + r" free;"),
    "old_reserved": re.compile(_SIZE + r" reserved in total by PyTorch"),
}


_PROCESS_LINE = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")


def parse_oom_message(message: str) -> ParsedOom:
    """Read requested size, capacity, free, allocated and reserved from an OOM message.

    Handles the current format (``Tried to allocate 200.00 GiB. GPU 0 has a total capacity
    of 139.81 GiB of which 138.52 GiB is free. ...``) and the pre-2.1 one; fields the message
    does not state are ``None``.
    """

    def find(key: str) -> re.Match[str] | None:
        return _PATTERNS[key].search(message)

    values: dict[str, Any] = {}
    if m := find("requested"):
        values["requested"] = _size(m.group(1), m.group(2))
    if m := find("device_total") or find("old_device"):
        values["device"] = int(m.group(1))
        values["total"] = _size(m.group(2), m.group(3))
    if m := find("free") or find("old_free"):
        values["free"] = _size(m.group(1), m.group(2))
    if m := find("allowed"):
        values["allowed"] = _size(m.group(1), m.group(2))
    if m := find("process"):
        values["process_in_use"] = _size(m.group(1), m.group(2))
    if m := find("allocated") or find("old_allocated"):
        values["allocated"] = _size(m.group(1), m.group(2))
    if m := find("unallocated"):
        values["reserved_unallocated"] = _size(m.group(1), m.group(2))
    elif (m := find("old_reserved")) and "allocated" in values:
        values["reserved_unallocated"] = _size(m.group(1), m.group(2)) - values["allocated"]
    processes = tuple(
        (int(p.group(1)), _size(p.group(2), p.group(3))) for p in _PROCESS_LINE.finditer(message)
    )
    return ParsedOom(**values, processes=processes)


@dataclass(frozen=True, slots=True)
class OomEvent:
    """What the allocator's OOM observer saw, recorded inside ``malloc`` (nothing else)."""

    device: int
    #: Bytes the allocator tried to get (after its rounding).
    requested: int
    #: Device capacity, or the allowed maximum under ``set_per_process_memory_fraction``.
    total: int
    free: int
    time: float


@dataclass(frozen=True, slots=True)
class StrandedCache:
    """Cache reserved on a stream that holds no live tensor."""

    stream: int
    reserved: int
    segments: int


@dataclass(frozen=True, slots=True)
class OomReport(Presented):
    """The post-mortem of one out-of-memory error. Bytes are ints; ``None`` is unknown."""

    json_properties: ClassVar[tuple[str, ...]] = ("cache",)

    created_at: float
    #: Where it was made: ``"span 'train_step'"``, ``"sys.excepthook"``, ...
    source: str
    exception_type: str
    message: str
    device: int | None
    requested: int | None
    total: int | None
    free: int | None
    allocated: int | None
    reserved: int | None
    #: Free bytes inside segments that still hold live blocks (``empty_cache`` cannot return).
    inactive_split: int | None
    largest_free_block: int | None
    #: ``1 - largest free block / free cache``: 0 is one contiguous block.
    fragmentation: float | None
    #: Memory of this process outside PyTorch's allocator (context, cuBLAS, NCCL), per message.
    non_pytorch: int | None
    #: Memory of other processes on the device, per message (``total - free - this process``).
    other_processes: int | None
    stranded: tuple[StrandedCache, ...]
    #: The largest live storages on the device, with holders (``allocated_at`` with history).
    storages: tuple[LiveStorage, ...]
    advice: tuple[str, ...]
    notes: tuple[str, ...] = ()
    #: The file the report was written to, if any.
    file: str | None = None
    #: Those storages grouped by the container that holds them (``cudamem.holders.culprits``).
    culprits: tuple[Culprit, ...] = ()

    @property
    def cache(self) -> int | None:
        """Reserved but unallocated bytes after the failure."""
        if self.reserved is None or self.allocated is None:
            return None
        return self.reserved - self.allocated


def _exc_type_name(exc: BaseException) -> str:
    tp = type(exc)
    return f"{tp.__module__}.{tp.__qualname__}"


def _exc_message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<message unavailable>"


def _stranded(backend: _backend_base.Backend, device: int, segments: Any) -> list[StrandedCache]:
    """Streams whose cache holds no live tensor (the snapshot module's cache split)."""
    current = backend.current_stream_handle(device)
    split = split_cache(segments, current_streams=(0,) if current is None else (0, current))
    return [
        StrandedCache(s.stream, s.reserved, s.segments)
        for s in split.streams
        if s.stranded and s.reserved > 0
    ]


def _frame_text(frames: Sequence[Frame]) -> str | None:
    """The first frame outside torch and cudamem, as ``file:line in function``."""
    for fr in frames:
        if not fr.filename or is_library_file(fr.filename):
            continue
        if fr.filename.startswith("<") and fr.filename != "<stdin>":
            continue
        return f"{fr.filename}:{fr.line or '?'} in {fr.name or '?'}"
    return None


def _allocation_sites(backend: _backend_base.Backend, device: int) -> dict[int, str]:
    """Block address → where it was allocated, from the history snapshot (opt-in)."""
    snap = backend.history_snapshot()
    if not snap:
        return {}
    sites: dict[int, str] = {}
    for block in allocated_blocks(segments_of(snap, device)):
        text = _frame_text(block.frames)
        if text is not None:
            sites[block.address] = text
    return sites


def last_event(device: int | None = None) -> OomEvent | None:
    """The last OOM the allocator's observer recorded (on ``device``), however old; ``None``
    when none was (the observer records while ``on_oom()`` is installed)."""
    for ev in reversed(_events):
        if device is None or ev.device == device:
            return ev
    return None


def _latest_event(device: int | None) -> OomEvent | None:
    now = time.time()
    for ev in reversed(_events):
        if now - ev.time <= EVENT_MAX_AGE and (device is None or ev.device == device):
            return ev
    return None


def _advice(
    *,
    requested: int | None,
    total: int | None,
    free: int | None,
    cache: int | None,
    largest_free: int | None,
    stranded: Sequence[StrandedCache],
    culprits: Sequence[Culprit],
    others: int | None,
    non_pytorch: int | None,
    reserved: int | None = None,
    expandable: bool = False,
) -> list[str]:
    """Concrete next steps, most specific first."""
    out: list[str] = []
    if requested is not None and total is not None and requested > total:
        out.append(
            f"The request alone ({format_bytes(requested)}) is more than the GPU has "
            f"({format_bytes(total)}): "
            "no allocator setting or cleanup helps. Make that tensor smaller (batch size, "
            "sequence length, resolution), process it in chunks, or shard it across GPUs."
        )
        return out
    if (
        requested is not None
        and cache is not None
        and largest_free is not None
        and judge_oom(
            requested,
            largest_free=largest_free,
            cache_free=cache,
            device_free=headroom(free, total, reserved) if reserved is not None else free,
        )
        == FRAGMENTATION
    ):
        head = (
            f"Fragmentation: the cache holds {format_bytes(cache)} free but its largest free "
            f"block is {format_bytes(largest_free)}. "
        )
        out.append(
            head
            + (
                "Expandable segments are on already: the free bytes sit beside live blocks "
                "(partial pages) or on other streams; free those blocks or use one stream."
                if expandable
                else "Start the process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
            )
        )
    if stranded:
        amount = sum(s.reserved for s in stranded)
        out.append(
            f"{format_bytes(amount)} is cached on {plural(len(stranded), 'stream')} "
            "with no live tensor: "
            "reuse one torch.cuda.Stream instead of creating one per run, or call "
            "torch.cuda.empty_cache() when a run ends."
        )
    named = [c for c in culprits if c.holder != NO_HOLDER]
    graph = [c for c in named if c.autograd_bytes * 2 >= c.nbytes]
    if graph:
        out.append(
            f"{graph[0].holder} keeps autograd graphs alive "
            f"({format_bytes(graph[0].autograd_bytes)} among "
            "the largest storages): store loss.item() or use cudamem.ScalarLogger instead of "
            "the tensor, and run evaluation under torch.no_grad()."
        )
    held = [c for c in named if c not in graph]
    if held:
        top = held[0]
        what = (
            f"{plural(top.items, 'item')} of {top.holder} hold {format_bytes(top.nbytes)}"
            if top.items > 1
            else f"{top.holder} holds {format_bytes(top.nbytes)}"
        )
        out.append(
            f"Among the largest live storages, {what}: del it (and every other holder) or "
            "move it to the CPU (cudamem.to_host) if it is needed only later."
        )
    if others is not None and others >= 1024**3:
        out.append(
            f"Other processes use about {format_bytes(others)} of this GPU: see nvidia-smi or "
            "cudamem.explain()."
        )
    if non_pytorch is not None and non_pytorch >= 2 * 1024**3:
        out.append(
            f"{format_bytes(non_pytorch)} of this process is outside PyTorch's allocator (CUDA "
            "context, cuBLAS/cuDNN workspaces, NCCL buffers): cudamem.explain() splits it."
        )
    if requested is not None:
        out.append(
            "If the memory is the step's own working set: lower the batch size, use "
            "torch.autocast (bf16/fp16), activation checkpointing (torch.utils.checkpoint), "
            "and optimizer.zero_grad(set_to_none=True)."
        )
    return out


def build_report(
    exception_type: str,
    message: str,
    *,
    source: str,
    top: int = 10,
    holders: bool = True,
) -> OomReport:
    """Assemble the post-mortem of one OOM (never raises: failures become notes)."""
    notes: list[str] = []
    backend = _backend.get()
    parsed = parse_oom_message(message)
    device = parsed.device
    event = _latest_event(device)
    if device is None and event is not None:
        device = event.device
    if device is None:
        device = backend.current_device()
        notes.append(f"the message names no device; reporting cuda:{device}")
    requested = parsed.requested
    if requested is None and event is not None:
        requested = event.requested
    total = parsed.allowed or parsed.total or (event.total if event else None)
    free = parsed.free if parsed.free is not None else (event.free if event else None)

    allocated = reserved = inactive = None
    try:
        if backend.has_context(device):
            stats = backend.read(device)
            allocated, reserved, inactive = stats.allocated, stats.reserved, stats.inactive_split
    except Exception as exc:
        notes.append(f"allocator counters unavailable: {exc!r}")
    elsewhere = False
    if parsed.allocated is not None:
        # The message is the allocator at the failure: its figures first, the live
        # counters only where it says nothing (and only while they still describe it).
        said = (
            None
            if parsed.reserved_unallocated is None
            else parsed.allocated + parsed.reserved_unallocated
        )
        if said is not None and reserved is not None:
            elsewhere = abs(reserved - said) > max(SAME_CACHE, SAME_CACHE_SHARE * said)
            if elsewhere:
                notes.append(
                    f"the allocator now holds {format_bytes(reserved)}, not the "
                    f"{format_bytes(said)} the message states: the figures are the "
                    "message's (another process, or memory freed since), and the cache's "
                    "free blocks are not read"
                )
        if said is None and reserved is not None:
            if reserved < parsed.allocated:
                reserved = None  # less than the message allocated: not the allocator that failed
            else:
                notes.append(
                    "the message states no reserved bytes: the reserved figure is the "
                    "allocator's now"
                )
        else:
            reserved = said
        allocated = parsed.allocated
        if elsewhere or said is None:
            inactive = None

    largest = fragmentation = None
    expandable = False
    stranded: list[StrandedCache] = []
    try:
        segments = None if elsewhere else backend.memory_segments(device)
        if segments is not None:
            expandable = any(s.get("is_expandable") is True for s in segments)
            largest, free_cache = largest_free(segments)
            fragmentation = 1.0 - largest / free_cache if free_cache else 0.0
            stranded = _stranded(backend, device, segments)
    except Exception as exc:
        notes.append(f"segment analysis failed: {exc!r}")

    storages: list[LiveStorage] = []
    culprits: list[Culprit] = []
    try:
        sites = _allocation_sites(backend, device)
        device_type = backend.storage_device_type()
        # Holders only for the storages listed: the search is the expensive part.
        listed = [
            s.ref
            for s in census.live_storages(device_type)
            if s.ref is not None and (device_type != "cuda" or s.device == f"cuda:{device}")
        ][:top]
        found = census.live_storages(device_type, holders=holders, among=listed)
        for s in sorted(found, key=census.listing_order):
            # An address is the right key here: the blocks of this very instant.
            storages.append(replace(s, allocated_at=sites.get(s.data_ptr)))
        culprits = group_culprits(storages) if holders else []
    except Exception as exc:
        notes.append(f"listing live storages failed: {type(exc).__name__}: {exc}")

    non_pytorch = others = None
    if parsed.process_in_use is not None:
        # ``reserved`` is the message's where it states it, else the live allocator's
        pt_reserved = (
            reserved
            if reserved is not None
            else (parsed.allocated or 0) + (parsed.reserved_unallocated or 0)
        )
        non_pytorch = max(parsed.process_in_use - pt_reserved, 0)
        if parsed.total is not None and parsed.free is not None:
            others = max(parsed.total - parsed.free - parsed.process_in_use, 0)
    cache = None if reserved is None or allocated is None else reserved - allocated
    advice = _advice(
        requested=requested,
        total=total,
        free=free,
        cache=cache,
        largest_free=largest,
        stranded=stranded,
        culprits=culprits,
        others=others,
        non_pytorch=non_pytorch,
        reserved=reserved,
        expandable=expandable,
    )
    return OomReport(
        created_at=time.time(),
        source=source,
        exception_type=exception_type,
        message=message,
        device=device,
        requested=requested,
        total=total,
        free=free,
        allocated=allocated,
        reserved=reserved,
        inactive_split=inactive,
        largest_free_block=largest,
        fragmentation=fragmentation,
        non_pytorch=non_pytorch,
        other_processes=others,
        stranded=tuple(stranded),
        storages=tuple(storages),
        advice=tuple(advice),
        notes=tuple(notes),
        culprits=tuple(culprits),
    )


def oom_report(exc: BaseException, *, top: int = 10, holders: bool = True) -> OomReport:
    """The post-mortem of ``exc`` as a result object, printed nowhere.

    For code that catches its own OOMs (``except torch.OutOfMemoryError as e:``)::

        report = cudamem.oom_report(e)
        print(report)
    """
    if not _backend.get().is_oom(exc):
        raise ValueError(f"not an out-of-memory error: {_exc_type_name(exc)}")
    return build_report(
        _exc_type_name(exc), _exc_message(exc), source="oom_report()", top=top, holders=holders
    )


_events: deque[OomEvent] = deque(maxlen=MAX_EVENTS)
