"""The host half of a GPU job: this process's RSS/PSS/USS, the pinned pool, CPU tensors and
the DataLoader workers (``explain().host``, ``cudamem status``, ``release(host=True)``).

The pinned pool is PyTorch's caching host allocator: every block is rounded up to a power of
two before ``cudaHostAlloc`` (600 MiB pinned takes 1 GiB), and freed blocks stay cached, in the
process's RSS, until ``torch.accelerator.empty_host_cache()`` (``torch._C._host_emptyCache()``
on older releases). ``host_memory_stats()`` counts blocks the allocator owns
(``allocated_bytes``: in use + cached) and blocks handed out (``active_bytes``); only their
``current`` values are read (the historical ``freed`` counters can go negative), and in use is
the live pinned storages' blocks where they can be listed: on torch 2.11 ``active_bytes``
keeps blocks freed and emptied.

``build_pinned`` is the arithmetic, fed by recorded figures in tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..allocator import backend as _backend
from ..allocator import torch_backend as _torch_backend
from ..base.format import plural
from ..base.present import Presented
from ..holders import census
from ..holders.census import LiveStorage
from . import procfs as _procfs
from . import workers
from .procfs import ProcessMemory
from .workers import LoaderReport

__all__ = [
    "CpuTensors",
    "HostLedger",
    "HostRelease",
    "HostRun",
    "PinnedPool",
    "ProcessTree",
    "build_pinned",
    "empty_pinned_cache",
    "host_run",
    "measure_host",
    "process_tree",
    "round_pinned",
]


def round_pinned(nbytes: int) -> int:
    """The block the caching host allocator takes for a request: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass(frozen=True, slots=True)
class PinnedPool(Presented):
    """The pinned-memory pool: bytes handed out against bytes cached, and what rounding cost."""

    json_properties: ClassVar[tuple[str, ...]] = ("owned",)

    #: Bytes of blocks handed out: the live pinned storages' power-of-two blocks (torch's
    #: ``active_bytes.current`` only where they cannot be listed).
    in_use: int
    #: Bytes of free blocks the pool keeps (``allocated_bytes.current`` − in use).
    cached: int
    #: Blocks owned (``allocations.current``).
    blocks: int
    #: Bytes the live pinned CPU storages asked for (``None``: not known).
    requested: int | None
    #: What power-of-two rounding added to them.
    rounding: int | None
    #: The call that empties the cache on this torch (``None``: none exists).
    free_call: str | None
    notes: tuple[str, ...] = ()

    @property
    def owned(self) -> int:
        """Every byte of the pool (in use + cached): what it adds to RSS."""
        return self.in_use + self.cached


@dataclass(frozen=True, slots=True)
class CpuTensors:
    """CPU tensors' storages from the census: their bytes and the largest holders."""

    nbytes: int
    count: int
    largest: tuple[LiveStorage, ...]


@dataclass(frozen=True, slots=True)
class HostLedger(Presented):
    """Host memory of this process and its DataLoader workers."""

    json_properties: ClassVar[tuple[str, ...]] = ("workers_uss", "workers_pss")

    process: ProcessMemory
    #: ``None`` with ``pinned_reason`` when the pool cannot be read.
    pinned: PinnedPool | None
    pinned_reason: str
    cpu: CpuTensors | None
    loaders: tuple[LoaderReport, ...]

    @property
    def workers_uss(self) -> int:
        """Sum of the live workers' USS."""
        return sum(loader.uss for loader in self.loaders)

    @property
    def workers_pss(self) -> int:
        """Sum of the live workers' PSS."""
        return sum(loader.pss for loader in self.loaders)


def build_pinned(
    stats: Mapping[str, Any], sizes: tuple[int, ...] | None, free_call: str | None
) -> PinnedPool:
    """The pool from ``host_memory_stats()``'s flat dict and the live pinned storages'
    sizes."""

    def current(key: str) -> int:
        value = stats.get(f"{key}.current", 0)
        return int(value) if isinstance(value, int) else 0

    owned = current("allocated_bytes")
    active = current("active_bytes")
    notes = []
    negative = sorted(k for k, v in stats.items() if isinstance(v, int) and v < 0)
    if negative:
        notes.append(
            "host_memory_stats() reports negative counters ("
            + ", ".join(f"{k} = {stats[k]}" for k in negative[:3])
            + "): its historical counters do not add up; only the current ones are read here"
        )
    requested = rounding = None
    # In use: the live pinned storages' blocks. torch's ``active_bytes`` is not read for
    # it: on torch 2.11 it keeps counting blocks freed and even emptied (3.5 GiB "active"
    # after every pinned tensor was deleted and the cache emptied).
    in_use = active
    if sizes is not None:
        requested = sum(sizes)
        blocks = sum(round_pinned(n) for n in sizes)
        rounding = blocks - requested
        in_use = min(blocks, owned) if owned else blocks
        if active > blocks:
            notes.append(
                f"{plural(active - blocks, 'byte')} counted active by host_memory_stats() "
                "belong to no "
                "live pinned tensor: blocks whose non_blocking copies have not finished, or "
                "freed blocks its active counter still counts (torch 2.11's does); they are "
                "counted cached here"
            )
    elif active > owned:
        in_use = owned
    return PinnedPool(
        in_use=in_use,
        cached=max(0, owned - in_use),
        blocks=current("allocations"),
        requested=requested,
        rounding=rounding,
        free_call=free_call,
        notes=tuple(notes),
    )


def _pinned() -> tuple[PinnedPool | None, str]:
    backend = _backend.get()
    stats = backend.host_pool_stats()
    if stats is None:
        return None, "not measured: CUDA is not initialised in this process (nothing pinned)"
    return build_pinned(stats, backend.pinned_sizes(), _torch_backend.host_cache_call()), ""


#: CPU storages whose holders are searched.
LARGEST = 5


def _cpu_tensors(holders: bool) -> CpuTensors:
    storages = census.live_storages("cpu")
    largest = storages[:LARGEST]
    if holders and largest:
        refs = [s.ref for s in largest if s.ref is not None]
        largest = census.live_storages("cpu", holders=True, among=refs)[:LARGEST]
    return CpuTensors(sum(s.nbytes for s in storages), len(storages), tuple(largest))


def measure_host(*, holders: bool = True, loaders: bool = True) -> HostLedger:
    """This process's host memory now: RSS/PSS/USS, the pinned pool, CPU tensors (the
    largest with their holders), and the live DataLoader workers. Never raises."""
    pinned, reason = _pinned()
    try:
        cpu: CpuTensors | None = _cpu_tensors(holders)
    except Exception:
        cpu = None
    found = workers.find_loaders() if loaders else ()
    return HostLedger(_procfs.read_memory(os.getpid()), pinned, reason, cpu, found)


@dataclass(frozen=True, slots=True)
class HostRelease(Presented):
    """What emptying the pinned cache gave back (``release(host=True)``)."""

    #: The call made (``None``: none was made, ``note`` says why).
    call: str | None
    before: PinnedPool | None
    after: PinnedPool | None
    rss_before: int | None
    rss_after: int | None
    note: str = ""

    @property
    def freed(self) -> int:
        """Pinned bytes given back to CUDA."""
        if self.before is None or self.after is None:
            return 0
        return max(0, self.before.owned - self.after.owned)


def empty_pinned_cache() -> HostRelease:
    """Empty the pinned pool's cache; the pool and RSS before and after."""
    backend = _backend.get()
    before, reason = _pinned()
    rss_before = _procfs.read_memory().rss
    if before is None:
        return HostRelease(None, None, None, rss_before, rss_before, reason)
    call = backend.empty_host_cache()
    after, _ = _pinned()
    note = "" if call is not None else "this torch has no call that empties the pinned cache"
    return HostRelease(call, before, after, rss_before, _procfs.read_memory().rss, note)


@dataclass(frozen=True, slots=True)
class HostRun(Presented):
    """The host half of ``cudamem run``: this process at exit, the pinned pool, and every
    DataLoader the watcher saw, with the ``HostMemoryWarning`` texts shown."""

    json_properties: ClassVar[tuple[str, ...]] = ("workers_growth",)

    process: ProcessMemory
    pinned: PinnedPool | None
    pinned_reason: str
    loaders: tuple[LoaderReport, ...]
    warnings: tuple[str, ...] = ()

    @property
    def workers_growth(self) -> int:
        """Total USS growth of every loader's workers."""
        return sum(loader.growth for loader in self.loaders)


def host_run(loaders: tuple[LoaderReport, ...], texts: tuple[str, ...]) -> HostRun:
    """``HostRun`` now, for these loaders and warning texts. Never raises."""
    pinned, reason = _pinned()
    return HostRun(_procfs.read_memory(os.getpid()), pinned, reason, loaders, texts)


@dataclass(frozen=True, slots=True)
class ProcessTree(Presented):
    """A process and its children (a training process and its DataLoader workers), as
    ``cudamem status`` reads them from outside."""

    json_properties: ClassVar[tuple[str, ...]] = ("children_uss", "children_pss")

    process: ProcessMemory
    name: str | None
    children: tuple[ProcessMemory, ...]

    @property
    def children_uss(self) -> int:
        """Sum of the children's USS (those measured)."""
        return sum(c.uss or 0 for c in self.children)

    @property
    def children_pss(self) -> int:
        """Sum of the children's PSS (those measured)."""
        return sum(c.pss or 0 for c in self.children)


def process_tree(pid: int) -> ProcessTree:
    """``pid``'s memory and its children's. Never raises."""
    me = os.getpid()  # `cudamem status --pid` run by the process it reads: not its child
    children = tuple(_procfs.read_memory(c) for c in _procfs.read_children(pid) if c != me)
    return ProcessTree(_procfs.read_memory(pid), _procfs.read_name(pid), children)
