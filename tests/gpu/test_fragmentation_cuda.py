"""Fragmentation on the H200: an OOM with half of the reserved memory free, diagnosed as
fragmentation that ``expandable_segments:True`` would have avoided; the same pattern run
under expandable segments (a process of its own) succeeds.

Run with ``pytest -m cuda tests/gpu/test_fragmentation_cuda.py``. A per-process memory
fraction keeps the pattern to ~4 GiB whatever else the GPU holds.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.ledger import oom_guard as _oom_guard
from cudamem.ledger.free_space import FRAGMENTATION

from . import fragment_pattern as pattern

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
NEEDED = pattern.PIECES * pattern.PIECE + 4 * 1024**3


@pytest.fixture
def limited() -> Iterator[None]:
    if torch.cuda.mem_get_info()[0] < NEEDED:
        pytest.skip("the GPU has too little free memory for the pattern")
    pattern.limit_memory()
    try:
        yield
    finally:
        if _oom_guard._guard is not None:
            _oom_guard._guard.uninstall()
        gc.collect()
        pattern.unlimit_memory()


def test_oom_with_half_the_cache_free_is_fragmentation(limited: None) -> None:
    if _backend.expandable_segments():
        pytest.skip("this process runs under expandable segments: the pattern does not fail")
    guard = cudamem.on_oom(stderr=False)
    kept = pattern.fragment()
    message = ""
    try:
        torch.empty(pattern.REQUEST, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        message = str(exc)
        from_exception = cudamem.fragmentation(oom=exc)
    assert message, "the request did not run out of memory"
    guard.uninstall()
    observed = cudamem.fragmentation()
    ledger = cudamem.explain(0)[0]
    del kept
    for f in (from_exception, observed, ledger.fragmentation):
        assert f is not None and not f.expandable
        default = f.pool()
        assert default is not None
        # more than 20 % of what it reserved is free: the 10 holes, 2000 MiB
        assert default.free > 0.2 * default.reserved
        assert default.stranded >= pattern.PIECES // 2 * pattern.PIECE
        j = f.oom
        assert j is not None and j.requested == pattern.REQUEST
        assert j.largest_free < pattern.REQUEST <= j.cache_free
        assert j.device_free is not None and j.device_free < pattern.REQUEST
        assert j.verdict == FRAGMENTATION and j.expandable_would_help
        assert "expandable_segments:True would have avoided it" in str(f)
    assert observed.oom is not None and observed.oom.source == "the allocator's OOM observer"
    assert "cuda:0 fragmentation:" in str(ledger)


def test_the_same_pattern_runs_under_expandable_segments() -> None:
    if torch.cuda.mem_get_info()[0] < NEEDED:
        pytest.skip("the GPU has too little free memory for the pattern")
    env = dict(
        os.environ,
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.fragment_pattern"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ran"] and result["expandable"]
    # the same holes: half of the segment free, no block as large as the request
    assert result["free_before"] > 0.2 * result["reserved_before"]
    assert result["largest_free_before"] < pattern.REQUEST
