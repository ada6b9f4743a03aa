"""The NVML seam: device memory and per-process usage as nvidia-smi sees them.

This is the only module in cudamem that imports ``pynvml`` (the module that the
``nvidia-ml-py`` package provides). It is imported lazily, on the first query, never at
``import cudamem``, and it is never patched: cudamem only calls it.

Every value NVML cannot give is ``None`` with a reason, never 0. Known causes: no driver or
no GPU, the deprecated ``pynvml`` PyPI package shadowing ``nvidia-ml-py``, an old driver
without a versioned call (``NVMLError_FunctionNotFound``), MIG or vGPU devices and Windows WDDM
(per-process memory not reported), missing permissions, and containers, where NVML lists host
PIDs so this process's PID is not among them.

Tests swap the module with ``use_module`` (a fake ``pynvml``) to drive every failure mode.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from ..base.present import Presented

__all__ = [
    "FIX_PACKAGE",
    "DeviceMemory",
    "GpuProcess",
    "NvmlDevice",
    "NvmlStatus",
    "normalize_uuid",
    "parse_visible_devices",
    "query_device",
    "status",
    "use_module",
]

#: The command that replaces the deprecated ``pynvml`` package with the maintained one.
FIX_PACKAGE = "pip uninstall pynvml; pip install nvidia-ml-py"

# NVML return codes (nvml.h), compared by value so that any binding version works.
_ERR_UNINITIALIZED = 1
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_LIB_RM_VERSION_MISMATCH = 18
_ERR_ARGUMENT_VERSION_MISMATCH = 25

# nvmlMemory_v2: sizeof(nvmlMemory_v2_t) | 2 << 24, for bindings that predate the constant.
_MEMORY_V2 = 0x02000028


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """NVML's memory figures for one device. Bytes are ints.

    ``used`` is ``total - free``: everything not free, *including* the driver's reserve
    (NVML v1 semantics). ``reserved`` is that reserve as ``nvmlDeviceGetMemoryInfo_v2``
    reports it, or ``None`` when only the v1 call exists. nvidia-smi on recent drivers shows
    ``used_excluding_reserve``, which is why it reads 0 MiB on an idle GPU.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("used_excluding_reserve",)

    total: int
    free: int
    used: int
    reserved: int | None
    api: str

    @property
    def used_excluding_reserve(self) -> int | None:
        """``used`` minus the driver reserve (what nvidia-smi shows), ``None`` if unknown."""
        return None if self.reserved is None else self.used - self.reserved


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process NVML lists on a device. ``used`` is ``None`` when NVML cannot tell
    (Windows WDDM, MIG without privileges); ``name`` is ``None`` when the PID is not visible
    from here (another PID namespace)."""

    pid: int
    name: str | None
    used: int | None
    kind: str


@dataclass(frozen=True, slots=True)
class NvmlDevice:
    """What NVML says about one device, with a reason beside every value it could not give."""

    index: int | None
    uuid: str | None
    name: str | None
    memory: DeviceMemory | None
    memory_reason: str | None
    processes: tuple[GpuProcess, ...] | None
    processes_reason: str | None
    process_api: str | None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NvmlStatus(Presented):
    """Whether NVML answers here. ``reason`` is one line when it does not; ``warning`` is set
    when the deprecated ``pynvml`` package is installed (it shadows or wraps nvidia-ml-py)."""

    available: bool
    reason: str | None
    driver_version: str | None = None
    module_file: str | None = None
    warning: str | None = None


# --------------------------------------------------------------------------- loading


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    module: ModuleType | None = None
    #: A module injected by tests; used instead of importing ``pynvml``.
    override: ModuleType | None = None
    initialized: bool = False
    warning: str | None = None
    import_warnings: list[str] = field(default_factory=list)


_state = _State()


def _import_pynvml() -> tuple[ModuleType | None, str | None]:
    """Import ``pynvml`` once, recording the warnings it emits (the deprecated package warns
    on import). Returns the module or a one-line reason."""
    if _state.override is not None:
        return _state.override, None
    if _state.module is not None:
        return _state.module, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import pynvml  # the only import of pynvml in cudamem (import-linter checks it)

            module: ModuleType = pynvml
        except ImportError as exc:
            return None, (
                f"nvidia-ml-py is not installed ({exc}); install it with "
                "'pip install nvidia-ml-py' for device-level figures"
            )
        except Exception as exc:  # a broken install must not break the caller
            return None, f"importing pynvml failed: {type(exc).__name__}: {exc}"
    _state.import_warnings = [str(w.message) for w in caught]
    _state.module = module
    return module, None


def _nvml_ml_py_files() -> set[Path] | None:
    try:
        files = importlib.metadata.files("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        return set()
    if files is None:
        return None
    out = set()
    for f in files:
        with contextlib.suppress(Exception):
            out.add(Path(str(f.locate())).resolve())
    return out


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_problem(
    module: ModuleType,
    *,
    import_warnings: Sequence[str] = (),
    dist_version: Callable[[str], str | None] = _dist_version,
    ml_py_files: Callable[[], set[Path] | None] = _nvml_ml_py_files,
) -> str | None:
    """A one-line warning when ``pynvml`` is not nvidia-ml-py's module, else ``None``.

    The deprecated ``pynvml`` PyPI package (gpuopenanalytics) either ships its own, older
    bindings (< 12, a ``pynvml/`` package without the versioned calls) or, from 12 on, wraps
    nvidia-ml-py and emits a ``FutureWarning`` on import. Both are detected without patching
    anything: by the warning text, by the distribution being installed, and by the module's
    file not belonging to the ``nvidia-ml-py`` distribution.
    """
    deprecated = _dist_version_safe(dist_version, "pynvml")
    warned = any("pynvml package is deprecated" in w for w in import_warnings)
    file = getattr(module, "__file__", None)
    foreign = False
    if file is not None:
        owned = ml_py_files()
        if owned is not None:
            try:
                foreign = Path(file).resolve() not in owned
            except OSError:
                foreign = False
    if foreign and (deprecated is not None or Path(str(file)).name == "__init__.py"):
        return (
            f"pynvml is imported from {file}, which is the deprecated 'pynvml' package "
            f"{deprecated or ''}, not nvidia-ml-py: its bindings may lack the calls cudamem "
            f"needs. Fix: {FIX_PACKAGE}"
        ).replace("  ", " ")
    if warned or deprecated is not None:
        return (
            f"the deprecated 'pynvml' package {deprecated or ''} is installed beside "
            f"nvidia-ml-py (it warns on import and can shadow it). Fix: {FIX_PACKAGE}"
        ).replace("  ", " ")
    return None


def _dist_version_safe(fn: Callable[[str], str | None], name: str) -> str | None:
    try:
        return fn(name)
    except Exception:
        return None


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _is_nvml_error(module: ModuleType, exc: BaseException) -> bool:
    base = getattr(module, "NVMLError", None)
    return isinstance(base, type) and isinstance(exc, base)


def describe_error(exc: BaseException, what: str = "NVML") -> str:
    """A one-line reason for an NVML failure, naming the likely cause."""
    code = _error_code(exc)
    if code == _ERR_LIBRARY_NOT_FOUND:
        return (
            "NVML library (libnvidia-ml.so.1 / nvml.dll) not found: no NVIDIA driver is "
            "installed here, so there is no GPU to measure"
        )
    if code == _ERR_DRIVER_NOT_LOADED:
        return "the NVIDIA driver is not loaded (no GPU, or the kernel module failed to load)"
    if code == _ERR_NO_PERMISSION:
        return f"{what}: no permission (run with access to /dev/nvidia*, or as a privileged user)"
    if code == _ERR_NOT_SUPPORTED:
        return (
            f"{what}: not supported on this device or driver (MIG, vGPU and Windows WDDM "
            "do not report it)"
        )
    if code == _ERR_FUNCTION_NOT_FOUND:
        return f"{what}: the driver is too old for this call"
    if code == _ERR_LIB_RM_VERSION_MISMATCH:
        return "NVML and the kernel driver differ in version (driver updated without a reboot?)"
    if code == _ERR_GPU_IS_LOST:
        return f"{what}: the GPU has fallen off the bus"
    if code == _ERR_NOT_FOUND:
        return f"{what}: not found"
    return f"{what} failed: {type(exc).__name__}: {exc}"


def _ensure_init() -> tuple[ModuleType | None, str | None]:
    """Import and initialise NVML once. Failures are not cached: a driver may appear later."""
    with _state.lock:
        module, reason = _import_pynvml()
        if module is None:
            return None, reason
        if _state.warning is None and _state.override is None:
            with contextlib.suppress(Exception):
                _state.warning = package_problem(module, import_warnings=_state.import_warnings)
        if _state.initialized:
            return module, None
        init = getattr(module, "nvmlInit", None)
        if not callable(init):
            return None, (
                f"pynvml at {getattr(module, '__file__', '?')} has no nvmlInit: not "
                f"nvidia-ml-py. Fix: {FIX_PACKAGE}"
            )
        try:
            # nvmlInit is reference-counted by NVML itself, and other libraries (torch
            # included) may share the module; cudamem never calls nvmlShutdown.
            init()
        except Exception as exc:
            return None, describe_error(exc)
        _state.initialized = True
        return module, None


def status() -> NvmlStatus:
    """Whether NVML can be queried here, and why not in one line. Never raises."""
    try:
        module, reason = _ensure_init()
    except Exception as exc:
        return NvmlStatus(False, f"NVML failed: {type(exc).__name__}: {exc}")
    if module is None:
        return NvmlStatus(False, reason, warning=_state.warning)
    driver = _call_str(module, "nvmlSystemGetDriverVersion")
    return NvmlStatus(
        True,
        None,
        driver_version=driver,
        module_file=getattr(module, "__file__", None),
        warning=_state.warning,
    )


@contextlib.contextmanager
def use_module(module: ModuleType | None) -> Iterator[None]:
    """Use ``module`` instead of importing ``pynvml`` (tests pass a fake); ``None`` restores."""
    with _state.lock:
        saved = (_state.override, _state.initialized, _state.warning)
        _state.override = module
        _state.initialized = False
        _state.warning = None
    try:
        yield
    finally:
        with _state.lock:
            _state.override, _state.initialized, _state.warning = saved


# --------------------------------------------------------------------------- helpers


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _call_str(module: ModuleType, name: str, *args: Any) -> str | None:
    fn = getattr(module, name, None)
    if not callable(fn):
        return None
    try:
        return _text(fn(*args))
    except Exception:
        return None


def normalize_uuid(uuid: str) -> str:
    """``'GPU-8c2f…'``, ``'MIG-…'`` or torch's bare ``'8c2f…'`` → lower-case hex, no prefix."""
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix) :]
            break
    return u


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` → its entries in torch's order, or ``None`` when unset.

    Like the CUDA runtime, parsing stops at the first invalid entry (``'0,1,-1,2'`` sees
    0 and 1); entries are indices or (prefixes of) ``GPU-``/``MIG-`` UUIDs.
    """
    if value is None:
        return None
    out: list[str] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            break
        if item.isdigit():
            out.append(item)
            continue
        if item.lower().startswith(("gpu-", "mig-")):
            out.append(item)
            continue
        break  # '-1', 'NoDevFiles' or junk ends the list, as in the CUDA runtime
    return out


# --------------------------------------------------------------------------- queries


def _handles(module: ModuleType) -> list[tuple[int, Any, str]]:
    count = int(module.nvmlDeviceGetCount())
    out = []
    for i in range(count):
        handle = module.nvmlDeviceGetHandleByIndex(i)
        out.append((i, handle, _text(module.nvmlDeviceGetUUID(handle))))
    return out


def _find_handle(
    module: ModuleType, torch_index: int, torch_uuid: str | None
) -> tuple[int | None, Any, str | None, str | None]:
    """(NVML index, handle, NVML UUID, reason) for torch's device ``torch_index``.

    With torch's UUID (known once CUDA is initialised) the match is exact. Without it, the
    ``CUDA_VISIBLE_DEVICES`` entry at ``torch_index`` decides (index or UUID prefix); an
    unset variable means NVML index ``torch_index``. Indices assume the PCI bus order NVML
    uses, which CUDA follows only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` on mixed machines.
    """
    handles = _handles(module)
    if torch_uuid:
        want = normalize_uuid(torch_uuid)
        for i, handle, uuid in handles:
            if normalize_uuid(uuid) == want:
                return i, handle, uuid, None
        # MIG instances have their own UUID; NVML resolves them directly.
        by_uuid = getattr(module, "nvmlDeviceGetHandleByUUID", None)
        if callable(by_uuid):
            for prefix in ("MIG-", "GPU-"):
                try:
                    handle = by_uuid(prefix + want)
                except Exception:
                    continue
                return None, handle, prefix + want, None
        return None, None, None, f"no NVML device has torch's UUID {torch_uuid}"
    entries = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if entries is None:
        token = str(torch_index)
    elif torch_index < len(entries):
        token = entries[torch_index]
    else:
        return (
            None,
            None,
            None,
            (
                f"cuda:{torch_index} is not among CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
            ),
        )
    if token.isdigit():
        idx = int(token)
        for i, handle, uuid in handles:
            if i == idx:
                return i, handle, uuid, None
        return None, None, None, f"NVML has no device with index {idx}"
    want = normalize_uuid(token)
    matches = [(i, h, u) for i, h, u in handles if normalize_uuid(u).startswith(want)]
    if len(matches) == 1:
        return matches[0][0], matches[0][1], matches[0][2], None
    return None, None, None, f"CUDA_VISIBLE_DEVICES entry {token!r} matches no single GPU"


def _memory(module: ModuleType, handle: Any) -> tuple[DeviceMemory | None, str | None]:
    get = getattr(module, "nvmlDeviceGetMemoryInfo", None)
    if not callable(get):
        return None, "pynvml has no nvmlDeviceGetMemoryInfo"
    version = getattr(module, "nvmlMemory_v2", _MEMORY_V2)
    try:
        info = get(handle, version=version)
        reserved = int(info.reserved)
        return _to_memory(info, reserved, "v2"), None
    except TypeError:
        pass  # bindings older than the ``version`` argument
    except Exception as exc:
        if _is_nvml_error(module, exc) and _error_code(exc) not in (
            _ERR_FUNCTION_NOT_FOUND,
            _ERR_NOT_SUPPORTED,
            _ERR_ARGUMENT_VERSION_MISMATCH,
        ):
            return None, describe_error(exc, "device memory")
    try:
        info = get(handle)
    except Exception as exc:
        return None, describe_error(exc, "device memory")
    return _to_memory(info, None, "v1"), None


def _to_memory(info: Any, reserved: int | None, api: str) -> DeviceMemory:
    total, free = int(info.total), int(info.free)
    # total - free is "everything not free" under both struct versions (the docs disagree
    # across releases on whether v2's ``used`` includes ``reserved``).
    return DeviceMemory(total=total, free=free, used=total - free, reserved=reserved, api=api)


_PROCESS_CALLS = (
    ("v3", "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"),
    ("v2", "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
    ("v1", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"),
)


def _processes(
    module: ModuleType, handle: Any
) -> tuple[tuple[GpuProcess, ...] | None, str | None, str | None]:
    """Compute and graphics processes through the newest call the driver has (v3 → v2 → v1).

    A call missing from the bindings (AttributeError) or from the driver
    (``NVMLError_FunctionNotFound``, argument version mismatch) falls through to the next;
    any other error is final.
    """
    last_reason = "pynvml has no process-listing call"
    for api, compute_name, graphics_name in _PROCESS_CALLS:
        compute = getattr(module, compute_name, None)
        if not callable(compute):
            continue
        try:
            raw = [(p, "compute") for p in compute(handle)]
        except Exception as exc:
            last_reason = describe_error(exc, "process list")
            if _is_nvml_error(module, exc) and _error_code(exc) in (
                _ERR_FUNCTION_NOT_FOUND,
                _ERR_ARGUMENT_VERSION_MISMATCH,
            ):
                continue
            return None, last_reason, None
        graphics = getattr(module, graphics_name, None)
        if callable(graphics):
            # Graphics contexts are optional (headless servers report NotSupported).
            with contextlib.suppress(Exception):
                raw.extend((p, "graphics") for p in graphics(handle))
        return _merge_processes(module, raw), None, api
    return None, last_reason, None


def _merge_processes(module: ModuleType, raw: list[tuple[Any, str]]) -> tuple[GpuProcess, ...]:
    # A process with compute and graphics work appears in both lists with the same figure.
    by_pid: dict[int, GpuProcess] = {}
    for proc, kind in raw:
        pid = int(proc.pid)
        used_raw = getattr(proc, "usedGpuMemory", None)
        # nvidia-ml-py maps NVML_VALUE_NOT_AVAILABLE to None; older bindings pass 2**64-1.
        used = None if used_raw is None or int(used_raw) >= 2**63 else int(used_raw)
        prev = by_pid.get(pid)
        if prev is not None:
            kind = prev.kind if prev.kind == kind else "compute+graphics"
            if prev.used is not None and (used is None or prev.used > used):
                used = prev.used
        name = prev.name if prev is not None else _call_str(module, "nvmlSystemGetProcessName", pid)
        by_pid[pid] = GpuProcess(pid=pid, name=name, used=used, kind=kind)
    return tuple(sorted(by_pid.values(), key=lambda p: p.pid))


def _read_device(
    module: ModuleType, index: int | None, handle: Any, uuid: str | None, notes: list[str]
) -> NvmlDevice:
    """Memory and processes of one NVML device handle (failures become reasons)."""
    memory, memory_reason = _memory(module, handle)
    processes, processes_reason, api = _processes(module, handle)
    if processes is not None and any(p.used is None for p in processes):
        notes.append(
            "NVML reports no per-process memory for some processes (Windows WDDM, MIG "
            "or missing privileges)"
        )
    return NvmlDevice(
        index=index,
        uuid=uuid,
        name=_call_str(module, "nvmlDeviceGetName", handle),
        memory=memory,
        memory_reason=memory_reason,
        processes=processes,
        processes_reason=processes_reason,
        process_api=api,
        notes=tuple(notes),
    )


def query_device(torch_index: int, torch_uuid: str | None = None) -> NvmlDevice | NvmlStatus:
    """NVML's view of torch's device ``torch_index``, or an unavailable ``NvmlStatus``.

    Never raises: every failure becomes a reason beside the value it concerns.
    """
    try:
        module, reason = _ensure_init()
        if module is None:
            return NvmlStatus(False, reason, warning=_state.warning)
        try:
            index, handle, uuid, why = _find_handle(module, torch_index, torch_uuid)
        except Exception as exc:
            return NvmlStatus(False, describe_error(exc, "device lookup"), warning=_state.warning)
        if handle is None:
            return NvmlStatus(False, why, warning=_state.warning)
        notes = []
        if torch_uuid is None:
            notes.append(
                "CUDA is not initialised in this process: device matched through "
                "CUDA_VISIBLE_DEVICES, not by UUID"
            )
        return _read_device(module, index, handle, uuid, notes)
    except Exception as exc:  # cudamem's bookkeeping never raises into the caller
        return NvmlStatus(False, f"NVML failed: {type(exc).__name__}: {exc}")


def query_all() -> tuple[NvmlDevice, ...] | NvmlStatus:
    """Every device NVML sees on this machine (``CUDA_VISIBLE_DEVICES`` ignored), in NVML
    order, or an unavailable ``NvmlStatus``. Creates no CUDA context. Never raises."""
    try:
        module, reason = _ensure_init()
        if module is None:
            return NvmlStatus(False, reason, warning=_state.warning)
        out = [
            _read_device(module, index, handle, uuid, [])
            for index, handle, uuid in _handles(module)
        ]
        return tuple(out)
    except Exception as exc:  # cudamem's bookkeeping never raises into the caller
        return NvmlStatus(False, f"NVML failed: {type(exc).__name__}: {exc}")
