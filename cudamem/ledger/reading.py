"""Reading a device's ledger: ``explain()`` gathers the inputs (the allocator's counters and
snapshot, NVML, the process's notes) and builds a ``DeviceLedger`` per device;
``fragmentation()`` reads the cache's free space, with an out-of-memory verdict when given
the error.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass

from ..allocator import backend as _backend
from ..allocator.cache_split import CacheSplit, split_cache, workspace_streams
from ..allocator.device_arg import DeviceLike, resolve_device
from ..allocator.snapshot import has_private_pools, segment_pool_id
from ..allocator.stats import AllocatorStats, device_name
from ..base.args import check_bool
from ..base.format import plural
from ..holders.unaccounted import ledger_view
from ..host import ledger as host_ledger
from ..host.ledger import HostLedger
from . import nvml as _nvml
from .device import AllocatedSplit, DeviceLedger, Explanation
from .free_space import Fragmentation, OomFacts, analyze
from .lines import build_ledger, expandable_segments_configured
from .oom import last_event, parse_oom_message
from .oom_guard import own_ooms

__all__ = ["explain", "fragmentation"]


@dataclass(frozen=True, slots=True)
class _Inputs:
    cache: CacheSplit | None
    allocated: AllocatedSplit | None
    fragmentation: Fragmentation | None = None


def _own(stats: AllocatorStats) -> AllocatorStats:
    """``stats`` with the OOMs cudamem caught itself (a plan's steps) left out."""
    return stats._replace(ooms=own_ooms(stats.device, stats.ooms))


def _ledger_inputs(device: int, stats: AllocatorStats) -> _Inputs:
    """The cache split and the census split, from one snapshot read and one heap scan.

    Held private pools (CUDA graphs) get their own lines, so the census splits only the
    allocated bytes outside them. Anything that fails leaves that part ``None``.
    """
    be = _backend.get()
    try:
        segments = be.memory_segments(device)
    except Exception:
        segments = None
    owners = None
    if segments is not None and has_private_pools(segments):
        try:
            owners = be.private_pool_owners()
        except Exception:
            owners = None
    current = be.current_stream_handle(device)
    streams = (0,) if current is None else (0, current)
    cache: CacheSplit | None = None
    frag: Fragmentation | None = None
    if segments is not None:
        # First without addresses: which segments the census must leave out.
        cache = split_cache(segments, current_streams=streams, pool_owners=owners)
        frag = analyze(
            device,
            segments,
            stats=stats,
            owners=owners,
            current_streams=streams,
            oom=_last_oom(device, None, []),
            expandable_configured=expandable_segments_configured(),
        )
    held = {p.pool_id for p in cache.held_pools} if cache is not None else set()
    outside = None if segments is None else [s for s in segments if segment_pool_id(s) not in held]
    total = stats.allocated - (cache.pools_allocated if cache is not None else 0)
    try:
        u, addresses = ledger_view(device, segments=outside, allocated=total)
    except Exception:
        return _Inputs(cache, None, frag)
    if segments is not None:
        cache = split_cache(
            segments, current_streams=streams, tensor_addresses=addresses, pool_owners=owners
        )
    if int(u.allocated) != total:
        return _Inputs(cache, None, frag)
    ws_streams = 0
    if u.cublas_workspaces and outside is not None:
        sizes = be.cublas_workspace_sizes(device)
        ws_streams = len(workspace_streams(outside, sizes, addresses))
    split = AllocatedSplit(
        live_tensors=int(u.python),
        autograd_saved=int(u.autograd),
        cublas_workspaces=int(u.cublas_workspaces),
        unaccounted=int(u.unknown),
        workspace_count=int(u.workspace_count),
        workspace_streams=ws_streams,
    )
    return _Inputs(cache, split, frag)


def _other_in_process(device: int) -> list[tuple[str, int]]:
    """Non-PyTorch GPU memory of this process that can be measured without side effects."""
    out: list[tuple[str, int]] = []
    cupy = sys.modules.get("cupy")  # only if the user imported it; never import it here
    if cupy is not None:
        try:
            if int(cupy.cuda.runtime.getDevice()) == device:
                out.append(("CuPy memory pool", int(cupy.get_default_memory_pool().total_bytes())))
        except Exception:
            pass
    return out


def _process_notes() -> list[str]:
    notes = []
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        notes.append(
            "CUDA_MODULE_LOADING=EAGER: every kernel is loaded up front, so the context line "
            "is larger than with lazy loading"
        )
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            notes.append(
                f"torch.distributed is initialised (backend {dist.get_backend()}): NCCL "
                "buffers (each communicator's) are outside the allocator and show in "
                "the context line"
            )
    except Exception:
        pass
    return notes


def _ledger_for(device: int, status: _nvml.NvmlStatus) -> DeviceLedger:
    be = _backend.get()
    has_context = be.has_context(device)
    stats = _own(be.read(device))
    inputs = _ledger_inputs(device, stats) if has_context else _Inputs(None, None)
    reading: _nvml.NvmlDevice | None = None
    reason = status.reason
    if status.available:
        got = _nvml.query_device(device, be.device_uuid(device))
        if isinstance(got, _nvml.NvmlDevice):
            reading = got
        else:
            reason = got.reason
    ledger = build_ledger(
        device,
        stats=stats,
        nvml=reading,
        pid=os.getpid(),
        has_context=has_context,
        cache=inputs.cache,
        allocated=inputs.allocated,
        other_in_process=_other_in_process(device) if has_context else (),
        nvml_reason=reason,
        expandable_segments=expandable_segments_configured(),
        fragmentation=inputs.fragmentation,
    )
    if not has_context:
        extra = (
            f"this process has no CUDA context on {device_name(device)}: it uses nothing "
            "there (cudamem did not create one)",
        )
        ledger = dataclasses.replace(ledger, notes=ledger.notes + extra)
    return ledger


def explain(device: DeviceLike | None = None, *, host: bool = True) -> Explanation:
    """Reconcile nvidia-smi with PyTorch for each device this process uses (or ``device``).

    Args:
        device: one CUDA device to explain; by default every device this process has a
            CUDA context on.
        host: add the host section (``Explanation.host``: this process's RSS/PSS/USS, the
            pinned pool, CPU tensors with their largest holders, DataLoader workers).

    Returns:
        An ``Explanation``; ``print()`` it for a table, ``render.json.to_json()`` it for
        JSON. Each ledger's lines add up to NVML's ``used`` and say what frees them.

    Creates no CUDA context, synchronizes nothing and never turns allocator history
    recording on; with no driver or no GPU it explains that in one line instead of raising.
    """
    check_bool("host", host)
    be = _backend.get()
    notes: list[str] = []
    status = _nvml.status()
    if device is not None and be.device_count() == 0:
        # No GPU, no driver or a CPU build of torch: one clear line, not an exception.
        import torch

        if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
            resolve_device(device)  # the argument's TypeError, not a device-count message
        reason = "a CPU build of torch" if torch.version.cuda is None else "no GPU or no driver"
        notes.append(f"{device} cannot be explained: torch sees no CUDA device ({reason})")
        return Explanation(devices=(), nvml=status, notes=tuple(notes), host=_host(host))
    devices = be.initialized_devices() if device is None else (resolve_device(device),)
    if not devices:
        notes.append(_no_context_note(be.device_count(), status))
    if status.warning:
        notes.append(status.warning)
    ledgers = []
    for d in devices:
        try:
            ledgers.append(_ledger_for(d, status))
        except Exception as exc:  # bookkeeping never raises into the caller
            notes.append(
                f"{device_name(d)}: could not build the ledger: {type(exc).__name__}: {exc}"
            )
    notes.extend(_process_notes())
    return Explanation(devices=tuple(ledgers), nvml=status, notes=tuple(notes), host=_host(host))


def _no_context_note(count: int, status: _nvml.NvmlStatus) -> str:
    """Why ``explain()`` lists no device, and what would show one (only what is true here)."""
    if count == 0:
        import torch

        reason = "a CPU build of torch" if torch.version.cuda is None else "no GPU or no driver"
        return f"torch sees no CUDA device ({reason}): nothing of this process is on a GPU"
    head = "this process has no CUDA context on any device yet: nothing of it is on a GPU"
    if status.available:
        return f"{head} (explain(device=0) shows what NVML sees on cuda:0)"
    return f"{head} (explain(device=0) shows cuda:0 as torch sees it; NVML is unavailable)"


def _host(wanted: bool) -> HostLedger | None:
    return host_ledger.measure_host() if wanted else None


def _last_oom(device: int, exc: BaseException | None, notes: list[str]) -> OomFacts | None:
    """The OOM to judge: ``exc``'s message (the observer's exact figures where they match
    it), else the last one the observer recorded on ``device``."""
    event = last_event(device)
    ago = None if event is None else max(time.time() - event.time, 0.0)
    observed = (
        None
        if event is None
        else OomFacts(
            device,
            event.requested,
            event.total,
            event.free,
            "the allocator's OOM observer",
            ago,
        )
    )
    if exc is None:
        return observed
    parsed = parse_oom_message(str(exc))
    if parsed.device is not None and parsed.device != device:
        notes.append(f"the OOM happened on {device_name(parsed.device)}, not on this device")
        return None
    if parsed.requested is None:
        if observed is None:
            notes.append("the OOM's message states no request size and the observer saw none")
        return observed
    # The message rounds to two decimals of its unit: within 0.5 % it is the same request.
    if observed is not None and abs(observed.requested - parsed.requested) <= max(
        parsed.requested // 200, 1024
    ):
        return observed
    return OomFacts(
        device,
        parsed.requested,
        parsed.allowed or parsed.total,
        parsed.free,
        "the exception's message",
    )


def fragmentation(
    device: DeviceLike | None = None, *, oom: BaseException | None = None
) -> Fragmentation:
    """How fragmented the allocator's cache is on ``device`` (the current device by default).

    Per pool (the default pool; CUDA graphs' private pools): reserved, allocated, the free
    bytes beside live blocks that ``empty_cache()`` cannot return (stranded), the free bytes
    of wholly free segments, the largest free block; peak reserved minus peak allocated;
    and the last out-of-memory error judged: would ``expandable_segments:True`` have
    avoided it?

    Args:
        device: a CUDA device (``0``, ``'cuda:1'``, ``torch.device``).
        oom: an out-of-memory error to judge (``except torch.OutOfMemoryError as e``);
            without it, the last one the allocator's observer recorded (``on_oom()``).

    Reads one allocator snapshot; creates no CUDA context, never turns history on.

    Raises:
        ValueError: ``oom`` is not an out-of-memory error.
    """
    be = _backend.get()
    if oom is not None and not be.is_oom(oom):
        raise ValueError(
            f"oom must be an out-of-memory error, not {type(oom).__module__}."
            f"{type(oom).__qualname__}"
        )
    index = be.current_device() if device is None else resolve_device(device)
    notes: list[str] = []
    if not be.has_context(index):
        notes.append(
            f"this process has no CUDA context on {device_name(index)}: nothing is reserved there"
        )
        return Fragmentation(index, (), False, notes=tuple(notes))
    stats = _own(be.read(index))
    segments = be.memory_segments(index)
    if segments is None:
        notes.append("no allocator snapshot: the pools cannot be split")
        segments = []
    owners = None
    if has_private_pools(segments):
        try:
            owners = be.private_pool_owners()
        except Exception:
            owners = None
    current = be.current_stream_handle(index)
    facts = _last_oom(index, oom, notes)
    if facts is None and stats.ooms and oom is None:
        notes.append(
            f"the allocator counted {plural(stats.ooms, 'out-of-memory error')} on "
            f"{device_name(index)} but none was recorded: cudamem.on_oom() records them, or "
            "pass oom= the exception"
        )
    return analyze(
        index,
        segments,
        stats=stats,
        owners=owners,
        current_streams=(0,) if current is None else (0, current),
        oom=facts,
        notes=notes,
        expandable_configured=expandable_segments_configured(),
    )
