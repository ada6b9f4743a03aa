"""Reading paths off a recorded search graph (``cudamem.holders._graph_paths.PathReader``), on
graphs built by hand: the shared walk below a funnel gives exactly the paths one long walk gives."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from cudamem.holders._graph_paths import Path, PathReader
from cudamem.holders._naming import Ref, Seg

Edges = dict[int, dict[int, Ref]]


def _reader(edges: Edges, holders: set[int], *, funnels: bool) -> PathReader:
    nodes: dict[int, Any] = {n: object() for n in {*edges, *(c for e in edges.values() for c in e)}}
    start = {h: [(h % 3, Seg("storage", "t"), "itself")] for h in holders}
    reader = PathReader(edges, nodes, start, max_paths=64, late=lambda: False)
    if not funnels:
        reader.nested = 0  # one long walk: no walk below a funnel stands for its rest
    return reader


def _ref(rng: random.Random) -> Ref:
    pick = rng.random()
    if pick < 0.35:
        return Ref((Seg("index", str(rng.randrange(4))),))
    if pick < 0.45:
        lo = rng.randrange(3)
        n = rng.randrange(2, 5)
        return Ref((Seg("index", str(lo)),), n, (lo, lo + n - 1))
    if pick < 0.55:
        return Ref((Seg("key", repr(rng.choice("ab"))),), rng.randrange(2, 4))
    return Ref((Seg("attr", rng.choice(("x", "y", "loader", "config"))),))


def _graph(rng: random.Random, n: int, up: float) -> tuple[Edges, set[int]]:
    """A random graph: mostly downward edges (with chains that narrow to one object, as a
    module's ``__spec__`` narrows to its loader), a share ``up`` of edges back up (cycles,
    references back to what refers to an object)."""
    edges: Edges = {}
    for a in range(n):
        kids = rng.randrange(0, 4) if rng.random() < 0.6 else 1
        for _ in range(kids):
            b = rng.randrange(a + 1, n + 1) if rng.random() >= up else rng.randrange(0, n)
            if b != a:
                edges.setdefault(a, {})[b] = _ref(rng)
    holders = {h for h in range(n + 1) if rng.random() < 0.15} | {n}
    return edges, holders


def _key(paths: list[Path]) -> list[tuple[Any, ...]]:
    return [
        (p.target, p.refs, p.via, p.ids, p.times, sorted(p.ranges.items()), sorted(p.stars))
        for p in paths
    ]


@pytest.mark.parametrize("up", [0.1, 0.4])
@pytest.mark.parametrize("seed", range(80))
def test_a_shared_walk_below_a_funnel_gives_the_paths_of_one_long_walk(
    seed: int, up: float
) -> None:
    rng = random.Random(seed)
    edges, holders = _graph(rng, rng.randrange(8, 40), up)
    starts = list(range(len(edges) + 1))
    rng.shuffle(starts)  # funnels are found from any order of starts
    shared = _reader(edges, holders, funnels=True)
    plain = _reader(edges, holders, funnels=False)
    for s in starts:
        assert _key(shared.walk_down(s)) == _key(plain.walk_down(s)), s


def test_module_specs_narrowing_to_one_loader_walk_below_it_once() -> None:
    # Twenty modules' __spec__ -> the one loader -> its config -> a long way down to the
    # holder: each start costs its own step, the loader's walk is done once.
    spec = Seg("attr", "loader")
    edges: Edges = {}
    loader, config = 100, 101
    for m in range(20):
        edges[m] = {loader: Ref((spec,))}
    edges[loader] = {config: Ref((Seg("attr", "config"),))}
    chain = list(range(102, 160))
    edges[config] = {chain[0]: Ref((Seg("attr", "session"),))}
    for a, b in itertools.pairwise(chain):
        edges[a] = {b: Ref((Seg("index", "0"),))}
    reader = _reader(edges, {chain[-1]}, funnels=True)
    walked: list[int] = []
    real_walk = reader._walk

    def counting(oid: int, reached: list[Any] | None = None) -> list[Path]:
        walked.append(oid)
        return real_walk(oid, reached)

    reader._walk = counting  # type: ignore[method-assign]
    for m in range(20):
        (path,) = reader.walk_down(m)
        assert path.ids[:3] == [m, loader, config] and path.ids[-1] == chain[-1]
        assert [r.seg.text for r in path.refs[:3]] == ["loader", "config", "session"]
        assert len(path.refs) == 2 + len(chain) + 1  # the storage step last
    # Each object walked once: every start, and every funnel from the loader down to the
    # holder's parent (the holder itself is no funnel: it ends the walk).
    assert walked.count(loader) == 1
    assert len(walked) == len(set(walked)) == 20 + 2 + len(chain) - 1


# --------------------------------------------------------------------------- deep chains


def _chain(n: int) -> Edges:
    """``0 -> 1 -> ... -> n``, each step a list index: ``[0][0]...[0]``."""
    return {a: {a + 1: Ref((Seg("index", "0"),))} for a in range(n)}


def test_a_100000_deep_chain_is_read_without_recursion() -> None:
    # Every level narrows to one object (a funnel): the walks waiting on each other are
    # driven from a list, never the C stack, and past a few hundred the walk goes on alone.
    n = 100_000
    reader = _reader(_chain(n), {n}, funnels=True)
    (path,) = reader.walk_down(0)
    assert path.ids == list(range(n + 1))
    assert [r.seg.text for r in path.refs] == ["0"] * n + ["t"]
    assert (path.times, path.ranges, path.stars) == (1, {i: (0, 0) for i in range(n)}, set())
    # A walk from further down, and again from the top (each answered once, then kept).
    (lower,) = reader.walk_down(n // 2)
    assert lower.ids == list(range(n // 2, n + 1))
    assert reader.walk_down(0)[0] is path
    assert not reader._walking


def test_a_deep_walk_stops_when_the_time_for_reading_is_up() -> None:
    n = 100_000
    reader = _reader(_chain(n), {n}, funnels=True)
    reader.late = lambda: True
    assert reader.walk_down(0) == []  # what it found by then: nothing, and no error
    assert not reader._walking


@pytest.mark.parametrize("seed", range(6))
def test_deep_chains_with_branches_give_the_paths_of_one_long_walk(seed: int) -> None:
    # A chain deeper than the walks that may wait on each other (``_NESTED``), with side
    # branches, references back up and holders along it: the same paths as one long walk.
    rng = random.Random(seed)
    n = 400
    edges = _chain(n)
    for a in range(n):
        if rng.random() < 0.05:
            edges[a][rng.randrange(n + 1, n + 40)] = _ref(rng)  # a branch off the chain
        if rng.random() < 0.03:
            edges[a][rng.randrange(0, a + 1)] = _ref(rng)  # back up: a cycle
    holders = {n} | {h for h in range(n) if rng.random() < 0.01}
    shared = _reader(edges, holders, funnels=True)
    plain = _reader(edges, holders, funnels=False)
    for s in [0, *rng.sample(range(n), 3)]:
        assert _key(shared.walk_down(s)) == _key(plain.walk_down(s)), s
