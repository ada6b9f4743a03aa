"""The pinned-memory pool on a GPU host: power-of-two rounding, in use against cached, and
``release(host=True)``, checked against ``torch.cuda.host_memory_stats()`` and the process's
RSS from ``/proc``."""

from __future__ import annotations

import gc

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import torch_backend as _torch_backend
from cudamem.host import ledger as host_ledger
from cudamem.host import procfs as _procfs

pytestmark = pytest.mark.cuda

MiB = 1024**2
GiB = 1024**3


def _pool() -> host_ledger.PinnedPool:
    stats = _backend.get().host_pool_stats()
    assert stats is not None, "host_memory_stats() unavailable after pinning"
    return host_ledger.build_pinned(stats, _backend.get().pinned_sizes(), None)


def _rss() -> int:
    rss = _procfs.read_memory().rss
    assert rss is not None
    return rss


@pytest.fixture(autouse=True)
def _empty_pool() -> None:
    torch.cuda.init()
    gc.collect()
    torch.cuda.synchronize()
    _backend.get().empty_host_cache()


@pytest.mark.parametrize(("asked", "taken"), [(600 * MiB, GiB), (1100 * MiB, 2 * GiB)])
def test_pinning_takes_the_next_power_of_two_in_the_pool_and_in_rss(asked: int, taken: int) -> None:
    before, rss0 = _pool(), _rss()
    pinned = torch.empty(asked, dtype=torch.uint8, pin_memory=True)
    after, rss1 = _pool(), _rss()
    stats = torch.cuda.host_memory_stats()
    assert after.in_use - before.in_use == taken
    assert after.owned - before.owned == taken
    assert after.owned == stats["allocated_bytes.current"]
    # torch's active_bytes keeps blocks freed before (the other case's): not compared
    assert (after.requested or 0) - (before.requested or 0) == asked
    assert (after.rounding or 0) - (before.rounding or 0) == taken - asked
    # The whole rounded block is page-locked, so all of it is resident.
    assert rss1 - rss0 >= 0.9 * taken, (rss0, rss1)
    host = cudamem.explain(host=True).host
    assert host is not None and host.pinned is not None
    assert host.pinned.in_use == after.in_use and host.pinned.free_call
    del pinned


def test_a_freed_block_stays_cached_until_release_host_empties_it() -> None:
    pinned = torch.empty(600 * MiB, dtype=torch.uint8, pin_memory=True)
    held = _pool()
    del pinned
    gc.collect()
    torch.cuda.synchronize()
    cached = _pool()
    assert held.in_use - cached.in_use == GiB
    assert cached.cached - held.cached == GiB
    text = str(cudamem.explain(host=True).host)
    assert "pinned pool:" in text and "cudamem.release(host=True) / torch" in text
    rss0 = _rss()
    result = cudamem.release(host=True, holders=False).host
    assert result is not None and result.call == _torch_backend.host_cache_call()
    assert result.freed >= GiB and result.after is not None and result.after.cached == 0
    assert result.rss_before is not None and result.rss_after is not None
    assert rss0 - _rss() >= 0.9 * GiB
    assert "pinned cache: freed" in str(result)


def test_a_pinned_tensor_copied_to_the_gpu_is_in_use_until_freed() -> None:
    src = torch.ones(64 * MiB // 4, pin_memory=True)
    dst = src.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    pool = _pool()
    assert pool.in_use >= 64 * MiB and (pool.requested or 0) >= 64 * MiB
    del src, dst
