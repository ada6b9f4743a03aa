"""The pytest guide's example (docs/guide/pytest.md): run it with

    pytest -p pytest_cudamem docs/examples/integrations/pytest_limits.py        (plugin not installed)
    pytest docs/examples/integrations/pytest_limits.py                          (pip install cudamem)

``DEVICE`` is ``cpu`` so that it runs anywhere; on a GPU machine set it to ``"cuda"`` (and
the tensors below to ``device="cuda"``).
"""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHE = []


@pytest.mark.limit_gpu_leaks(device=DEVICE)
def test_keeps_a_batch():
    batch = torch.ones(256, 1024, device=DEVICE)
    CACHE.append(batch)  # outlives the test: fails, naming CACHE[0]


@pytest.mark.limit_gpu_leaks(device=DEVICE)
def test_clean():
    batch = torch.ones(256, 1024, device=DEVICE)
    assert batch.sum().item() == 256 * 1024


@pytest.mark.limit_gpu_memory("16 MiB", device=DEVICE)
def test_peak_too_high():
    big = torch.empty(64 * 1024**2, dtype=torch.uint8, device=DEVICE)  # 64 MiB at once
    del big


@pytest.mark.limit_gpu_leaks(warmup=1, device=DEVICE)
def test_first_call_fills_a_cache():
    # A cache filled on the first call is not this test's leak: the warm-up call fills it.
    table = _table()
    assert table.shape == (128, 1024)


_tables = {}


def _table():
    if "t" not in _tables:
        _tables["t"] = torch.zeros(128, 1024, device=DEVICE)
    return _tables["t"]
