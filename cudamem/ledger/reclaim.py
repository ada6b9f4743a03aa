"""``release()``: give this process's unused GPU memory back, and say what could not be freed.

``gc.collect()``, then (optionally) ``torch._C._cuda_clearCublasWorkspaces()``, then
``torch.cuda.empty_cache()``; it reports what was freed per device, what the cuBLAS clear gave
back, why the cache that is left stays (private pools of CUDA graphs, partial pages of
expandable segments, free blocks beside live ones) and names the holders of the largest
storages still allocated.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..allocator import backend as _backend
from ..allocator.cache_split import CacheSplit, PoolBlocks, pool_blocks_of, split_cache
from ..allocator.device_arg import DeviceLike, resolve_device
from ..allocator.snapshot import has_private_pools
from ..allocator.stats import AllocatorStats, device_name
from ..base.args import check_bool, check_int
from ..base.present import Presented
from ..holders import census
from ..holders.census import LiveStorage
from ..host.ledger import HostRelease, empty_pinned_cache
from . import nvml as _nvml

__all__ = [
    "DeviceRelease",
    "ReleaseResult",
    "largest_storages",
    "release",
]


@dataclass(frozen=True, slots=True)
class DeviceRelease:
    """What ``release`` gave back on one device, and what is still allocated.

    ``kept`` is the allocator's cache split after ``empty_cache()``: why what is still
    reserved but not allocated stayed (``None`` without a snapshot).
    """

    #: Its JSON layout's version (``cudamem.render.json``): 2 since ``remaining`` lists
    #: ``LiveStorage`` values.
    json_schema: ClassVar[int] = 2
    json_properties: ClassVar[tuple[str, ...]] = (
        "freed_reserved",
        "freed_allocated",
        "still_allocated",
        "still_cached",
        "nvml_freed",
    )

    device: int
    before: AllocatorStats
    after: AllocatorStats
    nvml_used_before: int | None
    nvml_used_after: int | None
    #: The largest storages still allocated, with their holders.
    remaining: tuple[LiveStorage, ...]
    #: Allocated bytes the cuBLAS workspace clear gave back (0 when not cleared).
    cublas_freed: int = 0
    kept: CacheSplit | None = None

    @property
    def freed_reserved(self) -> int:
        """Bytes the allocator returned to CUDA (what nvidia-smi sees drop)."""
        return self.before.reserved - self.after.reserved

    @property
    def freed_allocated(self) -> int:
        """Allocated bytes freed (by gc and the cuBLAS workspace clear)."""
        return self.before.allocated - self.after.allocated

    @property
    def still_allocated(self) -> int:
        """Bytes still held by live blocks after the release."""
        return self.after.allocated

    @property
    def still_cached(self) -> int:
        """Bytes still reserved but not allocated: what ``empty_cache()`` could not return."""
        return self.after.reserved - self.after.allocated

    @property
    def nvml_freed(self) -> int | None:
        """The drop in NVML's used figure, ``None`` without NVML."""
        if self.nvml_used_before is None or self.nvml_used_after is None:
            return None
        return self.nvml_used_before - self.nvml_used_after


@dataclass(frozen=True, slots=True)
class ReleaseResult(Presented):
    """The result of ``release``."""

    devices: tuple[DeviceRelease, ...]
    gc_collected: int
    cublas_cleared: bool
    notes: tuple[str, ...] = ()
    #: What emptying the pinned cache gave back (``release(host=True)``), else ``None``.
    host: HostRelease | None = None

    def __getitem__(self, device: int) -> DeviceRelease:
        for d in self.devices:
            if d.device == device:
                return d
        raise KeyError(f"no release record for {device_name(device)}")


def largest_storages(
    device: int | str,
    top: int = 5,
    *,
    holders: bool = True,
    pools: PoolBlocks | None = None,
) -> tuple[LiveStorage, ...]:
    """The ``top`` largest storages alive on ``device``, with their holders.

    Args:
        device: a CUDA index or ``'cpu'``.
        top: how many storages.
        holders: search who holds each (one search for all of them).
        pools: private-pool blocks of the device; a storage inside one that graphs still
            use says so (``LiveStorage.pool``).

    One census with one holder search for every storage. Keeps no reference.
    """
    found = census.live_tensors(device, holders=holders)
    out = []
    for s in list(found.storages)[:top]:
        block = None if pools is None else pools.pool_of(s.data_ptr)
        pool = None if pools is None or block is None else pools.pool(block.pool_id)
        if pool is not None and pool.held:
            s = replace(s, pool=f"private pool {pool.pool_id} of {pool.description}")
        out.append(s)
    return tuple(out)


def __getattr__(name: str) -> Any:
    """``RemainingStorage``, the old name of what ``DeviceRelease.remaining`` lists: it is
    ``cudamem.holders.census.LiveStorage`` now (``describe()`` for the description, ``paths``
    for the holder paths)."""
    if name == "RemainingStorage":
        import warnings

        warnings.warn(
            "cudamem.ledger.reclaim.RemainingStorage is cudamem.holders.census.LiveStorage now",
            DeprecationWarning,
            stacklevel=2,
        )
        return LiveStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _nvml_used(device: int) -> int | None:
    got = _nvml.query_device(device, _backend.get().device_uuid(device))
    if isinstance(got, _nvml.NvmlDevice) and got.memory is not None:
        return got.memory.used
    return None


def _kept(device: int) -> tuple[CacheSplit | None, PoolBlocks | None]:
    """The cache split after ``empty_cache()`` and the private-pool blocks, from one
    snapshot; ``(None, None)`` without one."""
    be = _backend.get()
    segments = be.memory_segments(device)
    if segments is None:
        return None, None
    owners = be.private_pool_owners() if has_private_pools(segments) else None
    current = be.current_stream_handle(device)
    split = split_cache(
        segments,
        current_streams=(0,) if current is None else (0, current),
        pool_owners=owners,
    )
    pools = pool_blocks_of(device, segments, owners) if split.pools else None
    return split, pools


def _validate(top: Any, clear_cublas: Any, holders: Any) -> None:
    check_int("top", top, minimum=0)
    check_bool("clear_cublas", clear_cublas)
    check_bool("holders", holders)


def release(
    device: DeviceLike | None = None,
    *,
    clear_cublas: bool = True,
    top: int = 5,
    holders: bool = True,
    host: bool = False,
) -> ReleaseResult:
    """Give this process's unused GPU memory back, and say what could not be freed and why.

    Runs ``gc.collect()``, then (``clear_cublas=True``) frees cuBLAS workspaces, which
    ``empty_cache()`` never does (they come back at the next matmul), then
    ``torch.cuda.empty_cache()``, which empties *every* device's cache. The CUDA context
    stays until the process exits: nothing frees it.

    Args:
        device: report this device only (``empty_cache()`` still empties every device).
        clear_cublas: free the cuBLAS/cuBLASLt workspaces (one per handle and stream).
        top: how many of the largest remaining storages to name.
        holders: search who holds those storages (``False`` skips the search).
        host: also empty the pinned-memory (host) cache and say what that freed
            (``ReleaseResult.host``).

    Returns:
        A ``ReleaseResult``: per device the bytes freed, what the cuBLAS clear gave
        back, why the remaining cache stayed (CUDA graph pools, partial pages of expandable
        segments, free blocks beside live ones), and the largest remaining storages with the
        paths that hold them.

    Call it between runs, not inside a training step: it synchronizes and empties the cache.
    """
    _validate(top, clear_cublas, holders)
    check_bool("host", host)
    be = _backend.get()
    devices = be.initialized_devices() if device is None else (resolve_device(device),)
    notes: list[str] = []
    status = _nvml.status()
    before = {d: be.read(d) for d in devices}
    nvml_before = {d: _nvml_used(d) if status.available else None for d in devices}
    collected = gc.collect()
    cleared = False
    after_gc = {d: be.read(d) for d in devices}
    if clear_cublas:
        try:
            cleared = be.clear_cublas_workspaces()
        except Exception as exc:
            notes.append(f"clearing cuBLAS workspaces failed: {exc}")
    after_clear = {d: be.read(d) for d in devices}
    be.empty_cache()
    records = []
    for d in devices:
        after = be.read(d)
        kept: CacheSplit | None = None
        pools: PoolBlocks | None = None
        try:
            kept, pools = _kept(d)
        except Exception as exc:
            notes.append(f"{device_name(d)}: cache not analysed: {type(exc).__name__}: {exc}")
        remaining: tuple[LiveStorage, ...] = ()
        if after.allocated and top:
            try:
                remaining = largest_storages(d, top, holders=holders, pools=pools)
            except Exception as exc:  # the census failed: report the bytes without holders
                notes.append(f"{device_name(d)}: holders not found: {type(exc).__name__}: {exc}")
        records.append(
            DeviceRelease(
                device=d,
                before=before[d],
                after=after,
                nvml_used_before=nvml_before[d],
                nvml_used_after=_nvml_used(d) if status.available else None,
                remaining=remaining,
                cublas_freed=max(0, after_gc[d].allocated - after_clear[d].allocated)
                if cleared
                else 0,
                kept=kept,
            )
        )
    if not devices:
        notes.append("this process has no CUDA context: nothing to release")
    if not status.available:
        notes.append(f"NVML: {status.reason}")
    if any(r.after.allocated for r in records):
        notes.append(
            "still allocated memory is held by live references: drop them (the holders "
            "above), then call release() again"
        )
    return ReleaseResult(
        devices=tuple(records),
        gc_collected=collected,
        cublas_cleared=cleared,
        notes=tuple(notes),
        host=empty_pinned_cache() if host else None,
    )
