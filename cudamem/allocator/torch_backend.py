"""``TorchBackend``: the real allocator, through ``torch._C``'s raw entry points.

It reads the allocator's raw counters (``torch._C._cuda_memoryStats``, ~11 µs a device)
rather than the public accessors (``torch.cuda.memory_allocated()`` flattens the whole stats
dict, ~81 µs), and it never creates a CUDA context as a side effect: only devices that already
have a primary context are read or synchronized, unless the caller names a device explicitly.
Spans read three numbers per device per edge through ``Backend.counters``, answered from the
C++ reader of ``cudamem.native.fastread`` (~0.2 µs) once it is built and validated, and from the
raw dict until then or wherever it cannot be built. Also here: which objects own private
pools (``instances_of``, pinned storages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from ..native import fastread as _fastread
from .backend_base import Backend, Counters, PoolOwners, stats_from_raw
from .stats import AllocatorStats

__all__ = ["TorchBackend", "host_cache_call"]


def host_cache_call() -> str | None:
    """The call that empties the pinned pool on the installed torch:
    ``torch.accelerator.empty_host_cache()`` (newer releases), else
    ``torch._C._host_emptyCache()``; ``None`` when neither exists."""
    if callable(getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)):
        return "torch.accelerator.empty_host_cache()"
    if callable(getattr(torch._C, "_host_emptyCache", None)):
        return "torch._C._host_emptyCache()"
    return None


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
