"""The seam to PyTorch's CUDA caching allocator.

This is the only module in cudamem that calls ``torch.cuda`` memory APIs. It reads the
allocator's raw counters (``torch._C._cuda_memoryStats``, ~11 µs a device) rather than the
public accessors (``torch.cuda.memory_allocated()`` flattens the whole stats dict, ~81 µs),
and it never creates a CUDA context as a side effect: only devices that already have a primary
context are read or synchronized, unless the caller names a device explicitly.

Spans read three numbers per device per edge through ``Backend.counters``; the real
backend answers them from the C++ reader of ``cudamem.native.fastread`` (~0.2 µs) once it is
built and validated, and from the raw dict until then or wherever it cannot be built.

Tests swap the active backend with ``use`` to drive span logic through a fake allocator.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, TypeVar, cast

import torch

from ..native import fastread as _fastread
from ..native import states as _native_states
from .stats import AllocatorStats

__all__ = [
    "Backend",
    "PoolOwners",
    "TorchBackend",
    "build_reader",
    "get",
    "reader_status",
    "use",
]

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


#: How often ``TorchBackend.initialized_devices`` probes again the devices that had no
#: CUDA context (a span that gives a device its first context within this time after the
#: last probe does not see that device).
REPROBE_NS = 20_000_000


class TorchBackend(Backend):
    """The real allocator, through ``torch._C``'s raw entry points.

    Args:
        reader: the C++ counter reader's manager (default: a new one; tests inject fakes).
    """

    def __init__(self, reader: _fastread.FastReader | None = None) -> None:
        self._c = torch._C
        self._compiled = bool(getattr(self._c, "_cuda_getDeviceCount", None))
        self._count: int | None = None
        # A primary context, once created, lives until the process ends: remember the
        # devices that have one so the hot path does not probe them again.
        self._with_context: tuple[int, ...] = ()
        # Every device has one (nothing left to probe), and when the others are probed next.
        self._all_contexts = False
        self._next_probe_ns = 0
        self.reader = reader if reader is not None else _fastread.FastReader()
        # Set once the C++ reader is validated; until then (and for good where it cannot be
        # built) the dict path answers. Plain attributes: the hot path takes no lock.
        self.fast_counters: Callable[[int], Counters] | None = None
        self.fast_reset: Callable[[int], Counters] | None = None
        # A torch without CUDA never gets a reader: its reads skip the manager entirely.
        self._reader_pending = self._compiled

    def device_count(self) -> int:
        if not self._compiled:
            return 0
        if self._count is None:
            try:
                self._count = int(torch.cuda.device_count())
            except Exception:  # a broken driver reads as "no devices"
                self._count = 0
        return self._count

    def _initialized(self) -> bool:
        try:
            return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
        except Exception:
            return False

    def has_context(self, device: int) -> bool:
        if device in self._with_context:
            return True
        if not self._compiled or not self._initialized():
            return False
        probe = getattr(self._c, "_cuda_hasPrimaryContext", None)
        if probe is None:
            return device == torch.cuda.current_device()
        try:
            return bool(probe(device))
        except Exception:
            return False

    def current_device(self) -> int:
        if not self._compiled or not self._initialized():
            return 0
        return int(torch.cuda.current_device())

    def initialized_devices(self) -> tuple[int, ...]:
        """Devices with a CUDA context, probed without creating one. Spans ask at every
        edge, so the answer is cached: a context, once created, stays; devices without one
        are probed again at most every ``REPROBE_NS`` (until the first context appears,
        at every call)."""
        known = self._with_context
        if self._all_contexts:
            return known
        if not self._compiled or (not known and not self._initialized()):
            return ()
        now = time.perf_counter_ns()
        if known and now < self._next_probe_ns:
            return known
        count = self.device_count()
        found = tuple(i for i in range(count) if i in known or self.has_context(i))
        self._with_context = found
        self._all_contexts = len(found) == count
        if self._all_contexts and found:
            self.settled_devices = found
        self._next_probe_ns = now + REPROBE_NS
        return found

    def read(self, device: int) -> AllocatorStats:
        now = time.perf_counter_ns()
        if device not in self._with_context and (not self._compiled or not self._initialized()):
            return AllocatorStats.zero(device, now)
        return stats_from_raw(device, self._c._cuda_memoryStats(device), now)

    def synchronize(self, device: int) -> None:
        if self._compiled and self._initialized():
            # torch.cuda.device() restores the previous device only if it has a context
            # (MaybeExchangeDevice), so this creates no context on the current device.
            torch.cuda.synchronize(device)

    def reset_peak(self, device: int) -> None:
        if self._compiled and self._initialized():
            self._c._cuda_resetPeakMemoryStats(device)

    # -- counters: the C++ reader when validated, else the raw dict ----------------------

    def counters(self, device: int) -> Counters:
        fast = self.fast_counters
        if fast is not None:
            try:
                return fast(device)
            except Exception:
                pass  # e.g. a device index out of range: the dict path answers (or raises)
        elif self._reader_pending:
            self._poll_reader(device)
        return self._dict_counters(device)

    def counters_reset_peak(self, device: int) -> Counters:
        fast = self.fast_reset
        if fast is not None:
            try:
                return fast(device)
            except Exception:
                pass
        elif self._reader_pending:
            self._poll_reader(device)
        values = self._dict_counters(device)
        self.reset_peak(device)
        return values

    def _dict_counters(self, device: int) -> Counters:
        if device not in self._with_context and (not self._compiled or not self._initialized()):
            return (0, 0, 0)
        raw = self._c._cuda_memoryStats(device)
        try:
            a = raw["allocated_bytes"]["all"]
            return (a["current"], raw["reserved_bytes"]["all"]["current"], a["peak"])
        except (KeyError, TypeError):  # allocator backends that leave keys out
            stats = stats_from_raw(device, raw, 0)
            return (stats.allocated, stats.reserved, stats.peak_allocated)

    def _poll_reader(self, device: int) -> None:
        """One step of the C++ reader's life, on a read. It starts only once CUDA is
        initialised (never at import, never creating a context) and never waits for a
        build; a failure of cudamem's own only leaves the dict path in place."""
        if not self._compiled or not self._initialized():
            return
        try:
            reader = self.reader.poll(device, self._dict_counters)
        except Exception:
            reader = None
            self._reader_pending = False
        else:
            self._reader_pending = self.reader.pending
        if reader is not None:
            self.fast_reset = reader.counters_reset_peak
            self.fast_counters = reader.counters
            if hasattr(reader, "gate"):
                self.gates = cast("_fastread.GateLog", reader)

    def empty_cache(self) -> None:
        # torch.cuda.empty_cache() is a no-op before CUDA is initialised: no context made.
        if self._compiled and self._initialized():
            torch.cuda.empty_cache()

    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        if not self.has_context(device):
            return None
        try:
            free, total = torch.cuda.mem_get_info(device)
        except Exception:
            return None
        return int(free), int(total)

    # -- scalars --
    def record_event(self, device: int, event: Any = None) -> Any:
        # The caller holds a tensor on ``device``, so its context exists: nothing is created.
        ev = event if event is not None else torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(device))
        return ev

    def event_done(self, event: Any) -> bool:
        return bool(event.query())

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    # -- device ledger --
    def device_uuid(self, device: int) -> str | None:
        if not self._compiled or not self._initialized():
            return None
        try:
            # Device properties come from the runtime's cache: no context is created.
            uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        except Exception:
            return None
        return None if uuid is None else str(uuid)

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        if not self._compiled or not self._initialized():
            return None
        snapshot: Any = torch.cuda.memory_snapshot  # untyped in PyTorch
        try:
            try:
                # include_traces=False (PyTorch >= 2.12) skips the history ring buffer.
                segments = snapshot(include_traces=False)
            except TypeError:
                segments = snapshot()
        except Exception:
            return None
        return [s for s in segments if isinstance(s, dict) and s.get("device") == device]

    def current_stream_handle(self, device: int) -> int | None:
        if not self.has_context(device):
            return None
        try:
            # The current stream of a device with a context: reading it creates nothing.
            return int(torch.cuda.current_stream(device).cuda_stream)
        except Exception:
            return None

    def clear_cublas_workspaces(self) -> bool:
        clear = getattr(self._c, "_cuda_clearCublasWorkspaces", None)
        if not self._compiled or not self._initialized() or not callable(clear):
            return False
        clear()
        return True

    def is_recording_history(self) -> bool:
        probe = getattr(self._c, "_cuda_isHistoryEnabled", None)
        if not self._compiled or not self._initialized() or not callable(probe):
            return False
        try:
            return bool(probe())
        except Exception:
            return False

    # -- census --
    def cublas_workspace_sizes(self, device: int) -> tuple[int, ...]:
        # PyTorch exposes neither the workspaces nor their size to Python, so this repeats
        # the rule of aten/src/ATen/cuda/CublasHandlePool.cpp: getChosenWorkspaceSize() is
        # CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs, summed) or, by default, 32 MiB on
        # compute capability 9.x-12.x (Hopper, Blackwell) and 4096 KiB * 2 + 16 KiB * 8
        # before; cuBLASLt's is CUBLASLT_WORKSPACE_SIZE KiB (default 1024), and recent
        # releases give Lt the cuBLAS workspace (unified) instead.
        if not self.has_context(device):
            return ()
        import os
        import re

        sizes: list[int] = []
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
        if pairs:
            sizes.append(sum(int(size) * 1024 * int(count) for size, count in pairs))
        else:
            try:
                # The device has a context: its cached properties create nothing.
                major = int(torch.cuda.get_device_capability(device)[0])
            except Exception:
                return ()
            sizes.append(32 * 1024**2 if 9 <= major <= 12 else 4096 * 1024 * 2 + 16 * 1024 * 8)
        lt = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "")
        sizes.append(int(lt) * 1024 if lt.isdigit() else 1024 * 1024)
        return tuple(dict.fromkeys(sizes))

    # -- leaks and OOM --
    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        attach = getattr(self._c, "_cuda_attach_out_of_memory_observer", None)
        if not self._compiled or not callable(attach):
            return False
        # Device allocators exist only after CUDA initialises; an observer attached before
        # would reach none of them, so wait for initialisation (no context is created).
        torch.cuda._lazy_call(lambda: attach(observer))  # type: ignore[no-untyped-call]
        return True

    def set_history(
        self, enabled: bool, max_entries: int, still_wanted: Callable[[], bool] | None
    ) -> bool:
        record = getattr(torch.cuda.memory, "_record_memory_history", None)
        if not self._compiled or not callable(record):
            return False

        def apply() -> None:
            if still_wanted is not None and not still_wanted():
                return
            if enabled:
                # context="alloc", stacks="python": where each block was allocated, without
                # the C++ unwinding that makes "all" slow.
                record(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
            else:
                record(enabled=None)

        if not enabled and not self._initialized():
            return True  # nothing was recorded yet; a queued "on" checks still_wanted()
        torch.cuda._lazy_call(apply)  # type: ignore[no-untyped-call]
        return True

    def history_snapshot(self) -> dict[str, Any] | None:
        if not self._compiled or not self._initialized():
            return None
        try:
            snap = torch.cuda.memory._snapshot()
        except Exception:
            return None
        return snap if isinstance(snap, dict) else None

    # -- private pools (CUDA graphs) --
    def host_pool_stats(self) -> dict[str, Any] | None:
        reader = getattr(torch.cuda, "host_memory_stats", None)
        if reader is None or not self._compiled or not self._initialized():
            return None
        try:
            return dict(reader())
        except Exception:
            return None

    def pinned_sizes(self) -> tuple[int, ...] | None:
        if not self._compiled or not self._initialized():
            return None
        import gc

        return pinned_storage_sizes(gc.get_objects())

    def empty_host_cache(self) -> str | None:
        call = host_cache_call()
        if call is None or not self._compiled or not self._initialized():
            return None
        accelerator = getattr(torch, "accelerator", None)
        if call.startswith("torch.accelerator"):
            accelerator.empty_host_cache()  # type: ignore[union-attr]
        else:
            torch._C._host_emptyCache()
        return call

    def private_pool_owners(self) -> PoolOwners | None:
        if not self._compiled or not self._initialized():
            return None
        try:
            return _find_pool_owners()
        except Exception:
            return None


def pinned_storage_sizes(objects: Iterable[object]) -> tuple[int, ...]:
    """Bytes of each pinned CPU storage among ``objects``' tensors, each storage once.

    Tensors are told by ``type(o)``, never ``isinstance``: ``isinstance`` reads an object's
    ``__class__``, which a dead ``weakref.proxy`` answers with ``ReferenceError`` and a
    deprecated module attribute (``torch.distributed.reduce_op``) with a ``FutureWarning``
    (an error under ``-W error``): both met on the H200 in ``explain()``'s host section."""
    sizes: dict[int, int] = {}
    for o in objects:
        if not issubclass(type(o), torch.Tensor):
            continue
        t: Any = o
        try:
            if t.device.type != "cpu" or not t.is_pinned():
                continue
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        except Exception:
            continue
    return tuple(sizes.values())


def _with_subclasses(roots: list[type]) -> list[type]:
    out: list[type] = []
    todo = list(roots)
    while todo:
        t = todo.pop()
        if any(t is o for o in out):
            continue
        out.append(t)
        todo.extend(type.__subclasses__(t))
    return out


def instances_of(roots: list[type]) -> list[Any]:
    """Live instances of ``roots`` and their subclasses that gc tracks (instances of Python
    classes refer to their class, so one ``gc.get_referrers`` scan finds them all). Compares
    types by identity only: no user ``__eq__`` or ``__hash__`` runs."""
    import gc

    types = _with_subclasses(roots)
    found = gc.get_referrers(*types)
    try:
        return [o for o in found if any(type(o) is t for t in types)]
    finally:
        found.clear()


def _find_pool_owners() -> PoolOwners:
    """Ask every live CUDAGraph, MemPool and cudagraph-tree manager for its pool id.

    Unbound base-class accessors are used so that no subclass override (user code) runs.
    """
    import inspect
    import sys

    c = torch._C
    graph_base = getattr(c, "_CUDAGraph", None)
    pool_base = getattr(c, "_MemPool", None)
    trees_mod = sys.modules.get("torch._inductor.cudagraph_trees")
    manager = getattr(trees_mod, "CUDAGraphTreeManager", None) if trees_mod else None
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    pool_cls = getattr(torch.cuda, "MemPool", None)
    roots = [t for t in (graph_cls, pool_cls, manager) if isinstance(t, type)]
    if not roots:
        return PoolOwners(trees_loaded=trees_mod is not None)
    graphs: dict[tuple[int, int], int] = {}
    mempools: set[tuple[int, int]] = set()
    trees: dict[tuple[int, int], int] = {}
    pool_of = getattr(graph_base, "pool", None)
    id_prop = inspect.getattr_static(pool_base, "id", None) if pool_base is not None else None
    for obj in instances_of(roots):
        cls = type(obj)
        try:
            if graph_base is not None and issubclass(cls, graph_base) and callable(pool_of):
                pid = _pool_tuple(pool_of(obj))  # raises before a capture has ended
                if pid is not None:
                    graphs[pid] = graphs.get(pid, 0) + 1
            elif pool_base is not None and issubclass(cls, pool_base) and id_prop is not None:
                pid = _pool_tuple(id_prop.__get__(obj, cls))
                if pid is not None:
                    mempools.add(pid)
            elif manager is not None and issubclass(cls, manager):
                state = object.__getattribute__(obj, "__dict__")
                pid = _pool_tuple(state.get("cuda_graphs_thread_pool"))
                dev = state.get("device_index")
                if pid is not None:
                    trees[pid] = dev if isinstance(dev, int) else -1
        except Exception:
            continue
    return PoolOwners(graphs, frozenset(mempools), trees, trees_mod is not None)


def _pool_tuple(value: Any) -> tuple[int, int] | None:
    if type(value) is tuple and len(value) == 2 and all(type(v) is int for v in value):
        return (value[0], value[1])
    return None


_lock = threading.Lock()
_torch = TorchBackend()
_active: Backend = _torch


def reader_status() -> _native_states.ReaderStatus:
    """Which counter reader this process's real backend uses (the C++ one or the dict),
    and why. Creates no CUDA context and starts no build."""
    return _torch.reader.status()


def build_reader(*, validate: bool = True) -> _native_states.ReaderStatus:
    """Compile the C++ reader now, on this thread (``python -m cudamem build-reader``),
    ignoring markers left by earlier failures. With ``validate`` and a visible GPU it is
    then checked against the dict read on ``cuda:0``, which initialises CUDA there."""
    backend = _torch
    backend.reader.build_now(force=True)
    if validate and backend.reader.state == _native_states.READY and backend.device_count() > 0:
        probe = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
        backend.counters(0)  # validates it: equal to the dict read, or dropped
        del probe
    return backend.reader.status()


def host_cache_call() -> str | None:
    """The call that empties the pinned pool on the installed torch:
    ``torch.accelerator.empty_host_cache()`` (newer releases), else
    ``torch._C._host_emptyCache()``; ``None`` when neither exists."""
    if callable(getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)):
        return "torch.accelerator.empty_host_cache()"
    if callable(getattr(torch._C, "_host_emptyCache", None)):
        return "torch._C._host_emptyCache()"
    return None


def expandable_segments() -> bool:
    """Whether the allocator maps memory in expandable segments (``expandable_segments:True``
    in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``): reservations then grow in whole
    pages (20 MiB in the large pool) rather than in segments of the request's size."""
    import os

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for part in os.environ.get(var, "").replace(";", ",").split(","):
            key, _, value = part.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


def reserved_for(nbytes: int) -> int:
    """What a large request of ``nbytes`` reserves in a fresh segment: the request itself
    (rounded to 2 MiB) by default, whole 20 MiB pages under expandable segments."""
    step = 20 * 1024**2 if expandable_segments() else 2 * 1024**2
    return -(-nbytes // step) * step


def get() -> Backend:
    """The backend in use."""
    return _active


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
    """Swap the backend for the duration of the block (tests use a fake allocator)."""
    global _active
    with _lock:
        previous = _active
        _active = backend
    try:
        yield backend
    finally:
        with _lock:
            _active = previous


class HistoryLease:
    """Allocation-history recording borrowed by an installed hook (OOM post-mortems,
    automatic snapshot dumps): turned on only when nobody had it on, and off again only by
    the lease that turned it on, so a user's own ``_record_memory_history`` is left alone."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        #: This lease turned recording on and has not given it back.
        self.active = False

    def take(self, max_entries: int, still_wanted: Callable[[], bool]) -> bool:
        """Turn recording on unless it already is; ``True`` when it already was (untouched).

        ``still_wanted`` is asked if the request waits for CUDA to initialise.
        """
        backend = get()
        if backend.is_recording_history():
            return True
        self.active = backend.set_history(True, max_entries, still_wanted)
        return False

    def give_back(self) -> None:
        """Turn recording off if this lease turned it on."""
        if self.active:
            get().set_history(False, 0, None)
            self.active = False


_Hook = TypeVar("_Hook", bound="InstalledHook")


class InstalledHook:
    """What an installed hook (OOM post-mortems, automatic snapshot dumps) shares: ``installed``
    until ``uninstall()``, which runs once under the kind's ``_install_lock``; the history
    settings and a ``HistoryLease`` (taken by ``_take_history``, given back there); a context
    manager that uninstalls at the end of the block. A subclass undoes its own hooks in
    ``_unhook``."""

    _install_lock: ClassVar[threading.Lock]

    def __init__(self, *, record_history: bool, max_entries: int) -> None:
        #: Whether installing turns allocation-history recording on, and its ring's bound.
        self.record_history = record_history
        self.max_entries = max_entries
        self.installed = False
        self._history = HistoryLease()

    def _take_history(self) -> bool:
        """Turn history recording on if this hook was asked to; ``True`` when it already was
        (left as it is)."""
        return self.record_history and self._history.take(self.max_entries, self._wanted)

    def _wanted(self) -> bool:
        """Checked by a history request queued until CUDA initialises."""
        return self.installed

    def _unhook(self) -> None:
        """Undo what installing did (under ``_install_lock``, before the lease goes back)."""

    def _leaving(self, exc: BaseException | None) -> None:
        """At the end of a ``with`` block, before ``uninstall``."""

    def _state(self) -> str:
        return "installed" if self.installed else "uninstalled"

    def uninstall(self) -> None:
        """Stop; turn history recording off again if this hook turned it on."""
        with self._install_lock:
            if not self.installed:
                return
            self.installed = False
            self._unhook()
            self._history.give_back()

    def __enter__(self: _Hook) -> _Hook:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._leaving(exc)
        finally:
            self.uninstall()
