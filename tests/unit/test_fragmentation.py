"""Fragmentation as a number: per-pool sums of hand-built and recorded H200 snapshots, the
one OOM rule in each branch, ``cudamem.fragmentation()`` through a fake backend, and its
text, HTML and JSON; the OOM verdict ``explain()``'s ledger states, at each confidence."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.backend_base import PoolOwners
from cudamem.allocator.snapshot import loads_snapshot
from cudamem.allocator.stats import AllocatorStats
from cudamem.ledger import nvml as _nvml
from cudamem.ledger import oom as _oom
from cudamem.ledger import oom_guard as _oom_guard
from cudamem.ledger.free_space import (
    CERTAIN,
    FITS_NOW,
    FRAGMENTATION,
    LIKELY,
    NOT_FRAGMENTATION,
    UNKNOWN,
    UNSURE,
    Fragmentation,
    OomFacts,
    OomJudgement,
    analyze,
    headroom,
    judge_oom,
    oom_verdict,
)
from cudamem.ledger.lines import build_ledger
from cudamem.render.json import to_json

from .. import snapshot_data as sd
from ..fakes import FakeAllocator
from ..nvml_fakes import FakeGpu, make_nvml

MiB = sd.MiB
GiB = 1024 * MiB
A, F, P = sd.A, sd.F, sd.P
DATA = Path(__file__).resolve().parents[1] / "data"


def holes(n: int = 4, size: int = 200 * MiB, **kw: Any) -> list[dict[str, Any]]:
    """One segment of ``2n`` blocks of ``size``, every other one freed: ``n`` holes."""
    return [sd.segment(sd.BASE, [(size, A), (size, F)] * n, **kw)]


def counters(peak_allocated: int, peak_reserved: int, ooms: int = 0) -> AllocatorStats:
    return AllocatorStats(0, 0, 0, 0, 0, peak_allocated, peak_reserved, 0, 0, 0, 0, 0, ooms, 0)


# -- the rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "device_free", "verdict"),
    [
        (200 * MiB, 0, FITS_NOW),  # the largest free block holds it exactly
        (300 * MiB, 0, FRAGMENTATION),  # the cache alone holds it, in pieces
        (800 * MiB, 0, FRAGMENTATION),  # exactly the cache's free bytes
        (900 * MiB, 100 * MiB, FRAGMENTATION),  # cache + device, to the byte
        (900 * MiB + 1, 100 * MiB, NOT_FRAGMENTATION),
        (5 * GiB, 100 * MiB, NOT_FRAGMENTATION),
        (900 * MiB, None, UNKNOWN),  # more than the cache, device unknown
        (300 * MiB, None, FRAGMENTATION),  # ... but within the cache needs no device figure
    ],
)
def test_judge_oom_in_each_branch(requested: int, device_free: int | None, verdict: str) -> None:
    got = judge_oom(
        requested, largest_free=200 * MiB, cache_free=800 * MiB, device_free=device_free
    )
    assert got == verdict


def test_headroom_is_the_device_free_memory_capped_by_the_limit() -> None:
    assert headroom(130 * GiB, 4 * GiB, 3 * GiB) == GiB  # a memory fraction caps it
    assert headroom(2 * GiB, 140 * GiB, 3 * GiB) == 2 * GiB  # other processes cap it
    assert headroom(2 * GiB, None, 3 * GiB) == 2 * GiB
    assert headroom(2 * GiB, 3 * GiB, 4 * GiB) == 0  # over the limit: nothing, never < 0
    assert headroom(None, 4 * GiB, 0) is None


# -- per-pool sums --------------------------------------------------------------------


def test_fragmented_segment_is_stranded_not_releasable() -> None:
    f = analyze(0, holes())
    (pool,) = f.pools
    assert (pool.kind, pool.segments, pool.reserved, pool.allocated) == (
        "default",
        1,
        1600 * MiB,
        800 * MiB,
    )
    assert (pool.stranded, pool.releasable, pool.largest_free, pool.free_blocks) == (
        800 * MiB,
        0,
        200 * MiB,
        4,
    )
    assert f.cached == f.stranded == 800 * MiB and f.largest_free == 200 * MiB


def test_wholly_free_segment_is_releasable_and_its_block_counts_as_largest() -> None:
    segs = [*holes(2), sd.segment(sd.BASE + GiB, [(512 * MiB, F)])]
    pool = analyze(0, segs).pool()
    assert pool is not None
    assert (pool.stranded, pool.releasable, pool.empty_cache_returns) == (
        400 * MiB,
        512 * MiB,
        512 * MiB,
    )
    assert pool.largest_free == 512 * MiB and pool.segments == 2


def test_expandable_pages_match_what_empty_cache_returned_on_the_h200() -> None:
    rec = loads_snapshot((DATA / "h200_expandable.pkl").read_bytes())
    f = analyze(0, rec["before"]["segments"])
    freed = rec["before_stats"]["reserved"] - rec["after_stats"]["reserved"]
    assert f.expandable and f.releasable == freed == 260 * MiB
    assert f.stranded == 28 * MiB  # free parts of pages that also hold a live tensor
    assert f.largest_free == 286 * MiB
    assert f.allocated == rec["before_stats"]["allocated"]
    assert f.reserved == rec["before_stats"]["reserved"]


def test_default_allocator_h200_snapshot_frees_the_whole_free_segment() -> None:
    rec = loads_snapshot((DATA / "h200_default.pkl").read_bytes())
    f = analyze(0, rec["before"]["segments"])
    freed = rec["before_stats"]["reserved"] - rec["after_stats"]["reserved"]
    assert not f.expandable and f.releasable == freed == 286 * MiB
    assert f.reserved == rec["before_stats"]["reserved"]
    assert f.stranded == f.cached - f.releasable


def test_private_pools_are_reported_apart_and_held_ones_return_nothing() -> None:
    held = analyze(0, sd.cudagraph_tree())  # a file's snapshot: every private pool held
    default, tree = held.pools
    assert default.pool_id == (0, 0) and (default.reserved, default.stranded) == (20 * MiB, 4 * MiB)
    assert tree.pool_id == (0, 1) and tree.held and tree.kind == "shared_graph"
    assert (tree.segments, tree.stranded, tree.releasable) == (2, 24 * MiB, 2 * MiB)
    assert tree.empty_cache_returns == 0 and tree.largest_free == 24 * MiB
    free = analyze(0, sd.cudagraph_tree(), owners=PoolOwners())  # no graph uses it any more
    assert free.pools[1].held is False and free.pools[1].empty_cache_returns == 2 * MiB


def test_pending_blocks_are_neither_free_nor_allocated() -> None:
    (pool,) = analyze(0, sd.record_stream_pending()).pools
    assert (pool.allocated, pool.pending, pool.stranded, pool.releasable) == (
        4 * MiB,
        32 * MiB,
        16 * MiB,
        0,
    )
    assert pool.reserved == pool.allocated + pool.pending + pool.stranded + pool.releasable
    assert pool.largest_free == 16 * MiB


def test_at_peak_is_peak_reserved_minus_peak_allocated() -> None:
    f = analyze(0, holes(), stats=counters(3 * GiB, 4 * GiB))
    assert (f.peak_reserved, f.peak_allocated, f.peak_cached) == (4 * GiB, 3 * GiB, GiB)
    assert analyze(0, holes()).peak_cached is None


# -- the last OOM against the cache ---------------------------------------------------


def oom_facts(requested: int, *, limit: int = 1700 * MiB, free: int = 100 * GiB) -> OomFacts:
    return OomFacts(0, requested, limit, free, "the allocator's OOM observer", 2.0)


def test_oom_larger_than_any_hole_is_fragmentation_and_expandable_would_help() -> None:
    f = analyze(0, holes(), oom=oom_facts(300 * MiB))
    j = f.oom
    assert j is not None
    # the memory fraction's limit (1700 MiB) leaves 100 MiB beside the 1600 MiB reserved
    assert (j.largest_free, j.cache_free, j.device_free, j.total_free) == (
        200 * MiB,
        800 * MiB,
        100 * MiB,
        900 * MiB,
    )
    assert j.verdict == FRAGMENTATION and j.expandable_would_help
    text = str(f)
    assert "tried to allocate 300.0 MiB; largest free block 200.0 MiB" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would have avoided it" in text
    # the judgement's own text, indented, is the section's
    assert all(f"  {line}" in text.splitlines() for line in str(j).splitlines())


def test_oom_under_expandable_segments_says_they_are_on_already() -> None:
    f = analyze(0, holes(expandable=True), oom=oom_facts(300 * MiB))
    assert f.oom is not None and f.oom.verdict == FRAGMENTATION
    assert not f.oom.expandable_would_help
    assert "expandable segments are on already" in str(f)
    assert "would have avoided it" not in str(f)


def test_oom_beyond_every_free_byte_is_not_fragmentation() -> None:
    f = analyze(0, holes(), oom=oom_facts(901 * MiB))
    assert f.oom is not None and f.oom.verdict == NOT_FRAGMENTATION
    assert not f.oom.expandable_would_help
    assert "not fragmentation: the request is more than every free byte together" in str(f)


def test_a_free_block_on_another_stream_cannot_serve_the_request() -> None:
    segs = [*holes(), sd.segment(sd.BASE + 2 * GiB, [(8 * MiB, A), (512 * MiB, F)], stream=sd.SIDE)]
    on_current = analyze(0, segs, current_streams=(0,), oom=oom_facts(300 * MiB, free=0))
    assert on_current.oom is not None and on_current.oom.largest_free == 200 * MiB
    assert on_current.oom.verdict == FRAGMENTATION
    assert on_current.largest_free == 512 * MiB  # the pool's figure still names it
    every = analyze(0, segs, oom=oom_facts(300 * MiB, free=0))
    assert every.oom is not None and every.oom.verdict == FITS_NOW
    assert "a free block holds the request now" in str(every)


def test_held_graph_pool_free_bytes_do_not_count_for_the_request() -> None:
    segs = [*holes(1), *sd.cuda_graph_64mib()[3:]]  # the graph's pool: 8 MiB free, held
    f = analyze(0, segs, oom=oom_facts(205 * MiB, limit=0, free=0))
    assert f.oom is not None and f.oom.cache_free == 200 * MiB
    assert f.oom.verdict == NOT_FRAGMENTATION


# -- cudamem.fragmentation() through the backend seam ---------------------------------


class SnapshotFake(FakeAllocator):
    def __init__(self, segments: list[dict[str, Any]], ooms: int = 0) -> None:
        super().__init__(devices=2, contexts=(0,))
        self.segments = segments
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self.ooms = ooms

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        return [s for s in self.segments if s["device"] == device]

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        self.observers.append(observer)
        return True

    def read(self, device: int) -> AllocatorStats:
        stats = super().read(device)
        return stats._replace(peak_allocated=1200 * MiB, peak_reserved=1600 * MiB, ooms=self.ooms)


@pytest.fixture
def fake() -> Iterator[SnapshotFake]:
    _oom._events.clear()
    backend = SnapshotFake(holes())
    with _backend.use(backend):
        yield backend
    if _oom_guard._guard is not None:
        _oom_guard._guard.uninstall()
    _oom._events.clear()


def test_fragmentation_judges_the_observers_last_oom(fake: SnapshotFake) -> None:
    guard = cudamem.on_oom(stderr=False)
    (observer,) = fake.observers
    observer(0, 300 * MiB, 1700 * MiB, 100 * GiB)  # what malloc reports before raising
    guard.uninstall()
    f = cudamem.fragmentation()
    assert isinstance(f, Fragmentation) and f.device == 0
    assert f.stranded == 800 * MiB and f.peak_cached == 400 * MiB
    assert f.oom is not None and f.oom.requested == 300 * MiB
    assert f.oom.source == "the allocator's OOM observer"
    assert f.oom.device_free == 100 * MiB and f.oom.expandable_would_help


def test_fragmentation_judges_a_caught_exception_by_its_message(fake: SnapshotFake) -> None:
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 has a total capacity of "
        "139.81 GiB of which 130.00 GiB is free. 1.66 GiB allowed; Of the allocated memory "
        "800.00 MiB is allocated by PyTorch, and 800.00 MiB is reserved by PyTorch but "
        "unallocated."
    )
    f = cudamem.fragmentation(0, oom=exc)
    assert f.oom is not None and f.oom.source == "the exception's message"
    assert f.oom.requested == 300 * MiB and f.oom.verdict == FRAGMENTATION
    # 1.66 GiB allowed − 1600 MiB reserved
    assert f.oom.device_free == round(1.66 * GiB) - 1600 * MiB


def test_the_observers_exact_figures_win_over_the_rounded_message(fake: SnapshotFake) -> None:
    guard = cudamem.on_oom(stderr=False)
    fake.observers[0](0, 300 * MiB + 4096, 1700 * MiB, 100 * GiB)
    guard.uninstall()
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 ...")
    f = cudamem.fragmentation(oom=exc)
    assert f.oom is not None and f.oom.requested == 300 * MiB + 4096
    assert f.oom.source == "the allocator's OOM observer"


def test_fragmentation_names_a_bad_oom_argument(fake: SnapshotFake) -> None:
    with pytest.raises(ValueError, match="oom must be an out-of-memory error, not builtins"):
        cudamem.fragmentation(oom=RuntimeError("boom"))


def test_an_unrecorded_oom_is_named_in_a_note(fake: SnapshotFake) -> None:
    fake.ooms = 2
    f = cudamem.fragmentation()
    assert f.oom is None
    assert any("counted 2 out-of-memory errors on cuda:0 but none" in n for n in f.notes)


def test_a_device_without_context_reserves_nothing(fake: SnapshotFake) -> None:
    f = cudamem.fragmentation("cuda:1")
    assert f.device == 1 and f.pools == () and f.reserved == 0
    assert "no CUDA context on cuda:1" in f.notes[0]
    assert str(f).splitlines() == [
        "cuda:1 fragmentation: nothing reserved",
        "  note: this process has no CUDA context on cuda:1: nothing is reserved there",
    ]
    assert 1 not in fake.contexts  # reading it created none


# -- rendering ------------------------------------------------------------------------


def test_text_lists_each_pool_the_peaks_and_the_verdict() -> None:
    segs = [*holes(), *sd.cuda_graph_64mib()[3:]]
    f = analyze(0, segs, stats=counters(GiB, 2 * GiB), oom=oom_facts(300 * MiB))
    lines = str(f).splitlines()
    assert lines[0] == (
        "cuda:0 fragmentation: 808.0 MiB of 1.7 GiB reserved is unallocated (47%); "
        "808.0 MiB of it stranded beside live blocks"
    )
    assert lines[3].split() == [
        "default", "1", "1.6", "GiB", "800.0", "MiB", "800.0", "MiB", "800.0", "MiB",
        "0", "B", "200.0", "MiB",
    ]  # fmt: skip
    assert lines[4].split()[:5] == ["private", "(1,", "0)", "cuda_graph,", "held"]
    assert "  at peak: peak reserved 2.0 GiB − peak allocated 1.0 GiB = 1.0 GiB" in str(f)


def test_html_escapes_and_json_carries_the_figures() -> None:
    f = analyze(0, holes(), oom=oom_facts(300 * MiB), notes=("<b>note</b>",))
    html = f._repr_html_()
    assert "<td>800.0 MiB</td>" in html and "&lt;b&gt;note&lt;/b&gt;" in html
    data = json.loads(to_json(f))
    assert data["stranded"] == 800 * MiB and data["largest_free"] == 200 * MiB
    assert data["pools"][0]["empty_cache_returns"] == 0
    assert data["oom"]["verdict"] == "fragmentation" and data["oom"]["expandable_would_help"]
    assert data["oom"]["total_free"] == 900 * MiB


def test_the_ledger_carries_it_as_a_section_below_its_lines() -> None:
    stats = AllocatorStats(0, 800 * MiB, 1600 * MiB, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    f = analyze(0, holes())
    plain = build_ledger(0, stats=stats, nvml=None, pid=1)
    ledger = build_ledger(0, stats=stats, nvml=None, pid=1, fragmentation=f)
    assert ledger.lines == plain.lines and ledger.fragmentation is f
    text = str(ledger)
    assert text.startswith(str(plain))
    assert text[len(str(plain)) :].splitlines()[1] == (
        "cuda:0 fragmentation: 800.0 MiB of 1.6 GiB reserved is unallocated (50%); "
        "800.0 MiB of it stranded beside live blocks"
    )
    assert "fragmentation: 800.0 MiB" in ledger._repr_html_()
    assert json.loads(to_json(ledger))["fragmentation"]["stranded"] == 800 * MiB


def test_the_guide_shows_the_gpu_tests_pattern_as_rendered_now() -> None:
    """docs/guide/nvidia-smi.md's block: the pattern of tests/gpu/test_fragmentation_cuda.py
    (20 blocks of 200 MiB, every other one freed; 96 MiB allowed beside; 300 MiB asked)."""
    page = (DATA.parents[1] / "docs" / "guide" / "nvidia-smi.md").read_text(encoding="utf-8")
    start = page.index("```text\n", page.index("The pattern, modelled block by block")) + 8
    shown = page[start : page.index("```", start)].rstrip("\n")
    f = analyze(
        0,
        holes(10),
        stats=counters(4000 * MiB, 4000 * MiB),
        current_streams=(0,),
        oom=OomFacts(0, 300 * MiB, 4096 * MiB, 138 * GiB, "the allocator's OOM observer", 0.4),
    )
    assert str(f) == shown


# -- the OOM verdict: what explain() says after an out-of-memory error ----------------


def judged(verdict: str, *, expandable: bool = False) -> OomJudgement:
    return OomJudgement(
        0, 300 * MiB, 200 * MiB, 800 * MiB, 100 * MiB, expandable, verdict, "the observer"
    )


@pytest.mark.parametrize(
    ("ooms", "recorded", "stranded", "expected"),
    [
        (0, None, 2000 * MiB, None),  # no OOM: no verdict, however fragmented the cache
        (1, None, 800 * MiB, (FRAGMENTATION, LIKELY)),  # 4x the largest free block, exactly
        (3, None, 2000 * MiB, (FRAGMENTATION, LIKELY)),
        (1, None, 800 * MiB - 1, (UNKNOWN, UNSURE)),  # under 4x: too little to tell
        (1, None, 0, (UNKNOWN, UNSURE)),
        (1, FRAGMENTATION, 0, (FRAGMENTATION, CERTAIN)),  # recorded: the judgement decides
        (0, NOT_FRAGMENTATION, 2000 * MiB, (NOT_FRAGMENTATION, CERTAIN)),  # count reset
        (1, FITS_NOW, 2000 * MiB, (FITS_NOW, UNSURE)),  # freed since: cannot tell
        (1, UNKNOWN, 2000 * MiB, (UNKNOWN, UNSURE)),
    ],
)
def test_oom_verdict_at_each_confidence(
    ooms: int, recorded: str | None, stranded: int, expected: tuple[str, str] | None
) -> None:
    v = oom_verdict(
        0,
        ooms=ooms,
        judged=None if recorded is None else judged(recorded),
        stranded=stranded,
        largest_free=200 * MiB,
        expandable=False,
    )
    assert (None if v is None else (v.cause, v.confidence)) == expected
    if v is not None:
        assert v.expandable_would_help == (v.cause == FRAGMENTATION)
        assert v.requested == (None if recorded is None else 300 * MiB)


def test_no_free_block_at_all_is_never_likely_fragmentation() -> None:
    v = oom_verdict(0, ooms=1, judged=None, stranded=0, largest_free=0, expandable=False)
    assert v is not None and (v.cause, v.confidence) == (UNKNOWN, UNSURE)


@pytest.fixture
def gpu(fake: SnapshotFake, monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotFake]:
    """The fake allocator holding ``holes(10)``: 20 blocks of 200 MiB, every other one
    freed (2000 MiB stranded, largest free block 200 MiB), and NVML seeing this process."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    fake.segments = holes(10)
    fake.alloc(2000 * MiB, 0)
    fake.reserved[0] = 4000 * MiB
    own = 520 * MiB + 4000 * MiB
    nvml = make_nvml([FakeGpu("GPU-0", used=615 * MiB + own, processes=[(os.getpid(), own)])])
    with _nvml.use_module(nvml):
        yield fake


def test_explain_after_no_oom_states_no_verdict(gpu: SnapshotFake) -> None:
    ledger = cudamem.explain(0, host=False)[0]
    f = ledger.fragmentation
    assert f is not None and f.stranded == 2000 * MiB and f.largest_free == 200 * MiB
    assert f.verdict is None  # a clean process never gets a warning
    text = str(ledger)
    assert "verdict" not in text and "expandable_segments" not in text
    assert json.loads(to_json(ledger))["fragmentation"]["verdict"] is None


LIKELY_TEXT = [
    "  out-of-memory verdict on cuda:0: fragmentation (likely)",
    "    the allocator counted 1 out-of-memory error; cudamem recorded none of them",
    "    2.0 GiB of the cache is stranded beside live blocks, in free blocks of at most "
    "200.0 MiB: a request between the two fits in the free bytes together, in no single "
    "free block",
    "    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would likely have avoided it",
    "    cudamem.on_oom() records the next one's size for a certain verdict",
]


def test_explain_after_an_unrecorded_oom_says_likely_fragmentation(gpu: SnapshotFake) -> None:
    gpu.ooms = 1  # torch counted it; no observer was installed
    ledger = cudamem.explain(0, host=False)[0]
    assert ledger.fragmentation is not None
    v = ledger.fragmentation.verdict
    assert v is not None
    assert (v.cause, v.confidence, v.ooms, v.requested) == (FRAGMENTATION, LIKELY, 1, None)
    assert (v.stranded, v.largest_free, v.expandable) == (2000 * MiB, 200 * MiB, False)
    lines = str(ledger).splitlines()
    # Right below the table, where users look; once.
    at = lines.index(LIKELY_TEXT[0])
    assert lines[at - 1].startswith("total of the lines")
    assert lines[at : at + len(LIKELY_TEXT)] == LIKELY_TEXT
    assert sum("out-of-memory verdict" in line for line in lines) == 1
    data = json.loads(to_json(ledger))["fragmentation"]["verdict"]
    assert data["cause"] == "fragmentation" and data["confidence"] == "likely"
    assert data["ooms"] == 1 and data["requested"] is None
    assert data["stranded"] == 2000 * MiB and data["largest_free"] == 200 * MiB
    assert data["expandable_would_help"] is True
    # fragmentation() standalone states the same verdict.
    assert "  " + LIKELY_TEXT[0].strip() in str(cudamem.fragmentation(0)).splitlines()


def test_explain_after_a_recorded_oom_is_certain(gpu: SnapshotFake) -> None:
    gpu.ooms = 1
    guard = cudamem.on_oom(stderr=False)
    gpu.observers[0](0, 300 * MiB, 4096 * MiB, 100 * GiB)  # what malloc reports, then raises
    guard.uninstall()
    ledger = cudamem.explain(0, host=False)[0]
    assert ledger.fragmentation is not None
    v = ledger.fragmentation.verdict
    assert v is not None
    assert (v.cause, v.confidence, v.requested) == (FRAGMENTATION, CERTAIN, 300 * MiB)
    assert v.source == "the allocator's OOM observer"
    lines = str(ledger).splitlines()
    at = lines.index("  out-of-memory verdict on cuda:0: fragmentation (certain)")
    assert lines[at + 1 : at + 3] == [
        "    the last OOM asked for 300.0 MiB (the allocator's OOM observer): it fits in the "
        "free bytes together, in no single free block (largest 200.0 MiB; 2.0 GiB stranded "
        "beside live blocks)",
        "    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would have avoided it",
    ]
    assert "on_oom() records the next one" not in str(ledger)
    assert json.loads(to_json(ledger))["fragmentation"]["verdict"]["confidence"] == "certain"


def test_explain_under_expandable_segments_does_not_suggest_them(
    gpu: SnapshotFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    gpu.ooms = 2
    ledger = cudamem.explain(0, host=False)[0]
    assert ledger.fragmentation is not None
    v = ledger.fragmentation.verdict
    assert v is not None and (v.cause, v.confidence, v.ooms) == (FRAGMENTATION, LIKELY, 2)
    assert v.expandable and not v.expandable_would_help
    text = str(ledger)
    assert "the allocator counted 2 out-of-memory errors" in text
    assert (
        "    expandable segments are on already: the free bytes sit beside live blocks "
        "(partial pages) or on other streams" in text.splitlines()
    )
    assert "expandable_segments:True" not in text


def test_explain_after_an_oom_in_an_unfragmented_cache_is_unsure(gpu: SnapshotFake) -> None:
    gpu.segments = holes(1)  # 200 MiB stranded, largest free block 200 MiB
    gpu.free(1800 * MiB, 0)
    gpu.reserved[0] = 400 * MiB
    gpu.ooms = 1
    ledger = cudamem.explain(0, host=False)[0]
    assert ledger.fragmentation is not None
    v = ledger.fragmentation.verdict
    assert v is not None and (v.cause, v.confidence) == (UNKNOWN, UNSURE)
    text = str(ledger)
    assert "  out-of-memory verdict on cuda:0: cause unknown (unsure)" in text.splitlines()
    assert (
        "    200.0 MiB of the cache is stranded beside live blocks, in free blocks of at most "
        "200.0 MiB: less than 4x the largest, too little to tell fragmentation from a request "
        "larger than the free memory (and memory freed since the OOM hides fragmentation)"
    ) in text.splitlines()
    assert "expandable_segments:True" not in text  # no fix suggested without a cause


def test_the_guide_shows_the_verdict_its_code_prints() -> None:
    """docs/guide/nvidia-smi.md's verdict section: its CPU code block, run, prints its text
    block (4.1 GiB stranded, a largest free block of 500 MiB, one OOM counted)."""
    page = (DATA.parents[1] / "docs" / "guide" / "nvidia-smi.md").read_text(encoding="utf-8")
    section = page[page.index("### After an OOM nothing recorded") :]
    start = section.index("```python\nfrom cudamem.ledger.free_space import oom_verdict") + 10
    code = section[start : section.index("```", start)]
    start = section.index("```text\n", start) + 8
    shown = section[start : section.index("```", start)].rstrip("\n")
    printed: list[str] = []
    exec(code, {"print": lambda v: printed.append(str(v))})  # the page's own code
    assert printed == [shown]
    assert shown.splitlines()[0] == "out-of-memory verdict on cuda:0: fragmentation (likely)"
