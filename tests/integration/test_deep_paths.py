"""A deep structure never crashes a search: a path 100,000 steps long is read without
recursion (``cudamem.holders._graph_paths``), and every search answers with the path or says
which limit stopped it (real CPU tensors; ``max_depth`` above the interpreter's recursion limit).

The census and a span's leak capture search with the default limits (``max_depth`` 40);
``deep_census`` raises them for a test, as a caller of the search with a larger bound would.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.holders import census
from cudamem.holders._search_base import SearchLimits
from cudamem.holders.culprits import group_culprits
from cudamem.holders.finder import Holders
from cudamem.render.json import to_json

from ..fakes import FakeAllocator
from ..module_globals import Globals, added_globals

M = __name__
DEPTH = 100_000
#: Limits above the depth and the interpreter's recursion limit; a timeout no search here
#: comes near on this machine (a search that reaches it still has to answer with a note).
LIMITS = SearchLimits(max_depth=DEPTH + 1_000, max_nodes=1_000_000, timeout=120.0)


@pytest.fixture
def g() -> Iterator[Globals]:
    """Module globals for a test; every name it adds is removed afterwards."""
    yield from added_globals(__name__)


@pytest.fixture
def deep_census(monkeypatch: pytest.MonkeyPatch) -> None:
    """The census (and the leak capture, which runs it) searches with ``LIMITS``."""
    monkeypatch.setattr(census, "SearchLimits", lambda: LIMITS)


class CpuFake(FakeAllocator):
    """The fake GPU, whose storages the census looks for on the CPU."""

    storages = "cpu"


def nested(t: torch.Tensor, depth: int) -> list[Any]:
    """``t`` at the bottom of ``depth + 1`` nested one-item lists."""
    x: list[Any] = [t]
    for _ in range(depth):
        x = [x]
    return x


def answered(result: Holders, path: str) -> bool:
    """Whether ``result`` names ``path``; else it must say which limit stopped it, in a note."""
    assert LIMITS.max_depth > sys.getrecursionlimit()
    str(result), json.loads(to_json(result))  # its text and document never raise
    if result.complete:
        return path in result.paths
    assert result.stopped in ("timeout", "max_depth", "max_nodes")
    return any(result.stopped in n or "stopped" in n for n in result.notes)


def storage_of(found: tuple[census.LiveStorage, ...], t: torch.Tensor) -> census.LiveStorage:
    ptr = t.untyped_storage().data_ptr()
    (s,) = [s for s in found if s.data_ptr == ptr]
    return s


# --------------------------------------------------------------------------- 100,000 deep


def test_who_holds_at_the_bottom_of_100000_lists(g: Globals) -> None:
    t = torch.ones(13)
    g["deep"] = nested(t, DEPTH)
    result = cudamem.who_holds(t, max_depth=LIMITS.max_depth, timeout=LIMITS.timeout)
    assert answered(result, f"{M}.deep" + "[0]" * (DEPTH + 1))


def test_who_holds_stopped_by_its_timeout_in_a_deep_walk_says_so(g: Globals) -> None:
    t = torch.ones(14)
    g["deep"] = nested(t, DEPTH)
    result = cudamem.who_holds(t, max_depth=LIMITS.max_depth, timeout=0.5)
    assert result.stopped == "timeout"
    assert any("timeout" in n for n in result.notes)
    assert "found before the search stopped (its timeout)" in str(result).splitlines()[0]


def test_live_tensors_with_holders_at_the_bottom_of_100000_lists(
    g: Globals, deep_census: None
) -> None:
    t = torch.ones(15)
    g["deep"] = nested(t, DEPTH)
    found = cudamem.live_tensors("cpu", holders=True)
    s = storage_of(found.storages, t)
    assert s.holders is not None
    assert answered(s.holders, f"{M}.deep" + "[0]" * (DEPTH + 1))
    str(found), json.loads(to_json(found))


def test_culprit_text_of_a_tensor_100000_lists_deep(g: Globals, deep_census: None) -> None:
    t = torch.ones(16)
    g["deep"] = nested(t, DEPTH)
    s = storage_of(cudamem.live_tensors("cpu", holders=True).storages, t)
    (culprit,) = group_culprits([s])
    assert culprit.holder == f"{M}.deep"
    assert culprit.example == f"{M}.deep" + "[0]" * (DEPTH + 1)
    assert culprit.patterns == (f"{M}.deep" + "[*]" * (DEPTH + 1),)
    assert str(culprit).startswith(f"{M}.deep: 1 tensor, 64 B")


def test_leaks_of_a_span_at_the_bottom_of_100000_lists(g: Globals, deep_census: None) -> None:
    with _backend.use(CpuFake()):
        with cudamem.track("val", leaks=True) as span:
            t = torch.ones(17)
            g["deep"] = nested(t, DEPTH)
            del t
        for report in (span.leaks, cudamem.leaks(since=span)):
            assert not [n for n in report.notes if "failed" in n], report.notes
            assert report.count == 1
            (culprit,) = report.culprits
            assert culprit.holder == f"{M}.deep"
            assert culprit.example == f"{M}.deep" + "[0]" * (DEPTH + 1)
            text = str(report)
            assert text.startswith("val: 1 storage created inside, 68 B")
            assert f"  {M}.deep: 1 tensor, 68 B" in text.splitlines()
            json.loads(to_json(report))


# --------------------------------------------------------------------------- random shapes


class Box:
    """An object holding the next level in an attribute of its ``__dict__``."""


class Slotted:
    """An object holding the next level in a slot."""

    __slots__ = ("back", "item")


def wrap(rng: random.Random, x: Any) -> tuple[Any, str]:
    """One level above ``x`` of a random kind, and the step down to ``x`` as a holder path
    writes it. Some levels are wide (many items, or ``x`` many times); some refer back up
    to the level above (a cycle)."""
    kind = rng.randrange(7)
    wide = rng.random() < 0.02
    width = rng.randrange(2, 2_000) if wide else rng.randrange(1, 4)
    pos = rng.randrange(width)
    out: Any
    if kind == 0:
        out = [[] for _ in range(width)] if wide else [None] * width
        out[pos] = x
        step = f"[{pos}]"
    elif kind == 1:
        out = tuple(x if i == pos else i for i in range(width))
        step = f"[{pos}]"
    elif kind == 2:
        out = {f"k{i}": x if i == pos else {} for i in range(width)}
        step = f"['k{pos}']"
    elif kind == 3:
        out = {i: x if i == pos else None for i in range(width)}
        step = f"[{pos}]"
    elif kind == 4:
        out = Box()
        setattr(out, f"a{pos}", x)
        step = f".a{pos}"
    elif kind == 5:
        out = Slotted()
        out.item = x
        step = ".item"
    else:
        out = [x] * width  # one holder: ``[0..width-1]``, its first path through ``[0]``
        step = "[0]"
    if rng.random() < 0.1:  # a cycle: the level below refers back to this one
        if type(x) is list:
            x.append(out)
        elif type(x) is dict:
            x["up"] = out
        elif type(x) in (Box, Slotted):
            x.back = out
    return out, step


def structure(rng: random.Random, t: torch.Tensor, depth: int) -> tuple[Any, str]:
    """``t`` ``depth`` levels down a random structure, and the path below its root."""
    x: Any = t
    steps: list[str] = []
    for _ in range(depth):
        x, step = wrap(rng, x)
        steps.append(step)
    return x, "".join(reversed(steps))


def test_random_deep_and_wide_structures_get_a_path_or_a_note(
    g: Globals, deep_census: None
) -> None:
    rng = random.Random(20261203)
    depths = [rng.randrange(1, 30), rng.randrange(100, 1_000), rng.randrange(1_000, 5_000)]
    depths.append(rng.randrange(10_000, 100_000))
    rng.shuffle(depths)
    tensors, paths = [], []
    for i, depth in enumerate(depths):
        t = torch.ones(20 + i)
        root, below = structure(rng, t, depth)
        g[f"s{i}"] = root
        tensors.append(t)
        paths.append(f"{M}.s{i}{below}")
    # And a wide one: the same tensor in each of many dicts (one holder, its first path).
    t = torch.ones(19)
    g["wide"] = [{"t": t} for _ in range(rng.randrange(10_000, 100_000))]
    tensors.append(t)
    paths.append(f"{M}.wide[0]['t']")
    del t
    # One search for every tensor (the census) ...
    found = cudamem.live_tensors("cpu", holders=True).storages
    for t, path in zip(tensors, paths, strict=True):
        s = storage_of(found, t)
        assert s.holders is not None
        assert answered(s.holders, path), (path[:200], s.holders.paths)
    # ... and one of a random structure with random limits: the path, or a note.
    k = rng.randrange(len(tensors))
    max_depth = rng.choice([depths[k] // 2, depths[k] + 10, LIMITS.max_depth])
    timeout = rng.choice([0.05, 0.5, 3.0])
    result = cudamem.who_holds(tensors[k], max_depth=max_depth, timeout=timeout)
    assert answered(result, paths[k])
