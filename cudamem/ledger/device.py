"""The device ledger: why nvidia-smi shows more than your tensors.

``explain`` reconciles NVML's ``used`` figure for a device with what PyTorch knows, as
ledger lines that add up to it::

    NVML used (total − free) = driver reserve
                             + this process: CUDA context and loaded kernels   (inferred)
                                           + other non-PyTorch memory           (measured probes)
                                           + CUDA graph private pools           (snapshot)
                                           + PyTorch cache: awaiting stream events,
                                             stranded on idle streams,
                                             releasable, non-releasable        (allocator, snapshot)
                                           + allocated: live tensors, autograd saved tensors,
                                             cuBLAS workspaces, unaccounted    (allocator, census)
                             + other processes                                  (NVML)
                             + driver memory outside every process (the difference)

Measured lines come straight from NVML or the allocator; the context line is *inferred*: this
process's NVML figure minus the allocator's reserved bytes minus other measured non-PyTorch
memory. When NVML cannot give a figure (no driver, containers, MIG, WDDM, permissions) the line
is ``None`` with a reason, never 0.

The cache lines follow the allocator's own rules for ``empty_cache()`` (see
``cudamem.allocator.snapshot``), expandable segments included: "releasable" is what
``empty_cache()`` would return now, to the byte.

Each ledger carries the cache's fragmentation beside its lines (``cudamem.fragmentation``:
where the free bytes sit per pool, the peaks, the last OOM judged), read from the same
snapshot; ``fragmentation()`` gives it alone.

``build_ledger`` is the pure arithmetic, fed by recorded figures in tests;
``machine_status`` is the whole machine as NVML sees it (``cudamem status``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..allocator.cache_split import CacheSplit
from ..allocator.stats import AllocatorStats, device_name
from ..base.present import Presented, PresentedHtml
from ..host.ledger import HostLedger
from . import nvml as _nvml
from .free_space import Fragmentation

__all__ = ["AllocatedSplit", "DeviceLedger", "Explanation", "LedgerLine"]


MiB = 1024**2


#: A CUDA context with lazy module loading is ~0.5–0.6 GiB (H200, CUDA 13); above this the
#: inferred line almost surely holds other libraries' memory too.
CONTEXT_SUSPICIOUS = 1536 * MiB


# What frees each line: the sentence users need most.
FREES = {
    "driver_reserve": "nothing: the driver keeps it while the GPU is up (nvidia-smi hides it)",
    "context": "only the process exiting (one context per device this process touched)",
    "context_unused": (
        "only the process exiting; to avoid it, set the device in every thread "
        "(torch.cuda.set_device(dev) before any CUDA call) so no work lands on this device"
    ),
    "other_nonpytorch": "the library that allocated it (e.g. its memory pool's free call)",
    "graph_pools:cuda_graph": (
        "only deleting the graph and its outputs (del g, outputs), then empty_cache()"
    ),
    "graph_pools:shared_graph": (
        "only deleting every graph sharing the pool and their outputs (torch.compile's: "
        "torch._dynamo.reset()), then empty_cache()"
    ),
    "graph_pools:cudagraph_tree": (
        "deleting the compiled function and its outputs, or torch._dynamo.reset(), then "
        "empty_cache()"
    ),
    "graph_pools:mempool": "deleting the torch.cuda.MemPool and the tensors allocated in it",
    "cache_pending_free": (
        "the streams passed to record_stream() finishing their work; empty_cache() waits "
        "for them, then returns what is free"
    ),
    "cache_stranded": (
        "cudamem.release() / torch.cuda.empty_cache(); reuse one stream instead of a new "
        "torch.cuda.Stream per run"
    ),
    "cache_releasable": "cudamem.release() / torch.cuda.empty_cache()",
    "cache_non_releasable": (
        "freeing the live blocks that share their segments, then empty_cache()"
    ),
    "cache": "cudamem.release() / torch.cuda.empty_cache() (the part not next to live blocks)",
    "allocated": "dropping every reference to the tensors (cudamem.release() names holders)",
    "allocated_live": "dropping every reference (cudamem.who_holds(t) names them)",
    "allocated_autograd": "backward(), or dropping the loss/outputs that hold the graph",
    "allocated_cublas": "cudamem.release(clear_cublas=True); empty_cache() never frees them",
    "allocated_unaccounted": (
        "unknown: tensors held outside Python (C++ extensions, saved tensors without a "
        "Python object), allocator rounding"
    ),
    "other_process": "that process exiting or freeing its memory",
    "processes_unattributed": "the processes NVML lists; which one is this is unknown",
    "unattributed": (
        "nothing: driver memory NVML counts in used but lists under no process: a few MiB; "
        "more means processes NVML cannot list"
    ),
}


_POOL_LABELS = {
    "cuda_graph": "CUDA graph private pools",
    "shared_graph": "CUDA graph pools from graph_pool_handle()",
    "cudagraph_tree": "torch.compile cudagraph pools",
    "mempool": "torch.cuda.MemPool pools",
}


@dataclass(frozen=True, slots=True)
class LedgerLine(Presented):
    """One line of a device ledger. ``nbytes`` is ``None`` when it cannot be known, and
    ``note`` says why; ``basis`` is ``'measured'`` or ``'inferred'``."""

    key: str
    label: str
    nbytes: int | None
    basis: str
    source: str
    frees: str
    group: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class AllocatedSplit:
    """The allocator's ``allocated`` bytes of one device (outside the private pools the ledger
    reports apart), split by the census."""

    live_tensors: int
    autograd_saved: int
    cublas_workspaces: int
    unaccounted: int
    #: cuBLAS/cuBLASLt workspaces found (one per handle and stream).
    workspace_count: int = 0
    #: Distinct streams those workspaces belong to (``0`` when unknown).
    workspace_streams: int = 0

    @property
    def total(self) -> int:
        """Sum of the parts (equals the allocated bytes it was split from)."""
        return self.live_tensors + self.autograd_saved + self.cublas_workspaces + self.unaccounted


@dataclass(frozen=True, slots=True)
class DeviceLedger(PresentedHtml):
    """Where one device's memory went, as lines that add up to NVML's ``used``.

    ``nvml_used`` is ``total - free`` (driver reserve included); ``smi_used`` is what
    nvidia-smi shows on recent drivers (reserve excluded), ``None`` when unknown.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("accounted",)

    device: int
    name: str | None
    uuid: str | None
    pid: int
    nvml_total: int | None
    nvml_used: int | None
    smi_used: int | None
    allocator: AllocatorStats
    lines: tuple[LedgerLine, ...]
    cache: CacheSplit | None
    notes: tuple[str, ...] = ()
    #: Where the cache's free bytes sit, the peaks, the last OOM judged (no line of the sum).
    fragmentation: Fragmentation | None = None

    @property
    def accounted(self) -> int:
        """Sum of every line with a known size (the ``unattributed`` line included)."""
        return sum(line.nbytes for line in self.lines if line.nbytes is not None)

    @property
    def unattributed(self) -> int | None:
        """NVML's used minus the other lines; ``None`` when some line is unknown."""
        for line in self.lines:
            if line.key == "unattributed":
                return line.nbytes
        return None

    def line(self, key: str) -> LedgerLine | None:
        """The line with ``key`` (``'context'``, ``'cache_releasable'``, …), if present."""
        for line in self.lines:
            if line.key == key:
                return line
        return None


@dataclass(frozen=True, slots=True)
class Explanation(PresentedHtml):
    """The result of ``explain``: one ledger per device, and NVML's status."""

    devices: tuple[DeviceLedger, ...]
    nvml: _nvml.NvmlStatus
    notes: tuple[str, ...] = ()
    #: The host half: RSS/PSS/USS, the pinned pool, CPU tensors, DataLoader workers
    #: (``explain(host=False)``: ``None``).
    host: HostLedger | None = None

    def __getitem__(self, device: int) -> DeviceLedger:
        for ledger in self.devices:
            if ledger.device == device:
                return ledger
        raise KeyError(f"no ledger for {device_name(device)}")
