"""OOM post-mortems rendered from hand-built reports."""

from __future__ import annotations

import pytest

from cudamem.render.oom import render_oom

from ..built import GiB, culprit, oom_report, utc  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("utc")


def test_full_report() -> None:
    held = culprit(
        "__main__.cache", tensors=1, storages=1, nbytes=8 * GiB, autograd_bytes=0, example=""
    )
    r = oom_report(culprits=(held,))
    assert render_oom(r) == str(r)
    assert str(r).splitlines() == [
        "=== cudamem OOM post-mortem (2026-12-01T10:00:00, span 'train_step') ===",
        "OutOfMemoryError on cuda:0: tried to allocate 2.0 GiB",
        "  device: 80.0 GiB total, 1.0 GiB free",
        "  PyTorch: 70.0 GiB allocated, 78.0 GiB reserved, 8.0 GiB cached",
        "  fragmentation: 75% (largest free block 512.0 MiB, 6.0 GiB free inside segments still "
        "in use)",
        "  this process outside PyTorch's allocator: 700.0 MiB",
        "  other processes: 324.0 MiB",
        "  stranded cache: 64.0 MiB on stream 0x7f00 (2 segments, no live tensor)",
        "largest live storages:",
        "    bytes  tensor                     held by",
        "  -------  -------------------------  "
        "-------------------------------------------------------------------",
        "  8.0 GiB  float16[4×1024×1024×1024]  __main__.cache['kv'] (+1 more)  "
        "[allocated at train.py:42 in build]",
        "  1.0 GiB  float16[scalar]            no holder reachable from Python",
        "held by:",
        "  __main__.cache: 1 tensor, 8.0 GiB",
        "what to do:",
        "  - free the cache: del cache['kv']",
    ]


def test_unknowns_read_na_and_absent_parts_are_left_out() -> None:
    r = oom_report(
        source="sys.excepthook",
        device=None,
        requested=None,
        free=None,
        inactive_split=None,
        largest_free_block=None,
        fragmentation=None,
        non_pytorch=None,
        other_processes=None,
        stranded=(),
        storages=(),
        advice=(),
        notes=("no allocator snapshot",),
        file="/tmp/oom-1.txt",
    )
    assert str(r).splitlines() == [
        "=== cudamem OOM post-mortem (2026-12-01T10:00:00, sys.excepthook) ===",
        "OutOfMemoryError on cuda:?: tried to allocate n/a",
        "  device: 80.0 GiB total, n/a free",
        "  PyTorch: 70.0 GiB allocated, 78.0 GiB reserved, 8.0 GiB cached",
        "note: no allocator snapshot",
        "(also written to /tmp/oom-1.txt)",
    ]


def test_cache_unknown_without_both_counters() -> None:
    r = oom_report(reserved=None)
    assert r.cache is None
    assert "  PyTorch: 70.0 GiB allocated, n/a reserved, n/a cached" in str(r).splitlines()
