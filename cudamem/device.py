"""The device ledger: why nvidia-smi shows more than your tensors, and giving memory back.

:func:`explain` reconciles NVML's ``used`` figure for a device with what PyTorch knows, as
ledger lines that add up to it::

    NVML used (total − free) = driver reserve
                             + this process: CUDA context and loaded kernels   (inferred)
                                           + other non-PyTorch memory           (measured probes)
                                           + PyTorch cache: stranded on idle streams,
                                             releasable, non-releasable        (allocator, snapshot)
                                           + allocated: live tensors, autograd saved tensors,
                                             cuBLAS workspaces, unaccounted    (allocator, census)
                             + other processes                                  (NVML)
                             + driver memory outside every process (the difference)

Measured lines come straight from NVML or the allocator; the context line is *inferred*: this
process's NVML figure minus the allocator's reserved bytes minus other measured non-PyTorch
memory. When NVML cannot give a figure (no driver, containers, MIG, WDDM, permissions) the line
is ``None`` with a reason, never 0.

:func:`release` is the "give my memory back" call between runs: ``gc.collect()``, optionally
``torch._C._cuda_clearCublasWorkspaces()``, ``torch.cuda.empty_cache()``; it reports what was
freed per device and names the holders of the largest storages still allocated.

:func:`build_ledger` is the pure arithmetic, fed by recorded figures in tests.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import _backend, _nvml, census
from ._device_arg import DeviceLike, resolve_device
from .render.text import format_bytes
from .snapshot import CacheSplit, split_cache
from .stats import AllocatorStats, device_name

__all__ = [
    "AllocatedSplit",
    "DeviceLedger",
    "DeviceRelease",
    "Explanation",
    "LedgerLine",
    "MachineStatus",
    "ReleaseResult",
    "RemainingStorage",
    "build_ledger",
    "explain",
    "machine_status",
    "release",
]

MiB = 1024**2

#: A CUDA context with lazy module loading is ~0.5–0.6 GiB (H200, CUDA 13); above this the
#: inferred line almost surely holds other libraries' memory too.
CONTEXT_SUSPICIOUS = 1536 * MiB

# What frees each line: the sentence users need most.
FREES = {
    "driver_reserve": "nothing: the driver keeps it while the GPU is up (nvidia-smi hides it)",
    "context": "only the process exiting (one context per device this process touched)",
    "other_nonpytorch": "the library that allocated it (e.g. its memory pool's free call)",
    "cache_stranded": (
        "cudamem.release() / torch.cuda.empty_cache(); reuse one stream instead of a new "
        "torch.cuda.Stream per run"
    ),
    "cache_releasable": "cudamem.release() / torch.cuda.empty_cache()",
    "cache_non_releasable": (
        "freeing the live blocks that share their segments, then empty_cache()"
    ),
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
        "nothing: driver memory NVML counts in used but lists under no process (H200, driver "
        "580: 3.3 MiB idle, 8.8 MiB with one context); more means processes NVML cannot list"
    ),
}


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class LedgerLine:
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "key": self.key,
            "label": self.label,
            "bytes": self.nbytes,
            "basis": self.basis,
            "source": self.source,
            "frees": self.frees,
            "group": self.group,
            "note": self.note,
        }

    def __str__(self) -> str:

        return f"{self.label}: {format_bytes(self.nbytes)} ({self.basis}; freed by {self.frees})"


@dataclass(frozen=True, slots=True)
class AllocatedSplit:
    """The allocator's ``allocated`` bytes of one device, split by the census."""

    live_tensors: int
    autograd_saved: int
    cublas_workspaces: int
    unaccounted: int

    @property
    def total(self) -> int:
        """Sum of the parts (equals the allocated bytes it was split from)."""
        return self.live_tensors + self.autograd_saved + self.cublas_workspaces + self.unaccounted

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "live_tensors": self.live_tensors,
            "autograd_saved": self.autograd_saved,
            "cublas_workspaces": self.cublas_workspaces,
            "unaccounted": self.unaccounted,
        }


@dataclass(frozen=True, slots=True)
class DeviceLedger:
    """Where one device's memory went, as lines that add up to NVML's ``used``.

    ``nvml_used`` is ``total - free`` (driver reserve included); ``smi_used`` is what
    nvidia-smi shows on recent drivers (reserve excluded), ``None`` when unknown.
    """

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "device": self.device,
            "name": self.name,
            "uuid": self.uuid,
            "pid": self.pid,
            "nvml_total": self.nvml_total,
            "nvml_used": self.nvml_used,
            "smi_used": self.smi_used,
            "accounted": self.accounted,
            "allocator": self.allocator.to_dict(),
            "lines": [line.to_dict() for line in self.lines],
            "cache": None if self.cache is None else self.cache.to_dict(),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.ledger import render_ledger

        return render_ledger(self)

    def _repr_html_(self) -> str:
        from .render.notebook import ledger_html

        return ledger_html(self)


@dataclass(frozen=True, slots=True)
class Explanation:
    """The result of :func:`explain`: one ledger per device, and NVML's status."""

    devices: tuple[DeviceLedger, ...]
    nvml: _nvml.NvmlStatus
    notes: tuple[str, ...] = ()

    def __getitem__(self, device: int) -> DeviceLedger:
        for ledger in self.devices:
            if ledger.device == device:
                return ledger
        raise KeyError(f"no ledger for {device_name(device)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "devices": [d.to_dict() for d in self.devices],
            "nvml": self.nvml.to_dict(),
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.ledger import render_explanation

        return render_explanation(self)

    def _repr_html_(self) -> str:
        from .render.notebook import explanation_html

        return explanation_html(self)


# --------------------------------------------------------------------------- the arithmetic


def _line(
    key: str,
    label: str,
    nbytes: int | None,
    basis: str,
    source: str,
    group: str,
    note: str = "",
    frees_key: str | None = None,
) -> LedgerLine:
    return LedgerLine(key, label, nbytes, basis, source, FREES[frees_key or key], group, note)


def build_ledger(
    device: int,
    *,
    stats: AllocatorStats,
    nvml: _nvml.NvmlDevice | None,
    pid: int,
    has_context: bool = True,
    cache: CacheSplit | None = None,
    allocated: AllocatedSplit | None = None,
    other_in_process: Sequence[tuple[str, int]] = (),
    nvml_reason: str | None = None,
) -> DeviceLedger:
    """Assemble one device's ledger from figures already read (pure; no torch, no NVML).

    ``stats`` are the allocator's counters, ``nvml`` the NVML reading (``None`` when NVML is
    unavailable, with ``nvml_reason``), ``cache`` the snapshot's cache split, ``allocated``
    the census split of ``stats.allocated``, ``other_in_process`` measured non-PyTorch memory
    of this process as ``(name, bytes)``.
    """
    notes: list[str] = []
    this = f"this process (pid {pid})"
    memory = None if nvml is None else nvml.memory
    used = None if memory is None else memory.used
    if nvml is None:
        notes.append(f"NVML: {nvml_reason or 'unavailable'}; only PyTorch's own figures shown")
    elif memory is None:
        notes.append(f"device memory: {nvml.memory_reason}")
    if nvml is not None:
        notes.extend(nvml.notes)

    # -- who is on the device, according to NVML
    procs = None if nvml is None else nvml.processes
    own: int | None = None
    own_reason = ""
    others: list[_nvml.GpuProcess] = []
    separable = False  # whether this process's NVML figure is told apart from the others'
    if nvml is not None and procs is None:
        own_reason = f"process list unavailable: {nvml.processes_reason}"
    elif procs is not None:
        mine = [p for p in procs if p.pid == pid]
        others = [p for p in procs if p.pid != pid]
        if mine:
            separable = True
            own = mine[0].used
            if own is None:
                own_reason = "NVML reports no per-process memory here (WDDM, MIG or privileges)"
        elif not has_context:
            separable = True
            own = 0  # no context here and absent from NVML's list: nothing of ours
        else:
            own_reason = (
                f"pid {pid} is not among the {len(procs)} process(es) NVML lists for this "
                "device: inside a container NVML reports host PIDs (another PID namespace), "
                "so per-process figures cannot be matched; device-level figures shown"
            )
    if own_reason:
        notes.append(own_reason)
    # Without our own figure, listing the others beside an inferred remainder would count
    # them twice: everything NVML counts then goes into one device-level line.
    separable = separable and own is not None

    lines: list[LedgerLine] = []

    # -- driver reserve
    reserve = None if memory is None else memory.reserved
    reserve_basis, reserve_note = "measured", ""
    if memory is not None and reserve is None:
        known = [p.used for p in (procs or ())]
        if separable and all(u is not None for u in known):
            reserve = memory.used - sum(u for u in known if u is not None)
            reserve_basis = "inferred"
            reserve_note = "NVML v1 only: used minus every process's memory"
        else:
            reserve_note = "needs nvmlDeviceGetMemoryInfo_v2 (driver too old)"
    elif memory is None:
        reserve_note = "NVML unavailable"
    lines.append(
        _line(
            "driver_reserve",
            "driver reserve",
            reserve,
            reserve_basis,
            "NVML v2 reserved" if reserve_basis == "measured" else "NVML",
            "device",
            reserve_note,
        )
    )

    # -- this process: context (inferred), other non-PyTorch (measured)
    other_total = sum(n for _, n in other_in_process)
    if separable and own is not None:
        context = own - stats.reserved - other_total
        context_note = (
            f"NVML's {format_bytes(own)} for this process − allocator reserved "
            f"{format_bytes(stats.reserved)}"
            + (f" − other measured {format_bytes(other_total)}" if other_total else "")
        )
        context_key, context_label, frees_key = "context", "CUDA context and loaded kernels", None
        if context > CONTEXT_SUSPICIOUS:
            notes.append(
                f"the inferred context ({format_bytes(context)}) is larger than a CUDA "
                "context usually is (~0.5–0.6 GiB with lazy loading, ~1.3 GiB eager): "
                "other libraries (NCCL "
                "communicators ~0.5 GiB each, cuDNN/TensorRT, CUDA graphs, another allocator) "
                "likely hold memory outside PyTorch's cache"
            )
    elif memory is not None and reserve is not None and (procs is not None or own_reason):
        # Not separable: everything NVML counts minus what we know is ours and the reserve.
        context = memory.used - reserve - stats.reserved - other_total
        context_key = "context_and_processes"
        context_label = "CUDA context, kernels and processes NVML cannot attribute"
        context_note = "device used − driver reserve − this process's allocator reserved"
        frees_key = "processes_unattributed"
    else:
        context = None
        context_key, context_label, frees_key = "context", "CUDA context and loaded kernels", None
        context_note = own_reason or (nvml_reason or "NVML unavailable")
    lines.append(
        _line(
            context_key,
            context_label,
            context,
            "inferred",
            "NVML − allocator",
            this,
            context_note,
            frees_key=frees_key or "context",
        )
    )
    for name, nbytes in other_in_process:
        lines.append(
            _line(
                f"other_nonpytorch:{name}",
                f"other non-PyTorch: {name}",
                nbytes,
                "measured",
                name,
                this,
                frees_key="other_nonpytorch",
            )
        )

    # -- PyTorch cache
    cached = stats.reserved - stats.allocated
    stranded: int | None
    if cache is not None and cache.reserved == stats.reserved:
        stranded, releasable, non_rel = cache.stranded, cache.releasable, cache.non_releasable
        # The snapshot counts blocks awaiting a stream event as live; the counters do not.
        non_rel += cached - (stranded + releasable + non_rel)
        src = "memory_snapshot"
        idle = [s for s in cache.streams if s.stranded]
        stranded_note = (
            f"{len(idle)} stream(s) with cached blocks and no live tensor"
            + (
                f"; {format_bytes(cache.stranded_in_live_segments)} of it shares segments "
                "with live blocks (cuBLAS workspaces?): release(clear_cublas=True) frees those"
                if cache.stranded_in_live_segments
                else ""
            )
            if idle
            else ""
        )
    else:
        stranded = 0 if cached == 0 else None  # no cache at all: nothing can be stranded
        non_rel = stats.inactive_split
        releasable = cached - non_rel
        src = "allocator counters"
        stranded_note = (
            "memory_snapshot unavailable"
            if cache is None
            else "snapshot and counters disagree (memory changed while reading)"
        )
    lines.append(
        _line(
            "cache_stranded",
            "PyTorch cache stranded on idle streams",
            stranded,
            "measured",
            "memory_snapshot",
            this,
            stranded_note,
        )
    )
    lines.append(
        _line(
            "cache_releasable",
            "PyTorch cache, releasable",
            releasable,
            "measured",
            src,
            this,
            "whole free segments",
        )
    )
    lines.append(
        _line(
            "cache_non_releasable",
            "PyTorch cache, not releasable",
            non_rel,
            "measured",
            src,
            this,
            "free blocks inside segments that still hold live blocks",
        )
    )

    # -- allocated
    if allocated is not None and allocated.total == stats.allocated:
        parts = (
            ("allocated_live", "allocated: live tensors", allocated.live_tensors, ""),
            (
                "allocated_autograd",
                "allocated: autograd saved tensors",
                allocated.autograd_saved,
                "",
            ),
            (
                "allocated_cublas",
                "allocated: cuBLAS workspaces",
                allocated.cublas_workspaces,
                "",
            ),
            (
                "allocated_unaccounted",
                "allocated: no tensor found",
                allocated.unaccounted,
                "",
            ),
        )
        for key, label, nbytes, note in parts:
            lines.append(_line(key, label, nbytes, "measured", "allocator + census", this, note))
    else:
        note = (
            "census unavailable: not split into tensors, saved tensors and workspaces"
            if allocated is None
            else "census and counters disagree (memory changed while reading): not split"
        )
        lines.append(
            _line(
                "allocated",
                "PyTorch allocated",
                stats.allocated,
                "measured",
                "allocator counters",
                this,
                note,
            )
        )

    # -- other processes
    if separable:
        for p in others:
            label = f"pid {p.pid} {p.name or '(name not visible)'}"
            lines.append(
                _line(
                    f"process:{p.pid}",
                    label,
                    p.used,
                    "measured",
                    "NVML",
                    "other processes",
                    "" if p.used is not None else "NVML reports no per-process memory",
                    frees_key="other_process",
                )
            )
    elif procs:
        listed = ", ".join(
            f"{p.pid} ({format_bytes(p.used) if p.used is not None else 'n/a'})" for p in procs
        )
        notes.append(f"NVML lists host pid(s): {listed}")

    # -- the difference
    known = [line.nbytes for line in lines]
    if (
        separable
        and used is not None
        and reserve_basis == "measured"
        and all(n is not None for n in known)
    ):
        diff = used - sum(n for n in known if n is not None)
        lines.append(
            _line(
                "unattributed",
                "driver memory outside every process",
                diff,
                "inferred",
                "NVML − lines",
                "device",
                "NVML's used minus every line above",
            )
        )

    return DeviceLedger(
        device=device,
        name=None if nvml is None else nvml.name,
        uuid=None if nvml is None else nvml.uuid,
        pid=pid,
        nvml_total=None if memory is None else memory.total,
        nvml_used=used,
        smi_used=None if memory is None else memory.used_excluding_reserve,
        allocator=stats,
        lines=tuple(lines),
        cache=cache,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- census seam


def _ledger_inputs(
    device: int, allocated: int
) -> tuple[AllocatedSplit | None, frozenset[int] | None]:
    """The census's split of ``allocated`` and the live storages' addresses (one heap scan).

    The split is ``None`` when the census fails or memory moved between the two reads
    (``build_ledger`` then shows one allocated line); the addresses are ``None`` on failure.
    """
    try:
        u, addresses = census.ledger_view(device)
    except Exception:
        return None, None
    if int(u.allocated) != allocated:
        return None, addresses
    split = AllocatedSplit(
        live_tensors=int(u.python),
        autograd_saved=int(u.autograd),
        cublas_workspaces=int(u.cublas_workspaces),
        unaccounted=int(u.unknown),
    )
    return split, addresses


# --------------------------------------------------------------------------- explain()


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
        notes.append("CUDA_MODULE_LOADING=EAGER: every kernel is loaded, the context is ~1.3 GiB")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        notes.append(
            "expandable segments are on: segments grow in place; the cache split is approximate"
        )
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            notes.append(
                f"torch.distributed is initialised (backend {dist.get_backend()}): NCCL "
                "buffers (~0.5 GiB per communicator) are outside the allocator and show in "
                "the context line"
            )
    except Exception:
        pass
    return notes


def _ledger_for(device: int, status: _nvml.NvmlStatus) -> DeviceLedger:
    be = _backend.get()
    has_context = be.has_context(device)
    stats = be.read(device)
    cache: CacheSplit | None = None
    allocated: AllocatedSplit | None = None
    if has_context:
        allocated, addresses = _ledger_inputs(device, stats.allocated)
        segments = be.memory_segments(device)
        if segments is not None:
            current = be.current_stream_handle(device)
            cache = split_cache(
                segments,
                current_streams=(0,) if current is None else (0, current),
                tensor_addresses=addresses,
            )
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
        cache=cache,
        allocated=allocated,
        other_in_process=_other_in_process(device) if has_context else (),
        nvml_reason=reason,
    )
    if not has_context:
        extra = (
            f"this process has no CUDA context on {device_name(device)}: it uses nothing "
            "there (cudamem did not create one)",
        )
        ledger = _replace_notes(ledger, ledger.notes + extra)
    return ledger


def _replace_notes(ledger: DeviceLedger, notes: tuple[str, ...]) -> DeviceLedger:
    import dataclasses

    return dataclasses.replace(ledger, notes=notes)


def explain(device: DeviceLike | None = None) -> Explanation:
    """Reconcile nvidia-smi with PyTorch for each device this process uses (or ``device``).

    Returns an :class:`Explanation`; ``print()`` it for a table, ``to_dict()`` for JSON. Each
    ledger's lines add up to NVML's ``used`` and say what frees them. Creates no CUDA
    context, synchronizes nothing and never turns allocator history recording on; with no
    driver or no GPU it explains that in one line instead of raising.
    """
    be = _backend.get()
    notes: list[str] = []
    status = _nvml.status()
    if device is not None and be.device_count() == 0:
        # No GPU, no driver or a CPU build of torch: one clear line, not an exception.
        import torch

        reason = "a CPU build of torch" if torch.version.cuda is None else "no GPU or no driver"
        notes.append(f"{device} cannot be explained: torch sees no CUDA device ({reason})")
        return Explanation(devices=(), nvml=status, notes=tuple(notes))
    devices = be.initialized_devices() if device is None else (resolve_device(device),)
    if not devices:
        notes.append(
            "this process has no CUDA context on any device yet: nothing of it is on a GPU "
            "(pass device= to see a device's NVML figures)"
        )
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
    return Explanation(devices=tuple(ledgers), nvml=status, notes=tuple(notes))


# --------------------------------------------------------------------------- release()


@dataclass(frozen=True, slots=True)
class RemainingStorage:
    """A storage still allocated after :func:`release`, and the paths that hold it."""

    device: int | str
    nbytes: int
    description: str
    holders: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "device": self.device,
            "bytes": self.nbytes,
            "description": self.description,
            "holders": list(self.holders),
        }

    def __str__(self) -> str:

        held = "; ".join(self.holders) if self.holders else "no holder found"
        return f"{format_bytes(self.nbytes)} {self.description} held by {held}"


@dataclass(frozen=True, slots=True)
class DeviceRelease:
    """What :func:`release` gave back on one device, and what is still allocated."""

    device: int
    before: AllocatorStats
    after: AllocatorStats
    nvml_used_before: int | None
    nvml_used_after: int | None
    remaining: tuple[RemainingStorage, ...]

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
    def nvml_freed(self) -> int | None:
        """The drop in NVML's used figure, ``None`` without NVML."""
        if self.nvml_used_before is None or self.nvml_used_after is None:
            return None
        return self.nvml_used_before - self.nvml_used_after

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "device": self.device,
            "freed_reserved": self.freed_reserved,
            "freed_allocated": self.freed_allocated,
            "still_allocated": self.still_allocated,
            "still_reserved": self.after.reserved,
            "nvml_used_before": self.nvml_used_before,
            "nvml_used_after": self.nvml_used_after,
            "nvml_freed": self.nvml_freed,
            "remaining": [r.to_dict() for r in self.remaining],
        }


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """The result of :func:`release`."""

    devices: tuple[DeviceRelease, ...]
    gc_collected: int
    cublas_cleared: bool
    notes: tuple[str, ...] = ()

    def __getitem__(self, device: int) -> DeviceRelease:
        for d in self.devices:
            if d.device == device:
                return d
        raise KeyError(f"no release record for {device_name(device)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "devices": [d.to_dict() for d in self.devices],
            "gc_collected": self.gc_collected,
            "cublas_cleared": self.cublas_cleared,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        from .render.ledger import render_release

        return render_release(self)


def largest_storages(
    device: int | str, top: int = 5, *, holders: bool = True, paths: int = 5
) -> tuple[RemainingStorage, ...]:
    """The ``top`` largest storages alive on ``device`` and the paths that hold each.

    ``device`` is a CUDA index or ``'cpu'``. One census with one holder search for every
    storage. Keeps no reference.
    """
    found = census.live_tensors(device, holders=holders)
    out = []
    for s in list(found.storages)[:top]:
        what = f"{'saved by autograd ' if not s.python else ''}{s.dtype}{list(s.shape)}"
        held = () if s.holders is None else tuple(s.holders.paths[:paths])
        out.append(RemainingStorage(device, int(s.nbytes), what, held))
    return tuple(out)


def _nvml_used(device: int) -> int | None:
    got = _nvml.query_device(device, _backend.get().device_uuid(device))
    if isinstance(got, _nvml.NvmlDevice) and got.memory is not None:
        return got.memory.used
    return None


def release(
    device: DeviceLike | None = None,
    *,
    clear_cublas: bool = True,
    top: int = 5,
    holders: bool = True,
) -> ReleaseResult:
    """Give this process's unused GPU memory back, and say what could not be freed and why.

    Runs ``gc.collect()``, then (``clear_cublas=True``) frees cuBLAS workspaces, which
    ``empty_cache()`` never does (they come back at the next matmul), then
    ``torch.cuda.empty_cache()``, which empties *every* device's cache. Reports, per device
    this process uses (or ``device``), the bytes freed and still allocated, and the ``top``
    largest remaining storages with the paths that hold them (``holders=False`` skips that
    search). The CUDA context stays until the process exits: nothing frees it.

    Call it between runs, not inside a training step: it synchronizes and empties the cache.
    """
    be = _backend.get()
    devices = be.initialized_devices() if device is None else (resolve_device(device),)
    notes: list[str] = []
    status = _nvml.status()
    before = {d: be.read(d) for d in devices}
    nvml_before = {d: _nvml_used(d) if status.available else None for d in devices}
    collected = gc.collect()
    cleared = False
    if clear_cublas:
        try:
            cleared = be.clear_cublas_workspaces()
        except Exception as exc:
            notes.append(f"clearing cuBLAS workspaces failed: {exc}")
    be.empty_cache()
    records = []
    for d in devices:
        after = be.read(d)
        remaining: tuple[RemainingStorage, ...] = ()
        if after.allocated:
            try:
                remaining = largest_storages(d, top, holders=holders)
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
        devices=tuple(records), gc_collected=collected, cublas_cleared=cleared, notes=tuple(notes)
    )


# --------------------------------------------------------------------------- status


@dataclass(frozen=True, slots=True)
class MachineStatus:
    """Every GPU of the machine as NVML sees it, all processes included (``cudamem status``).

    Per device: ``used`` = driver reserve + each process's memory + driver memory NVML
    lists under no process: other containers' processes, or rounding). Read from NVML only,
    so asking creates no CUDA context.
    """

    nvml: _nvml.NvmlStatus
    devices: tuple[_nvml.NvmlDevice, ...]
    pid: int

    def lines(self, device: _nvml.NvmlDevice) -> list[tuple[str, int | None, str]]:
        """``(label, bytes, what frees it)`` rows of one device, adding up to NVML used."""
        mem = device.memory
        if mem is None:
            return []
        rows: list[tuple[str, int | None, str]] = [
            ("driver reserve", mem.reserved, FREES["driver_reserve"])
        ]
        known = mem.reserved or 0
        # This process first, then the others by size (unknown sizes last).
        procs = sorted(
            device.processes or (),
            key=lambda p: (p.pid != self.pid, -(p.used if p.used is not None else -1)),
        )
        for proc in procs:
            who = f"pid {proc.pid}" + (f" {proc.name}" if proc.name else "")
            if proc.pid == self.pid:
                who += " (this process)"
            rows.append((who, proc.used, FREES["other_process"]))
            known += proc.used or 0
        rows.append(
            ("driver memory outside every process", mem.used - known, FREES["unattributed"])
        )
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "nvml": self.nvml.to_dict(),
            "pid": self.pid,
            "devices": [
                {
                    **d.to_dict(),
                    "lines": [
                        {"label": label, "bytes": n, "frees": frees}
                        for label, n, frees in self.lines(d)
                    ],
                }
                for d in self.devices
            ],
        }

    def __str__(self) -> str:
        from .render.ledger import render_machine_status

        return render_machine_status(self)


def machine_status() -> MachineStatus:
    """The whole machine's GPUs, every process included, from NVML. Never raises."""
    status = _nvml.status()
    found = _nvml.query_all() if status.available else status
    devices = found if isinstance(found, tuple) else ()
    if isinstance(found, _nvml.NvmlStatus) and status.available:
        status = found
    return MachineStatus(status, devices, os.getpid())
