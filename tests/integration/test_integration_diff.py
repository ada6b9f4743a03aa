"""``cudamem.diff``: censuses of real CPU tensors, snapshots, and spans, grouped by holder."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.snapshot import CONTAINER_KEY
from cudamem.growth.compare import DiffEntry, MemoryDiff
from cudamem.holders.census import Census
from cudamem.render.json import to_json

from ..fakes import FakeAllocator
from ..routes import split

MiB = 1024**2

loss_history: list[torch.Tensor] = []
cache: dict[str, torch.Tensor] = {}


@pytest.fixture(autouse=True)
def _clean() -> Any:
    loss_history.clear()
    cache.clear()
    cudamem.configure_leaks()
    yield
    loss_history.clear()
    cache.clear()
    cudamem.configure_leaks()


def census() -> Census:
    return cudamem.live_tensors("cpu", holders=True)


def test_census_diff_groups_growth_by_holder() -> None:
    # Another test's cyclic garbage (a kept traceback's frame and its cells) must not be
    # collected between the two censuses and read as a shrinking group.
    gc.collect()
    cache["table"] = torch.ones(256, 1024)  # 1 MiB, there on both sides
    loss_history.extend(torch.ones(64, 1024) for _ in range(2))  # 2 × 256 KiB
    before = census()
    loss_history.extend(torch.ones(64, 1024) for _ in range(4))  # +4 × 256 KiB
    cache["extra"] = torch.ones(128, 1024)  # +512 KiB under another key of the same dict
    after = census()
    d = cudamem.diff(before, after)
    assert isinstance(d, MemoryDiff) and d.kind == "census"
    history = d.entry(f"{__name__}.loss_history")
    assert (history.before, history.after) == (512 * 1024, 1536 * 1024)
    assert (history.count_before, history.count_after) == (2, 6)
    assert history.delta == MiB
    extra = d.entry(f"{__name__}.cache['extra']")
    assert (extra.before, extra.after, extra.delta) == (0, 512 * 1024, 512 * 1024)
    # The unchanged entry is counted, not listed; the largest growth comes first.
    with pytest.raises(KeyError):
        d.entry(f"{__name__}.cache['table']")
    assert d.unchanged >= 1
    assert d.grew[0] is history and d.shrank == ()
    assert d.delta == after.total - before.total
    text = str(d)
    assert f"{__name__}.loss_history" in text and "+1.0 MiB" in text and "2 → 6" in text


def test_census_diff_sees_what_shrank() -> None:
    loss_history.extend(torch.ones(64, 1024) for _ in range(4))
    before = census()
    del loss_history[:3]
    after = census()
    d = cudamem.diff(before, after)
    e = d.entry(f"{__name__}.loss_history")
    # Only this test's holders: the census sees every CPU storage of the process, and a
    # storage an earlier test left to gc may go in between (the suite runs in any order).
    mine = [x for x in (*d.shrank, *d.grew) if x.holder.startswith(__name__)]
    assert e.delta == -3 * 256 * 1024 and e in d.shrank and mine == [e]


def test_censuses_without_holders_are_grouped_as_unnamed() -> None:
    # A storage an earlier test left to gc must not go between the two censuses (a 800 B
    # one did, once, in a parallel run): collect it first.
    gc.collect()
    before = cudamem.live_tensors("cpu")
    loss_history.append(torch.ones(64, 1024))
    after = cudamem.live_tensors("cpu")
    d = cudamem.diff(before, after)
    assert d.entry("(no holder reachable from Python)").delta == 256 * 1024
    assert any("holders=True" in n for n in d.notes)


def _snapshot(blocks: list[tuple[int, str | None, str | None]]) -> dict[str, Any]:
    """Live blocks of the given size, each with a holder frame (as ``dump_snapshot`` writes
    it: the path and its container) and/or an allocation frame."""
    out = []
    address = 1 << 30
    for size, holder, site in blocks:
        frames: list[dict[str, Any]] = []
        if holder is not None:
            container = split(holder.split(" (+")[0]).container
            frames.append(
                {"filename": "cudamem holder", "line": 0, "name": holder, CONTAINER_KEY: container}
            )
        if site is not None:
            frames.append({"filename": site, "line": 12, "name": "step"})
        out.append(
            {
                "device": 0,
                "address": address,
                "total_size": size,
                "stream": 0,
                "blocks": [
                    {
                        "address": address,
                        "size": size,
                        "requested_size": size,
                        "state": "active_allocated",
                        "frames": frames,
                    }
                ],
            }
        )
        address += size
    return {"segments": out, "device_traces": [[]]}


def test_snapshot_diff_uses_holder_frames_then_allocation_sites(tmp_path: Path) -> None:
    a = _snapshot([(2 * MiB, "__main__.losses[0]", "train.py"), (MiB, None, "train.py")])
    b = _snapshot(
        [
            (2 * MiB, "__main__.losses[0]", "train.py"),
            (2 * MiB, "__main__.losses[1] (+1 more)", "train.py"),
            (MiB, None, "train.py"),
            (4 * MiB, None, None),
        ]
    )
    path = tmp_path / "b.pickle"
    import pickle

    path.write_bytes(pickle.dumps(b))
    d = cudamem.diff(a, path)  # a dict and a file
    assert d.kind == "snapshot"
    assert d.entry("__main__.losses").delta == 2 * MiB
    assert d.entry("__main__.losses").count_after == 2
    assert d.entry("(blocks without holder or allocation stack)").after == 4 * MiB
    with pytest.raises(KeyError):
        d.entry("allocated at train.py:12 in step")  # the same on both sides
    assert (d.before_total, d.after_total) == (3 * MiB, 9 * MiB)
    assert any("reserved" in n for n in d.notes)


def test_snapshot_diff_of_dumped_files(tmp_path: Path) -> None:
    """Two dump_snapshot() files of a fake GPU whose blocks are real CPU tensors."""

    class Fake(FakeAllocator):
        storages = "cpu"

        def history_snapshot(self) -> dict[str, Any]:
            blocks = [t.untyped_storage() for t in loss_history]
            return {
                "segments": [
                    {
                        "device": 0,
                        "address": s.data_ptr(),
                        "total_size": s.nbytes(),
                        "stream": 0,
                        "blocks": [
                            {
                                "address": s.data_ptr(),
                                "size": s.nbytes(),
                                "requested_size": s.nbytes(),
                                "state": "active_allocated",
                                "frames": [],
                            }
                        ],
                    }
                    for s in blocks
                ],
                "device_traces": [[]],
            }

    with _backend.use(Fake()):
        loss_history.append(torch.ones(64, 1024))
        cudamem.dump_snapshot(tmp_path / "step1.pickle")
        loss_history.extend(torch.ones(64, 1024) for _ in range(3))
        cudamem.dump_snapshot(tmp_path / "step2.pickle")
    d = cudamem.diff(tmp_path / "step1.pickle", tmp_path / "step2.pickle")
    e = d.entry(f"{__name__}.loss_history")
    assert (e.count_before, e.count_after, e.delta) == (1, 4, 3 * 256 * 1024)


def test_span_diff_compares_what_each_step_left_behind() -> None:
    with cudamem.track("step", leaks=True) as one:
        loss_history.append(torch.ones(64, 1024))
    with cudamem.track("step", leaks=True) as two:
        loss_history.extend(torch.ones(64, 1024) for _ in range(3))
        cache["val"] = torch.ones(32, 1024)
    d = cudamem.diff(one, two)
    assert d.kind == "span"
    e = d.entry(f"{__name__}.loss_history")
    assert (e.before, e.after) == (256 * 1024, 768 * 1024)
    assert d.entry(f"{__name__}.cache['val']").after == 128 * 1024
    assert any("both spans left memory behind" in n for n in d.notes)


def test_span_diff_without_leaks_compares_levels_only() -> None:
    with cudamem.track("a") as a:
        pass
    with cudamem.track("b") as b:
        pass
    d = cudamem.diff(a, b.record)
    # CPU spans measured no device: no level on either side (n/a), not 0 B
    assert d.entries == () and d.before_total is None and d.after_total is None
    assert d.delta is None
    assert str(d).splitlines()[0] == (
        "allocated at span exit: n/a (the first and second spans measured no CUDA device)"
    )
    assert any("leaks=True" in n for n in d.notes)


def test_kinds_must_match_and_be_known() -> None:
    c = cudamem.live_tensors("cpu")
    with pytest.raises(TypeError, match="b must be a census"):
        cudamem.diff(c, {"segments": []})
    with pytest.raises(TypeError, match=r"^a must be"):
        cudamem.diff(42, c)
    with pytest.raises(TypeError, match=r"^b must be"):
        cudamem.diff(c, [1, 2])


def test_diff_result_is_frozen_and_json_ready() -> None:
    d = MemoryDiff("census", 0, 10, (DiffEntry("x", 0, 10, 0, 1, "x[0]"),))
    with pytest.raises(AttributeError):
        d.kind = "span"  # type: ignore[misc]
    assert '"delta": 10' in to_json(d)
    assert list(d) == [d[0]] and len(d) == 1
    assert "no holder group changed" in str(MemoryDiff("census", 0, 0, ()))
