"""The measuring half of cudamem's pytest plugin (the hooks live in ``pytest_cudamem``).

A checked test is judged the way PyTorch's own ``CudaMemoryLeakCheck`` judges its tests, with
holders named instead of a byte count:

1. before the call: ``gc.collect()``, cuBLAS workspaces cleared, ``empty_cache()``; the live
   storages (keys only) and each device's allocated bytes are noted, and the peak counter is
   folded and reset (as spans do, so no span loses its peak);
2. the test runs (after ``warmup`` unjudged calls, which let lazy caches fill);
3. a test that raised is not judged; otherwise, settle again and look up to three times (a
   finalizer or a second ``gc`` pass may free more) for storages created by the call that are
   still alive; the holders of those that remain are named with ``cudamem.who_holds``.

A test fails when those storages hold more than the ``limit_gpu_leaks`` limit, when a
device's allocated bytes grew by more than the limit with no live tensor to show for it, or
when its peak passes the ``limit_gpu_memory`` limit. Nothing here creates a CUDA context.

CPU mode (``device='cpu'``) counts CPU storages instead; PyTorch has no CPU peak counter, so
the peak is read from ``torch.profiler``'s memory events (``profile_memory=True``), which costs
time per operator: it is for CPU-only projects and for testing this plugin in CI.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from ..allocator import backend as _backend
from ..holders.census import LiveStorage, StorageSnapshot, live_refs
from ..spans.span import StepSpan
from .results import MemoryCheck

__all__ = [
    "MemoryCheck",
    "TestMemory",
    "finish",
    "parse_size",
    "start",
]

#: Looks after the call: each one collects garbage and clears the caches first.
RECHECKS = 3
_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, name: str = "limit") -> int:
    """``'512 MiB'`` → 536870912. Binary units (KiB, MiB, GiB, TiB) are powers of 1024,
    decimal ones (KB, MB, GB, TB) powers of 1000; a plain int is bytes."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a size like '512 MiB' or an int, not bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a size like '512 MiB' or an int, not {type(value).__name__}"
        )
    m = _SIZE.match(value)
    unit = (m.group(2) if m else "").lower() or "b"
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a size: use a number and one of B, KiB, MiB, GiB, TiB "
            "(or KB, MB, GB, TB), e.g. '512 MiB'"
        )
    return round(float(m.group(1)) * _UNITS[unit])


# --------------------------------------------------------------------------- results


# --------------------------------------------------------------------------- measuring


def _settle(device: str) -> None:
    gc.collect()
    if device == "cuda":
        backend = _backend.get()
        backend.clear_cublas_workspaces()  # empty_cache() never frees them
        backend.empty_cache()


class _CpuPeak:
    """The peak of CPU allocations made while open, from the profiler's memory events."""

    def __init__(self) -> None:
        self.prof: Any = None
        self.peak: int | None = None
        self.note: str | None = None

    def start(self) -> None:
        try:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        except Exception as exc:  # another profiler is running, or none is available
            self.prof = None
            self.note = f"CPU peak not measured: the profiler could not start ({exc})"

    def stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is None:
            return
        try:
            prof.__exit__(None, None, None)
            events = prof.profiler.kineto_results.events()
            moves = sorted(
                (e.start_ns(), int(e.nbytes()))
                for e in events
                if e.name() == "[memory]" and "CPU" in str(e.device_type())
            )
        except Exception as exc:
            self.note = f"CPU peak not measured: {type(exc).__name__}: {exc}"
            return
        level = peak = 0
        for _, nbytes in moves:
            level += nbytes
            peak = max(peak, level)
        self.peak = peak


@dataclass
class _Baseline:
    device: str
    #: Every storage alive at the start.
    keys: StorageSnapshot
    allocated: dict[int, int]
    cpu_peak: _CpuPeak | None = None
    #: The CUDA peak: a step span of cudamem's own (no history, no growth detection).
    span: StepSpan | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Look:
    """A census of one device type, and each device's allocation count read just before
    it (PyTorch's cumulative ``allocation.all.allocated``)."""

    device: str
    counts: dict[int, int]
    keys: StorageSnapshot


#: The last look of the previous judged test (see ``_baseline``).
_last: list[_Look] = []


def _alloc_counts(device: str) -> dict[int, int] | None:
    """Each initialised CUDA device's allocation count, or ``None`` where they cannot tell
    (CPU mode, an allocator that reports no counts)."""
    if device != "cuda":
        return None
    backend = _backend.get()
    counts = {d: backend.read(d).alloc_count for d in backend.initialized_devices()}
    if not counts or 0 in counts.values():
        return None
    return counts


def _no_cuda_yet(device: str) -> bool:
    """Whether no CUDA storage can exist now: CUDA storages are checked and CUDA has not
    started in this process (no device has a context; a CUDA tensor needs one, so there
    is none to find and the census is skipped: a CPU-only machine pays nothing)."""
    return device == "cuda" and not _backend.get().initialized_devices()


def _look(device: str) -> StorageSnapshot:
    """Every live storage of ``device`` now, remembered (with the allocation counts read
    before it) for the next test's baseline."""
    counts = _alloc_counts(device)
    keys = live_refs(device)
    _last[:] = [] if counts is None else [_Look(device, counts, keys)]
    return keys


def _reused(device: str) -> StorageSnapshot | None:
    """The previous test's last look, when no CUDA allocation happened since it: then every
    storage alive now was alive at that look, and the look serves as this test's baseline
    (a clean test then costs one census instead of two). Storages that a look listed and
    that are gone since are harmless in a baseline."""
    if not _last:
        return None
    last = _last.pop()
    if last.device != device or _alloc_counts(device) != last.counts:
        return None
    return last.keys


def _baseline(device: str, *, peak: bool, reuse: bool = False) -> _Baseline:
    """``reuse``: the previous test's last look may serve (``_reused``)."""
    # A leak check needs no settling here: garbage alive now is in the baseline, and what
    # is collected later was never new. A peak does: it starts from an emptied cache.
    if peak:
        _settle(device)
    backend = _backend.get()
    allocated: dict[int, int] = {}
    if device == "cuda":
        for d in backend.initialized_devices():
            allocated[d] = backend.read(d).allocated
    keys = _reused(device) if reuse else None
    if keys is None and _no_cuda_yet(device):
        keys = StorageSnapshot()
    _last.clear()
    base = _Baseline(device, live_refs(device) if keys is None else keys, allocated)
    if peak and device == "cuda":
        base.span = _peak_span()
    elif peak:
        base.cpu_peak = _CpuPeak()
        base.cpu_peak.start()
    return base


def _peak_span() -> StepSpan:
    """A test's CUDA peak, started: a span of cudamem's own (no history, no growth
    detection); spans the test opens fold their peaks into it as into any open span."""
    step = StepSpan("cudamem test", sync=False, peak=True, hooks=False)
    step.start()
    return step


def _cuda_peaks(base: _Baseline) -> list[tuple[str, int]]:
    """Per device, the most allocated at once beyond the test's start (closes its span)."""
    step, base.span = base.span, None
    span = None if step is None else step.stop()
    if span is None:
        return []
    record = span.record
    return [
        (f"cuda:{d.device}", max(0, (d.peak or 0) - base.allocated.get(d.device, 0)))
        for d in record.devices
    ]


def _nothing_new(base: _Baseline) -> bool:
    """Whether no storage created since ``base`` can be alive, told without a census: every
    storage of the baseline still exists and every CUDA device's allocated bytes are what
    they were, once the cuBLAS workspaces are cleared. A new live storage would occupy an
    allocator block of its own on top of the baseline's (all still held), so the bytes
    would have grown. (Only allocator memory no storage holds, freed during the test and
    taken over by a new storage of the same block size, escapes this, as it escapes the
    allocated-bytes check.) CUDA only; then the baseline serves the next test as this
    test's look would have."""
    if base.device != "cuda" or not base.allocated:
        return False
    backend = _backend.get()
    # A matmul's cuBLAS workspace is held by no tensor: cleared as a settle clears it (it
    # goes back to the allocator's cache, and the next matmul takes it again at once).
    backend.clear_cublas_workspaces()
    stats = [backend.read(d) for d in backend.initialized_devices()]
    if {s.device: s.allocated for s in stats} != base.allocated:
        return False
    counts = {s.device: s.alloc_count for s in stats}
    if 0 in counts.values() or not base.keys.all_alive():  # 0: the allocator cannot tell
        return False
    _last[:] = [_Look(base.device, counts, base.keys)]
    return True


def _survivors(base: _Baseline, *, settle_first: bool) -> tuple[StorageSnapshot, bool]:
    """Storages created since ``base`` that stay alive through a few settle rounds, and
    whether it settled. The first look is without a collection unless ``settle_first``: a
    clean test (nothing new) needs none, and a collection of a large heap is most of what
    the check would cost; a test that left the allocator as it found it needs no census
    either (``_nothing_new``)."""
    new = StorageSnapshot()
    if _no_cuda_yet(base.device) or (not settle_first and _nothing_new(base)):
        return new, False
    settled = False
    for i in range(RECHECKS + 1):
        if i or settle_first:
            _settle(base.device)
            settled = True
        new = _look(base.device).new_since(base.keys)
        if not new:
            break
    return new, settled


def _judge(
    name: str,
    base: _Baseline,
    *,
    leak_limit: int | None,
    memory_limit: int | None,
) -> MemoryCheck:
    notes = list(base.notes)
    peaks: list[tuple[str, int]] = []
    if base.cpu_peak is not None:
        base.cpu_peak.stop()
        if base.cpu_peak.peak is not None:
            peaks.append(("cpu", base.cpu_peak.peak))
        elif base.cpu_peak.note:
            notes.append(base.cpu_peak.note)
    elif base.span is not None:
        peaks.extend(_cuda_peaks(base))
    leaked: tuple[LiveStorage, ...] = ()
    unexplained: list[tuple[str, int]] = []
    total = 0
    if leak_limit is not None:
        for settle_first in (False, True):
            new, settled = _survivors(base, settle_first=settle_first)
            leaked = new.storages(holders=True)
            del new
            total = sum(s.nbytes for s in leaked)
            unexplained = _unexplained(base, leaked, leak_limit) if base.device == "cuda" else []
            if settled or not unexplained:
                break  # else: growth nothing explains may be garbage or a cuBLAS workspace
    return MemoryCheck(
        test=name,
        device=base.device,
        leaked=leaked,
        leaked_bytes=total,
        leak_limit=leak_limit,
        unexplained=tuple(unexplained),
        peaks=tuple(peaks),
        memory_limit=memory_limit,
        notes=tuple(notes),
    )


def _unexplained(
    base: _Baseline, leaked: tuple[LiveStorage, ...], leak_limit: int
) -> list[tuple[str, int]]:
    """Per CUDA device, allocated growth since ``base`` that the leaked storages do not
    account for, where it passes ``leak_limit``."""
    backend = _backend.get()
    per_device: dict[str, int] = {}
    for s in leaked:
        per_device[s.device] = per_device.get(s.device, 0) + s.nbytes
    out = []
    for d in backend.initialized_devices():
        grown = backend.read(d).allocated - base.allocated.get(d, 0)
        rest = grown - per_device.get(f"cuda:{d}", 0)
        if rest > leak_limit:
            out.append((f"cuda:{d}", rest))
    return out


# --------------------------------------------------------------------------- the hooks


@dataclass(frozen=True, slots=True)
class _Spec:
    leak_limit: int | None
    memory_limit: int | None
    warmup: int
    device: str


def _device_arg(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if value not in ("cuda", "cpu"):
        raise pytest.UsageError(f"{where}: device must be 'cuda' or 'cpu', got {value!r}")
    return str(value)


def _spec(item: pytest.Item) -> _Spec:
    leak_limit: int | None = None
    memory_limit: int | None = None
    warmup = 0
    device: str | None = None
    leaks_marker = item.get_closest_marker("limit_gpu_leaks")
    memory_marker = item.get_closest_marker("limit_gpu_memory")
    if leaks_marker is None and memory_marker is None:
        leak_limit = 0  # --cudamem: every test
    for marker in (leaks_marker, memory_marker):
        if marker is None:
            continue
        where = f"@pytest.mark.{marker.name} on {item.nodeid}"
        kwargs = dict(marker.kwargs)
        args = list(marker.args)
        if "limit" in kwargs:
            args.insert(0, kwargs.pop("limit"))
        unknown = sorted(set(kwargs) - {"warmup", "device"})
        if unknown or len(args) > 1:
            raise pytest.UsageError(
                f"{where}: takes (limit, *, warmup=0, device=None); got args {marker.args!r} "
                f"and keywords {sorted(marker.kwargs)!r}"
            )
        try:
            if marker.name == "limit_gpu_leaks":
                leak_limit = parse_size(args[0] if args else 0)
            else:
                if not args:
                    raise ValueError("a limit is required, e.g. limit_gpu_memory('512 MiB')")
                memory_limit = parse_size(args[0])
        except (TypeError, ValueError) as exc:
            raise pytest.UsageError(f"{where}: {exc}") from None
        w = kwargs.get("warmup", 0)
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise pytest.UsageError(f"{where}: warmup must be an int >= 0, got {w!r}")
        warmup = max(warmup, w)
        d = _device_arg(kwargs.get("device"), where)
        if d is not None and device is not None and d != device:
            raise pytest.UsageError(f"{where}: both markers must name the same device")
        device = d or device
    default = item.config.getoption("cudamem_device") or "cuda"
    return _Spec(leak_limit, memory_limit, warmup, device or default)


@dataclass
class Run:
    """A checked test between its start and its judgement."""

    name: str
    spec: _Spec
    base: _Baseline


def measured_nothing(device: str) -> bool:
    """Whether checks of ``device`` storages measure nothing here: ``cuda`` where torch sees
    no CUDA device (the checks then pass unchecked; the terminal summary says so)."""
    return device == "cuda" and _backend.get().device_count() == 0


def start(item: pytest.Item) -> Run | None:
    """Before the call: parse the markers, run the warm-up calls, take the baseline.

    Bad marker arguments raise ``pytest.UsageError``, and an exception of a warm-up call
    fails the test like one of the call itself; ``None`` (no judgement, a warning) when
    cudamem cannot take the baseline.
    """
    spec = _spec(item)
    for _ in range(spec.warmup):
        item.runtest()
    try:
        base = _baseline(spec.device, peak=spec.memory_limit is not None, reuse=True)
    except Exception as exc:
        import warnings

        warnings.warn(f"cudamem could not measure {item.nodeid}: {exc!r}", stacklevel=2)
        return None
    return Run(item.nodeid, spec, base)


def finish(run: Run, *, failed: bool) -> BaseException | None:
    """After the call: the failure to report, or ``None``. A test that raised is not judged."""
    if failed:
        _last.clear()
        if run.base.cpu_peak is not None:
            run.base.cpu_peak.stop()
        _cuda_peaks(run.base)  # close the peak span
        return None
    check = _judge(
        run.name,
        run.base,
        leak_limit=run.spec.leak_limit,
        memory_limit=run.spec.memory_limit,
    )
    if not check.failed:
        return None
    return pytest.fail.Exception(str(check), pytrace=False)


class TestMemory:
    """The ``gpu_memory`` fixture: a baseline taken when the fixture was set up.

    ``check(leak_limit=0, memory_limit=None)`` settles and returns a ``MemoryCheck``
    of the storages created since then that are still alive (the test's own variables
    included: ``del`` them first), and the peak since then.
    """

    __test__ = False  # not a test class, whatever its name

    def __init__(self, name: str, device: str = "cuda") -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        self.name = name
        self.device = device
        self._base = _baseline(device, peak=device == "cuda")
        self._peaks: dict[str, int] = {}

    def check(
        self, leak_limit: int | str = 0, memory_limit: int | str | None = None
    ) -> MemoryCheck:
        """What the test created that is alive now, with holders, and its peak so far."""
        leak = parse_size(leak_limit, "leak_limit")
        memory = None if memory_limit is None else parse_size(memory_limit, "memory_limit")
        was_measuring = self._base.span is not None
        check = _judge(self.name, self._base, leak_limit=leak, memory_limit=memory)
        for device, peak in check.peaks:
            self._peaks[device] = max(peak, self._peaks.get(device, 0))
        if was_measuring:  # keep measuring the peak for a later check
            self._base.span = _peak_span()
        return replace(check, peaks=tuple(sorted(self._peaks.items())))

    def close(self) -> None:
        """Stop measuring (the fixture's teardown)."""
        _cuda_peaks(self._base)
