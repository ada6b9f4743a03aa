"""What every allocator backend answers: the ``Backend`` interface (counters, stats, snapshots,
pools, hooks), the raw-counter reading it shares (``stats_from_raw``), ``PoolOwners`` and
the test for an out-of-memory exception.

Tests implement it with a fake allocator; ``torch_backend.TorchBackend`` is the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..native import fastread as _fastread
from .stats import AllocatorStats

__all__ = ["Backend", "PoolOwners"]


#: (allocated, reserved, peak_allocated) bytes of one device's "all" pool.
Counters = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class PoolOwners:
    """Who still uses the allocator's private pools (ids as in a snapshot's
    ``segment_pool_id``). The allocator itself tells neither owners nor use counts."""

    #: Live ``torch.cuda.CUDAGraph`` objects per pool.
    graphs: Mapping[tuple[int, int], int] = field(default_factory=dict)
    #: Pools of live ``torch.cuda.MemPool`` objects.
    mempools: frozenset[tuple[int, int]] = frozenset()
    #: Pools of torch.compile's cudagraph tree managers, and the device of each.
    trees: Mapping[tuple[int, int], int] = field(default_factory=dict)
    #: Whether torch.compile's cudagraph trees were imported (else no pool can be theirs).
    trees_loaded: bool = False


def _raw_get(raw: dict[str, Any], key: str, metric: str = "current") -> int:
    """Read ``raw[key]['all'][metric]`` from the nested stats dict, 0 when absent."""
    entry = raw.get(key)
    if not isinstance(entry, dict):
        return 0
    pool = entry.get("all")
    if not isinstance(pool, dict):
        return 0
    value = pool.get(metric, 0)
    return int(value) if isinstance(value, int) else 0


def stats_from_raw(device: int, raw: dict[str, Any], timestamp_ns: int) -> AllocatorStats:
    """Build ``AllocatorStats`` from the nested dict of ``_cuda_memoryStats``.

    Direct indexing first (~1.5 µs; spans call this twice per device per block), then a
    tolerant slow path for allocator backends that leave keys out (cudaMallocAsync).
    """
    try:
        a = raw["allocated_bytes"]["all"]
        r = raw["reserved_bytes"]["all"]
        n = raw["allocation"]["all"]
        return AllocatorStats(
            device,
            a["current"],
            r["current"],
            raw["active_bytes"]["all"]["current"],
            raw["requested_bytes"]["all"]["current"],
            a["peak"],
            r["peak"],
            raw["inactive_split_bytes"]["all"]["current"],
            n["allocated"],
            n["freed"],
            raw["segment"]["all"]["current"],
            raw["num_alloc_retries"],
            raw["num_ooms"],
            timestamp_ns,
        )
    except (KeyError, TypeError):
        pass
    retries = raw.get("num_alloc_retries", 0)
    ooms = raw.get("num_ooms", 0)
    return AllocatorStats(
        device=device,
        allocated=_raw_get(raw, "allocated_bytes"),
        reserved=_raw_get(raw, "reserved_bytes"),
        active=_raw_get(raw, "active_bytes"),
        requested=_raw_get(raw, "requested_bytes"),
        peak_allocated=_raw_get(raw, "allocated_bytes", "peak"),
        peak_reserved=_raw_get(raw, "reserved_bytes", "peak"),
        inactive_split=_raw_get(raw, "inactive_split_bytes"),
        alloc_count=_raw_get(raw, "allocation", "allocated"),
        free_count=_raw_get(raw, "allocation", "freed"),
        segments=_raw_get(raw, "segment"),
        alloc_retries=int(retries) if isinstance(retries, int) else 0,
        ooms=int(ooms) if isinstance(ooms, int) else 0,
        timestamp_ns=timestamp_ns,
    )


class Backend:
    """What cudamem needs from the allocator. ``TorchBackend`` is the real one."""

    #: What ``initialized_devices()`` returns from now on, once that can no longer change
    #: (every device has a context), else ``None``. Spans read it instead of asking.
    settled_devices: tuple[int, ...] | None = None
    #: C-level reads of ``counters`` and ``counters_reset_peak`` for a device of
    #: ``initialized_devices()``, once the backend has them (``TorchBackend``: the validated
    #: C++ reader), else ``None``. The spans' hot path calls them directly (no Python frame)
    #: and falls back to the methods when they raise.
    fast_counters: Callable[[int], Counters] | None = None
    fast_reset: Callable[[int], Counters] | None = None
    #: The C++ reader's backward gates (``cudamem.modules``), once it serves, else ``None``.
    gates: _fastread.GateLog | None = None

    def device_count(self) -> int:
        """Number of CUDA devices visible to torch (0 without CUDA)."""
        raise NotImplementedError

    def initialized_devices(self) -> tuple[int, ...]:
        """Indices of devices that already have a CUDA primary context."""
        raise NotImplementedError

    def has_context(self, device: int) -> bool:
        """Whether ``device`` already has a primary context."""
        raise NotImplementedError

    def current_device(self) -> int:
        """The current device if CUDA is initialised, else 0 (never initialises CUDA)."""
        return 0

    def read(self, device: int) -> AllocatorStats:
        """The allocator's counters for ``device`` (zeros when CUDA is not initialised)."""
        raise NotImplementedError

    def synchronize(self, device: int) -> None:
        """Wait for all streams of ``device``."""
        raise NotImplementedError

    def reset_peak(self, device: int) -> None:
        """Reset the process-wide peak counters of ``device``."""
        raise NotImplementedError

    def counters(self, device: int) -> Counters:
        """``(allocated, reserved, peak_allocated)`` of ``device`` as ``read`` gives
        them (zeros when CUDA is not initialised): the spans' hot path."""
        stats = self.read(device)
        return (stats.allocated, stats.reserved, stats.peak_allocated)

    def counters_reset_peak(self, device: int) -> Counters:
        """``counters``, then ``reset_peak``; returns the values read before the
        reset."""
        values = self.counters(device)
        self.reset_peak(device)
        return values

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a CUDA out-of-memory error."""
        return _is_oom_exception(exc)

    def empty_cache(self) -> None:
        """Return every device's unused cached blocks to CUDA (``torch.cuda.empty_cache``)."""

    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        """``(free, total)`` bytes of ``device`` as CUDA sees them, ``None`` when unknown
        (no context on it: asking would create one)."""
        return None

    # -- scalars --
    def record_event(self, device: int, event: Any = None) -> Any:
        """Record an event on ``device``'s current stream (reusing ``event`` when given) and
        return it; the host can later ask whether the work queued before it has finished."""
        raise NotImplementedError

    def event_done(self, event: Any) -> bool:
        """Whether the work queued before ``event`` has finished (never blocks)."""
        raise NotImplementedError

    def wait_event(self, event: Any) -> None:
        """Block the host until the work queued before ``event`` has finished. Unlike
        ``synchronize`` this waits for that point only, not for everything queued since."""
        raise NotImplementedError

    # -- device ledger --
    def device_uuid(self, device: int) -> str | None:
        """torch's UUID of ``device`` (no ``GPU-`` prefix), ``None`` before CUDA is initialised
        (reading device properties would initialise it)."""
        return None

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        """``torch.cuda.memory_snapshot()`` segments of ``device`` without traces, ``None``
        when unavailable. Never turns history recording on."""
        return None

    def current_stream_handle(self, device: int) -> int | None:
        """The ``cudaStream_t`` of this thread's current stream on ``device`` (0 = default)."""
        return 0

    def clear_cublas_workspaces(self) -> bool:
        """Free cuBLAS/cuBLASLt workspaces (``empty_cache`` never does); whether it ran."""
        return False

    def is_recording_history(self) -> bool:
        """Whether allocator history recording (``_record_memory_history``) is on."""
        return False

    # -- census --
    def cublas_workspace_sizes(self, device: int) -> tuple[int, ...]:
        """Bytes PyTorch requests for one cuBLAS / cuBLASLt workspace on ``device`` (``()``
        when unknown). Workspaces are held by no tensor; the census recognises them by size."""
        return ()

    # -- leaks and OOM --
    def storage_device_type(self) -> str:
        """The torch device type whose storages this backend's counters measure."""
        return "cuda"

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        """Have the allocator call ``observer(device, requested, total, free)`` inside
        ``malloc`` on out-of-memory (now, or when CUDA initialises); whether it could."""
        return False

    def set_history(
        self, enabled: bool, max_entries: int, still_wanted: Callable[[], bool] | None
    ) -> bool:
        """Turn allocation-history recording on (bounded ring of ``max_entries``, Python
        stacks at allocation) or off; before CUDA initialises, the request waits for it and
        runs only if ``still_wanted()``. Whether recording was (or will be) changed."""
        return False

    def history_snapshot(self) -> dict[str, Any] | None:
        """``torch.cuda.memory._snapshot()`` with the recorded stacks, ``None`` when none."""
        return None

    # -- private pools (CUDA graphs) --
    def host_pool_stats(self) -> dict[str, Any] | None:
        """The pinned-memory (caching host) allocator's counters, ``host_memory_stats()``'s
        flat dict; ``None`` without CUDA, before CUDA is initialised, or on a torch without
        them."""
        return None

    def pinned_sizes(self) -> tuple[int, ...] | None:
        """Bytes of each live pinned CPU storage (each once), ``None`` when unknown (no
        CUDA context yet: asking would create one)."""
        return None

    def empty_host_cache(self) -> str | None:
        """Give the pinned pool's cached blocks back to CUDA; returns the call that did it
        (``host_cache_call()``), ``None`` when there is none or nothing was pinned."""
        return None

    def private_pool_owners(self) -> PoolOwners | None:
        """The live CUDA graphs, MemPools and cudagraph-tree managers per private pool,
        ``None`` when they cannot be searched. Costs one ``gc.get_referrers`` heap scan."""
        return None


def _is_oom_exception(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    if isinstance(oom_type, type) and isinstance(exc, oom_type):
        return True
    # Older releases raised a plain RuntimeError with this text.
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)
