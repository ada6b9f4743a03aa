"""``cudamem status``: the machine's GPUs from NVML, every process, lines adding up (CPU)."""

from __future__ import annotations

import json
import os

import pytest

from cudamem.ledger import nvml as _nvml
from cudamem.ledger.status import machine_status
from cudamem.render.json import to_json

from ..nvml_fakes import DRIVER_NOT_LOADED, NO_PERMISSION, FakeGpu, GiB, MiB, make_nvml

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def test_lines_add_up_to_used_with_every_process() -> None:
    me = os.getpid()
    gpus = [
        FakeGpu(
            UUID0,
            used=615 * MiB + 1 * GiB + 400 * MiB + 3 * MiB,
            processes=[(me, 1 * GiB), (200, 400 * MiB)],
        ),
        FakeGpu(UUID1, used=615 * MiB, processes=[]),
    ]
    with _nvml.use_module(make_nvml(gpus, names={200: "python3"})):
        status = machine_status()
    assert status.nvml.available and len(status.devices) == 2
    rows = status.lines(status.devices[0])
    assert rows[0][:2] == ("driver reserve", 615 * MiB)
    labels = [r[0] for r in rows]
    assert f"pid {me}" in labels[1] and "(this process)" in labels[1]
    assert labels[2] == "pid 200 python3"
    assert rows[-1][:2] == ("driver memory outside every process", 3 * MiB)
    assert sum(n or 0 for _, n, _ in rows) == gpus[0].used
    idle = status.lines(status.devices[1])
    assert [r[:2] for r in idle] == [
        ("driver reserve", 615 * MiB),
        ("driver memory outside every process", 0),
    ]
    text = str(status)
    assert "GPU 0 NVIDIA H200: used" in text and "nvidia-smi shows" in text
    assert "pid 200 python3" in text
    data = json.loads(to_json(status))
    assert data["device_lines"][0][0]["nbytes"] == 615 * MiB


def test_unknown_process_memory_stays_unknown() -> None:
    gpus = [FakeGpu(UUID0, used=2 * GiB, processes=[(300, None)])]
    with _nvml.use_module(make_nvml(gpus)):
        status = machine_status()
    rows = status.lines(status.devices[0])
    assert rows[1][1] is None  # not 0
    assert "n/a" in str(status)


@pytest.mark.parametrize("code", [DRIVER_NOT_LOADED, NO_PERMISSION])
def test_nvml_failure_is_one_line(code: int) -> None:
    with _nvml.use_module(make_nvml([FakeGpu(UUID0)], init_error=code)):
        status = machine_status()
    assert not status.nvml.available
    text = str(status)
    assert text.startswith("cudamem status: NVML unavailable:")
    assert "\n" not in text.strip()


@pytest.mark.cuda
def test_status_on_gpu_names_this_process() -> None:
    import torch

    x = torch.ones(1024, 1024, device="cuda:0")
    torch.cuda.synchronize()
    status = machine_status()
    assert status.nvml.available
    dev = status.devices[0]
    rows = status.lines(dev)
    assert dev.memory is not None
    assert sum(n or 0 for _, n, _ in rows) == dev.memory.used
    mine = [r for r in rows if "(this process)" in r[0]]
    assert mine, rows  # NVML lists this process (same PID namespace on the H200 machine)
    assert mine[0][1] is not None and mine[0][1] >= 500 * MiB  # context + segment
    print(status)
    del x
