"""A fake ``pynvml`` module for the NVML seam: recorded figures and every failure mode.

It mirrors nvidia-ml-py's surface that cudamem uses: ``NVMLError`` with a ``value`` code,
``nvmlInit``, device handles by index, UUIDs, ``nvmlDeviceGetMemoryInfo(handle, version=)``
(v2 struct with ``reserved``) and the v3/v2/v1 process calls. Any call can be made to raise
an NVML error code or be removed, as an old driver or old bindings would.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

MiB = 1024**2
GiB = 1024**3

SUCCESS = 0
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 140 * GiB
    used: int = 615 * MiB  # v1 semantics: reserve included
    reserved: int = 615 * MiB
    #: (pid, bytes or None) per process
    processes: list[tuple[int, int | None]] = field(default_factory=list)


def make_nvml(
    gpus: list[FakeGpu],
    *,
    init_error: int | None = None,
    errors: dict[str, int] | None = None,
    missing: tuple[str, ...] = (),
    names: dict[int, str] | None = None,
) -> types.ModuleType:
    """A module that answers like nvidia-ml-py for ``gpus``.

    ``errors`` maps a function name to the NVML code it raises; ``missing`` removes
    functions (old bindings); ``names`` maps pid → process name (others: NotFound).
    """
    errors = errors or {}
    names = names or {}
    mod = types.ModuleType("pynvml")
    mod.__file__ = "/fake/site-packages/pynvml.py"
    mod.NVMLError = NVMLError  # type: ignore[attr-defined]
    mod.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    calls: list[str] = []
    mod.calls = calls  # type: ignore[attr-defined]

    def guard(name: str) -> None:
        calls.append(name)
        if name in errors:
            raise NVMLError(errors[name])

    def nvmlInit() -> None:
        calls.append("nvmlInit")
        if init_error is not None:
            raise NVMLError(init_error)

    def nvmlSystemGetDriverVersion() -> str:
        return "580.00"

    def nvmlDeviceGetCount() -> int:
        guard("nvmlDeviceGetCount")
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(i: int) -> FakeGpu:
        return gpus[i]

    def nvmlDeviceGetHandleByUUID(uuid: str) -> FakeGpu:
        for g in gpus:
            if g.uuid == uuid:
                return g
        raise NVMLError(NOT_FOUND)

    def nvmlDeviceGetUUID(h: FakeGpu) -> bytes:
        return h.uuid.encode()

    def nvmlDeviceGetName(h: FakeGpu) -> str:
        return h.name

    def nvmlDeviceGetMemoryInfo(h: FakeGpu, version: int | None = None) -> Any:
        if version:
            guard("nvmlDeviceGetMemoryInfo_v2")
            used_v2 = h.used - h.reserved
            return types.SimpleNamespace(
                version=version,
                total=h.total,
                reserved=h.reserved,
                free=h.total - h.used,
                used=used_v2,
            )
        guard("nvmlDeviceGetMemoryInfo")
        return types.SimpleNamespace(total=h.total, free=h.total - h.used, used=h.used)

    def procs(name: str) -> Any:
        def fn(h: FakeGpu) -> list[Any]:
            guard(name)
            return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in h.processes]

        return fn

    def graphics(name: str) -> Any:
        def fn(h: FakeGpu) -> list[Any]:
            guard(name)
            return []

        return fn

    def nvmlSystemGetProcessName(pid: int) -> bytes:
        if pid in names:
            return names[pid].encode()
        raise NVMLError(NOT_FOUND)

    funcs: dict[str, Any] = {
        "nvmlInit": nvmlInit,
        "nvmlSystemGetDriverVersion": nvmlSystemGetDriverVersion,
        "nvmlDeviceGetCount": nvmlDeviceGetCount,
        "nvmlDeviceGetHandleByIndex": nvmlDeviceGetHandleByIndex,
        "nvmlDeviceGetHandleByUUID": nvmlDeviceGetHandleByUUID,
        "nvmlDeviceGetUUID": nvmlDeviceGetUUID,
        "nvmlDeviceGetName": nvmlDeviceGetName,
        "nvmlDeviceGetMemoryInfo": nvmlDeviceGetMemoryInfo,
        "nvmlSystemGetProcessName": nvmlSystemGetProcessName,
    }
    for v in ("_v3", "_v2", ""):
        funcs[f"nvmlDeviceGetComputeRunningProcesses{v}"] = procs(
            f"nvmlDeviceGetComputeRunningProcesses{v}"
        )
        funcs[f"nvmlDeviceGetGraphicsRunningProcesses{v}"] = graphics(
            f"nvmlDeviceGetGraphicsRunningProcesses{v}"
        )
    for name, fn in funcs.items():
        if name not in missing:
            setattr(mod, name, fn)
    return mod
