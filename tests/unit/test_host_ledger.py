"""The pinned pool's arithmetic from recorded ``host_memory_stats()`` figures, the host
section's text, and ``release(host=True)`` at the ``_backend`` seam."""

from __future__ import annotations

from typing import Any

import pytest

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.host import ledger as host_ledger
from cudamem.host import procfs as _procfs
from cudamem.host.ledger import HostLedger, build_pinned, round_pinned
from cudamem.host.workers import LoaderReport, WorkerMemory
from tests.fakes import FakeAllocator
from tests.procfs_fakes import FakeProc, rollup

MiB = 1024**2
GiB = 1024**3

#: What the H200 host reported after pinning 600 MiB and 1,100 MiB and freeing 600 MiB's
#: tensor (its block stays cached): 1 GiB + 2 GiB owned, 2 GiB handed out.
STATS_AFTER_FREE = {
    "active_bytes.current": 2 * GiB,
    "active_bytes.freed": -14,
    "allocated_bytes.current": 3 * GiB,
    "allocations.current": 2,
    "active_requests.current": 1,
}


@pytest.mark.parametrize(
    ("asked", "taken"),
    [(600 * MiB, GiB), (1100 * MiB, 2 * GiB), (GiB, GiB), (1, 1), (3, 4), (0, 0)],
)
def test_blocks_are_rounded_up_to_a_power_of_two(asked: int, taken: int) -> None:
    assert round_pinned(asked) == taken


def test_the_pool_splits_in_use_from_cached_and_names_the_rounding() -> None:
    pool = build_pinned(STATS_AFTER_FREE, (1100 * MiB,), "torch.accelerator.empty_host_cache()")
    assert (pool.in_use, pool.cached, pool.owned, pool.blocks) == (2 * GiB, GiB, 3 * GiB, 2)
    assert pool.requested == 1100 * MiB and pool.rounding == 2 * GiB - 1100 * MiB
    text = str(pool)
    assert text.startswith("pinned pool: 2.0 GiB in use, 1.0 GiB cached (3.0 GiB pinned")
    assert "rounding each block up to a power of two added 948.0 MiB" in text
    assert "cudamem.release(host=True) / torch.accelerator.empty_host_cache()" in text
    # The negative historical counter is named, not read.
    assert "active_bytes.freed = -14" in text


def test_active_bytes_no_live_tensor_explains_are_a_note_and_count_as_cached() -> None:
    pool = build_pinned(STATS_AFTER_FREE, (), None)
    assert pool.rounding == 0 and pool.requested == 0
    assert (pool.in_use, pool.cached) == (0, 3 * GiB)
    assert any(
        n.startswith(f"{2 * GiB} bytes counted active by host_memory_stats() belong to no live")
        for n in pool.notes
    )
    assert "only the process exiting" in str(pool)


class PinnedBackend(FakeAllocator):
    """A fake allocator with a pinned pool: ``empty_host_cache`` drops the cached blocks."""

    def __init__(self, stats: dict[str, Any] | None) -> None:
        super().__init__()
        self.stats = stats
        self.emptied = 0

    def host_pool_stats(self) -> dict[str, Any] | None:
        return None if self.stats is None else dict(self.stats)

    def pinned_sizes(self) -> tuple[int, ...] | None:
        return (1100 * MiB,)

    def empty_host_cache(self) -> str | None:
        self.emptied += 1
        if self.stats is not None:
            self.stats["allocated_bytes.current"] = self.stats["active_bytes.current"]
        return "torch._C._host_emptyCache()"


def test_release_host_empties_the_pinned_cache_and_names_what_it_freed() -> None:
    backend = PinnedBackend(dict(STATS_AFTER_FREE))
    fake = FakeProc({(4, "smaps_rollup"): rollup(4 * GiB, 4 * GiB, 4 * GiB)})
    with _backend.use(backend), _procfs.use(fake):
        result = host_ledger.empty_pinned_cache()
    assert backend.emptied == 1
    assert result.call == "torch._C._host_emptyCache()"
    assert result.freed == GiB
    assert result.after is not None and result.after.cached == 0
    assert str(result).startswith(
        "pinned cache: freed 1.0 GiB with torch._C._host_emptyCache(), 2.0 GiB stays in use"
    )


def test_release_host_with_nothing_pinned_says_so_and_calls_nothing() -> None:
    backend = PinnedBackend(None)
    with _backend.use(backend):
        result = cudamem.release(host=True, holders=False)
    assert backend.emptied == 0
    assert result.host is not None and result.host.call is None
    assert "pinned cache: not emptied: not measured: CUDA is not initialised" in str(result)
    with _backend.use(backend):
        assert cudamem.release(holders=False).host is None


def test_release_and_explain_name_a_bad_host_argument() -> None:
    with pytest.raises(TypeError, match="host"):
        cudamem.release(host="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host"):
        cudamem.explain(host=1)  # type: ignore[arg-type]


def _process(pid: int, uss: int) -> Any:
    return _procfs.ProcessMemory(pid, rss=800 * MiB, pss=uss + 100 * MiB, uss=uss)


def test_the_host_section_sums_the_live_workers() -> None:
    w0 = WorkerMemory(0, 11, _process(11, 12 * MiB), _process(11, 226 * MiB))
    w1 = WorkerMemory(1, 12, _process(12, 12 * MiB), _process(12, 232 * MiB))
    gone = WorkerMemory(2, 13, _process(13, 12 * MiB), _process(13, 100 * MiB), exited=True)
    loader = LoaderReport(1, "Items", "fork", False, (w0, w1, gone))
    ledger = HostLedger(
        process=_process(10, 300 * MiB),
        pinned=build_pinned(STATS_AFTER_FREE, (1100 * MiB,), None),
        pinned_reason="",
        cpu=host_ledger.CpuTensors(0, 0, ()),
        loaders=(loader,),
    )
    assert ledger.workers_uss == 458 * MiB and ledger.workers_pss == 658 * MiB
    text = str(ledger)
    assert text.startswith(
        "host, this process (pid 10: RSS 800.0 MiB, PSS 400.0 MiB, USS 300.0 MiB)"
    )
    assert "DataLoader workers: 2 live workers, USS 458.0 MiB, PSS 658.0 MiB in all" in text
    assert "grew by 522.0 MiB in all (+214.0 MiB, +220.0 MiB, +88.0 MiB per worker)" in text
    assert "CPU tensors: 0 B in 0 storages" in text


def test_the_host_section_without_proc_or_cuda_says_why() -> None:
    fake = FakeProc()
    fake.has_proc = False
    with _backend.use(PinnedBackend(None)), _procfs.use(fake):
        ledger = host_ledger.measure_host(holders=False, loaders=False)
    text = str(ledger)
    assert "not measured: no /proc on this system" in text
    assert "pinned pool: not measured: CUDA is not initialised in this process" in text
    assert "DataLoader workers: none running" in text


def test_status_reads_a_process_and_sums_its_children() -> None:
    fake = FakeProc({(100, "comm"): "python\n", (100, "task/100/children"): "101 102"})
    fake.set(100, uss=300 * MiB, pss=400 * MiB, rss=800 * MiB, minflt=0)
    fake.set(101, uss=226 * MiB, pss=300 * MiB, rss=800 * MiB, minflt=0)
    fake.set(102, uss=232 * MiB, pss=310 * MiB, rss=800 * MiB, minflt=0)
    with _procfs.use(fake):
        status = cudamem.machine_status(pids=[100, 7])
    tree, gone = status.host
    assert [c.pid for c in tree.children] == [101, 102] and tree.name == "python"
    assert (tree.children_uss, tree.children_pss) == (458 * MiB, 610 * MiB)
    assert gone.process.reason == "pid 7 has exited" and gone.children == ()
    text = str(status)
    assert "pid 100 python" in text and "its 2 children (DataLoader workers?)" in text
    assert "610.0 MiB  458.0 MiB" in text and "pid 7 has exited" in text


def test_status_names_bad_pids() -> None:
    with pytest.raises(TypeError, match="pids must be a sequence of positive int"):
        cudamem.machine_status(pids=["12"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pids"):
        cudamem.machine_status(pids=[0])


def test_the_reading_process_is_never_counted_as_a_child() -> None:
    import os

    me = os.getpid()
    fake = FakeProc({(100, "task/100/children"): f"{me} 101"})
    for pid in (100, 101, me):
        fake.set(pid, uss=MiB, pss=MiB, rss=MiB, minflt=0)
    with _procfs.use(fake):
        tree = host_ledger.process_tree(100)
    assert [c.pid for c in tree.children] == [101]
