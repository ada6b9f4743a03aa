"""The NVML seam: version fallbacks, device matching, and every failure mode (CPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudamem.ledger import nvml as _nvml

from ..nvml_fakes import (
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    NOT_SUPPORTED,
    FakeGpu,
    GiB,
    MiB,
    make_nvml,
)

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(UUID0, used=2 * GiB, processes=[(100, 1 * GiB), (200, 400 * MiB)]),
        FakeGpu(UUID1, used=615 * MiB, processes=[]),
    ]


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_import_cudamem_loads_no_pynvml() -> None:
    # torch may import pynvml itself; drop it and check that cudamem does not bring it back.
    code = (
        "import sys, torch\n"
        "sys.modules.pop('pynvml', None)\n"
        "import cudamem\n"
        "assert 'pynvml' not in sys.modules, 'import cudamem loaded pynvml'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_reads_memory_v2_and_processes_v3() -> None:
    with _nvml.use_module(make_nvml(two_gpus(), names={100: "python"})):
        dev = _nvml.query_device(0, UUID0[4:])
    assert isinstance(dev, _nvml.NvmlDevice)
    assert dev.uuid == UUID0 and dev.index == 0
    assert dev.memory is not None
    assert dev.memory.api == "v2"
    assert dev.memory.used == 2 * GiB
    assert dev.memory.reserved == 615 * MiB
    assert dev.memory.used_excluding_reserve == 2 * GiB - 615 * MiB
    assert dev.process_api == "v3"
    assert dev.processes is not None
    assert [(p.pid, p.name, p.used) for p in dev.processes] == [
        (100, "python", 1 * GiB),
        (200, None, 400 * MiB),
    ]


def test_library_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvml, "_state", _nvml._State())
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    st = _nvml.status()
    assert not st.available
    assert st.reason is not None and "nvidia-ml-py is not installed" in st.reason
    assert "\n" not in st.reason
    assert isinstance(_nvml.query_device(0), _nvml.NvmlStatus)


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (LIBRARY_NOT_FOUND, "no NVIDIA driver"),
        (DRIVER_NOT_LOADED, "driver is not loaded"),
        (NO_PERMISSION, "no permission"),
    ],
)
def test_init_failures_are_one_line(code: int, words: str) -> None:
    with _nvml.use_module(make_nvml(two_gpus(), init_error=code)):
        st = _nvml.status()
        got = _nvml.query_device(0, UUID0)
    assert not st.available
    assert st.reason is not None and words in st.reason and "\n" not in st.reason
    assert isinstance(got, _nvml.NvmlStatus) and got.reason == st.reason


def test_no_driver_here_is_a_line_not_an_exception() -> None:
    # This machine has no NVIDIA driver: the real pynvml fails to load libnvidia-ml.
    st = _nvml.status()
    if st.available:
        pytest.skip("a driver is present")
    assert st.reason and "\n" not in st.reason


def test_process_call_falls_back_v3_to_v2_to_v1() -> None:
    gpus = two_gpus()
    old_driver = {"nvmlDeviceGetComputeRunningProcesses_v3": FUNCTION_NOT_FOUND}
    with _nvml.use_module(make_nvml(gpus, errors=old_driver)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice) and dev.process_api == "v2"

    old_bindings = (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    )
    with _nvml.use_module(make_nvml(gpus, missing=old_bindings)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice) and dev.process_api == "v1"
    assert dev.processes is not None and len(dev.processes) == 2


def test_process_calls_all_missing() -> None:
    missing = tuple(f"nvmlDeviceGetComputeRunningProcesses{v}" for v in ("_v3", "_v2", ""))
    with _nvml.use_module(make_nvml(two_gpus(), missing=missing)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice)
    assert dev.processes is None and dev.processes_reason
    assert dev.memory is not None  # the rest still answers


@pytest.mark.parametrize(
    ("code", "words"), [(NOT_SUPPORTED, "not supported"), (NO_PERMISSION, "no permission")]
)
def test_process_list_errors_are_not_available(code: int, words: str) -> None:
    errors = {"nvmlDeviceGetComputeRunningProcesses_v3": code}
    with _nvml.use_module(make_nvml(two_gpus(), errors=errors)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice)
    assert dev.processes is None  # unknown, not an empty list
    assert dev.processes_reason is not None and words in dev.processes_reason


def test_memory_v2_missing_falls_back_to_v1() -> None:
    errors = {"nvmlDeviceGetMemoryInfo_v2": FUNCTION_NOT_FOUND}
    with _nvml.use_module(make_nvml(two_gpus(), errors=errors)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice) and dev.memory is not None
    assert dev.memory.api == "v1"
    assert dev.memory.used == 2 * GiB
    assert dev.memory.reserved is None  # unknown, never 0
    assert dev.memory.used_excluding_reserve is None


def test_memory_no_permission_is_not_available() -> None:
    errors = {"nvmlDeviceGetMemoryInfo_v2": NO_PERMISSION}
    with _nvml.use_module(make_nvml(two_gpus(), errors=errors)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice)
    assert dev.memory is None and dev.memory_reason and "permission" in dev.memory_reason


def test_wddm_per_process_memory_is_none() -> None:
    gpus = [FakeGpu(UUID0, processes=[(100, None)])]
    with _nvml.use_module(make_nvml(gpus)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice) and dev.processes is not None
    assert dev.processes[0].used is None
    assert any("per-process memory" in n for n in dev.notes)


def test_not_available_sentinel_from_old_bindings_is_none() -> None:
    gpus = [FakeGpu(UUID0, processes=[(100, 2**64 - 1)])]
    with _nvml.use_module(make_nvml(gpus)):
        dev = _nvml.query_device(0, UUID0)
    assert isinstance(dev, _nvml.NvmlDevice) and dev.processes is not None
    assert dev.processes[0].used is None


def test_match_by_torch_uuid_not_index() -> None:
    # torch's device 0 is NVML's device 1 (e.g. CUDA_VISIBLE_DEVICES=1): UUID decides.
    with _nvml.use_module(make_nvml(two_gpus())):
        dev = _nvml.query_device(0, UUID1[4:].upper())
    assert isinstance(dev, _nvml.NvmlDevice) and dev.uuid == UUID1 and dev.index == 1


def test_unknown_torch_uuid_is_a_reason() -> None:
    with _nvml.use_module(make_nvml(two_gpus())):
        got = _nvml.query_device(0, "99999999-0000-0000-0000-000000000000")
    assert isinstance(got, _nvml.NvmlStatus) and got.reason and "UUID" in got.reason


@pytest.mark.parametrize(
    ("visible", "torch_index", "nvml_index"),
    [("1,0", 0, 1), ("1,0", 1, 0), ("GPU-aaaa", 0, 1), (UUID0, 0, 0), (None, 1, 1)],
)
def test_match_through_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, torch_index: int, nvml_index: int
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with _nvml.use_module(make_nvml(two_gpus())):
        dev = _nvml.query_device(torch_index)  # no torch UUID: CUDA not initialised
    assert isinstance(dev, _nvml.NvmlDevice) and dev.index == nvml_index
    assert any("CUDA_VISIBLE_DEVICES" in n for n in dev.notes)


def test_device_hidden_by_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with _nvml.use_module(make_nvml(two_gpus())):
        got = _nvml.query_device(1)
    assert isinstance(got, _nvml.NvmlStatus) and "CUDA_VISIBLE_DEVICES" in (got.reason or "")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0,1", ["0", "1"]),
        ("1, 0", ["1", "0"]),
        ("0,-1,1", ["0"]),
        ("GPU-abc,MIG-def", ["GPU-abc", "MIG-def"]),
        ("NoDevFiles", []),
    ],
)
def test_parse_visible_devices(value: str | None, expected: list[str] | None) -> None:
    assert _nvml.parse_visible_devices(value) == expected


def test_normalize_uuid() -> None:
    assert _nvml.normalize_uuid("GPU-ABC") == "abc"
    assert _nvml.normalize_uuid("MIG-abc") == "abc"
    assert _nvml.normalize_uuid(" abc ") == "abc"


def test_function_missing_from_bindings_entirely() -> None:
    with _nvml.use_module(make_nvml(two_gpus(), missing=("nvmlInit",))):
        st = _nvml.status()
    assert not st.available and st.reason and _nvml.FIX_PACKAGE in st.reason


def test_never_patches_the_module() -> None:
    mod = make_nvml(two_gpus())
    before = dict(vars(mod))
    with _nvml.use_module(mod):
        _nvml.status()
        _nvml.query_device(0, UUID0)
    after = {k: v for k, v in vars(mod).items() if k != "calls"}
    assert after == {k: v for k, v in before.items() if k != "calls"}


# -- the deprecated ``pynvml`` package ---------------------------------------------------


def test_deprecated_package_shadowing_is_named(tmp_path: Path) -> None:
    shim = tmp_path / "pynvml" / "__init__.py"
    shim.parent.mkdir()
    shim.write_text("")
    mod = make_nvml([])
    mod.__file__ = str(shim)
    msg = _nvml.package_problem(
        mod,
        dist_version=lambda name: "11.5.0" if name == "pynvml" else None,
        ml_py_files=lambda: {tmp_path / "site" / "pynvml.py"},
    )
    assert msg is not None
    assert "deprecated" in msg and str(shim) in msg
    assert "pip uninstall pynvml; pip install nvidia-ml-py" in msg


def test_deprecated_wrapper_warning_is_named(tmp_path: Path) -> None:
    real = tmp_path / "pynvml.py"
    real.write_text("")
    mod = make_nvml([])
    mod.__file__ = str(real)
    msg = _nvml.package_problem(
        mod,
        import_warnings=["The pynvml package is deprecated. Please install nvidia-ml-py"],
        dist_version=lambda name: None,
        ml_py_files=lambda: {real.resolve()},
    )
    assert msg is not None and _nvml.FIX_PACKAGE in msg


def test_clean_nvidia_ml_py_has_no_warning(tmp_path: Path) -> None:
    real = tmp_path / "pynvml.py"
    real.write_text("")
    mod = make_nvml([])
    mod.__file__ = str(real)
    msg = _nvml.package_problem(
        mod, dist_version=lambda name: None, ml_py_files=lambda: {real.resolve()}
    )
    assert msg is None


def test_installed_nvidia_ml_py_is_recognised() -> None:
    # The venv has nvidia-ml-py and not the deprecated package: no warning for the real one.
    import pynvml

    assert _nvml.package_problem(pynvml) is None


def test_status_str_is_one_line_when_unavailable() -> None:
    st = _nvml.NvmlStatus(False, "the NVIDIA driver is not loaded")
    assert str(st) == "NVML unavailable: the NVIDIA driver is not loaded"
    assert os.linesep not in str(st)
