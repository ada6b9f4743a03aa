"""OOM post-mortems on a real GPU: a forced 200 GiB allocation on an H200.

Run with ``pytest -m cuda tests/gpu/test_oom_cuda.py``. A 1 GiB tensor is kept in a module list,
so the report must name ``tests.gpu.test_oom_cuda.big_holder[0]`` as the largest holder.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cudamem
from cudamem.ledger import oom_guard as _oom_guard
from cudamem.ledger.memviz import auto_dump

pytestmark = pytest.mark.cuda

GiB = 1024**3

big_holder: list[torch.Tensor] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    _oom_guard._last_key = None
    big_holder.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    yield
    if _oom_guard._guard is not None:
        _oom_guard._guard.uninstall()
    big_holder.clear()
    gc.collect()
    torch.cuda.empty_cache()


def test_forced_oom_in_span_names_largest_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    guard = cudamem.on_oom(tmp_path / "oom.txt", record_history=True, max_entries=10_000)
    # Allocated after install so the history knows where it came from.
    big_holder.append(torch.empty(2 * GiB, dtype=torch.uint8, device="cuda"))
    with pytest.raises(torch.OutOfMemoryError) as info, cudamem.track("huge"):
        torch.empty(200 * GiB, dtype=torch.uint8, device="cuda")
    assert "Tried to allocate 200.00 GiB" in str(info.value)
    report = guard.last_report
    assert report is not None
    assert report.source == "span 'huge'"
    assert report.requested == 200 * GiB
    assert report.total is not None and report.total < 200 * GiB
    assert report.allocated is not None and report.allocated >= 3 * GiB
    top = report.storages[0]
    assert top.nbytes == 2 * GiB
    assert top.paths[0] == "tests.gpu.test_oom_cuda.big_holder[1]"
    assert top.allocated_at is not None and "test_oom_cuda.py" in top.allocated_at
    assert report.storages[1].paths[0] == "tests.gpu.test_oom_cuda.big_holder[0]"
    assert "more than the GPU has" in report.advice[0]
    err = capsys.readouterr().err
    assert err.count("=== cudamem OOM post-mortem") == 1
    assert "tests.gpu.test_oom_cuda.big_holder[1]" in (tmp_path / "oom.txt").read_text()
    assert guard.events and guard.events[-1].requested >= 200 * GiB  # the observer fired
    guard.uninstall()
    assert not torch._C._cuda_isHistoryEnabled()  # type: ignore[attr-defined]


def test_forced_oom_through_excepthook(capsys: pytest.CaptureFixture[str]) -> None:
    previous = sys.excepthook
    sys.excepthook = lambda *args: None  # stands for the interpreter's traceback printer
    try:
        guard = cudamem.on_oom()
        try:
            torch.empty(200 * GiB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        report = guard.last_report
        assert report is not None and report.source == "sys.excepthook"
        assert report.storages[0].paths[0] == "tests.gpu.test_oom_cuda.big_holder[0]"
        assert "tests.gpu.test_oom_cuda.big_holder[0]" in capsys.readouterr().err
        guard.uninstall()
    finally:
        sys.excepthook = previous


def test_auto_dump_writes_a_snapshot_on_a_real_allocator_oom(tmp_path: Path) -> None:
    """A request far above the H200's capacity runs the allocator's real OOM observer: the
    guard writes one snapshot that names the 1 GiB block by its holder, and after
    ``uninstall`` a second OOM writes nothing."""
    with auto_dump(tmp_path / "dumps", max_dumps=3, record_history=True) as guard:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(200 * GiB, dtype=torch.uint8, device="cuda")
        assert len(guard.files) == 1
    files = sorted((tmp_path / "dumps").glob("cudamem-oom-*.pickle"))
    assert [str(f) for f in files] == list(guard.files)
    snap = cudamem.load_snapshot(files[0])
    held = [
        b["frames"][0]["name"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["size"] >= GiB and b.get("frames")
    ]
    assert any(name.endswith("big_holder[0]") for name in held), held
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(200 * GiB, dtype=torch.uint8, device="cuda")
    assert len(list((tmp_path / "dumps").iterdir())) == 1
