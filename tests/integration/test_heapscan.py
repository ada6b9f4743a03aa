"""The compiled heap pass (``cudamem/native/src/heapscan/``): built, validated, switched off,
and the same answers as the Python pass, on hostile and mutating heaps too.

Where no C compiler exists these tests skip the compiled half; the Python pass is what the
rest of the suite runs on then.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cudamem
from cudamem.native import heap as _heap
from cudamem.native import heapscan as _heapscan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> Any:
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here: the Python pass serves")
    status = _heapscan.wait(120)
    if status.state == "disabled":
        pytest.skip(f"{_heapscan.SWITCH_ENV}=0: this run tests the Python pass")
    assert status.active, status
    return _heapscan.native()


def _pass(objs: list[Any], wanted: set[int], *, grow: dict[int, int] | None = None) -> list[Any]:
    """Objects hit, in order; ``grow`` maps a hit's id to an id it adds (a climb)."""
    hits: list[Any] = []
    added: list[int] = []

    def on_hit(o: Any) -> bool:
        hits.append(o)
        new = (grow or {}).get(id(o))
        if new is not None and new not in wanted:
            wanted.add(new)
            added.append(new)
            return True
        return False

    done, _last, whole = _heap.chunked_pass(objs, wanted, on_hit, added=added)
    assert done and whole
    return hits


class Hostile:
    """Every dunder a careless scanner might call raises."""

    def __init__(self, payload: Any) -> None:
        object.__setattr__(self, "payload", payload)

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no ==")

    def __hash__(self) -> int:
        raise RuntimeError("no hash")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def _heap_with(target: Any) -> tuple[list[Any], list[Any]]:
    holders: list[Any] = [[target], {"k": target}, (target,), {target.__class__: [target]}]
    hostile = Hostile(target)
    deep: Any = target
    for _ in range(500):
        deep = [deep]
    cycle: list[Any] = []
    cycle.append(cycle)
    cycle.append(target)
    holders += [hostile, deep, cycle]
    filler = [[i] for i in range(5000)] + [{"i": i} for i in range(3000)]
    return holders + filler, holders


def test_the_compiled_pass_finds_what_the_python_pass_finds(compiled: Any) -> None:
    target = torch.ones(3)
    heap, holders = _heap_with(target)
    wanted = {id(target)}
    fast = _pass(heap, set(wanted))
    with _heapscan.python_pass():
        slow = _pass(heap, set(wanted))
    assert [id(o) for o in fast] == [id(o) for o in slow]
    # Direct referrers only: the dict of 3 and the nest of 5 hold it through objects that
    # are not in this heap list.
    direct = [holders[i] for i in (0, 1, 2, 4, 6)]
    assert {id(o) for o in fast} == {id(h) for h in direct}


def test_a_pass_climbs_through_ids_added_by_its_callback(compiled: Any) -> None:
    # The child is found first (newest first), its holder joins the wanted ids, and that
    # holder's own holder, older in the heap, is found in the same pass.
    target = object()
    inner = [target]
    outer = {"inner": inner}
    heap = [outer] + [[i] for i in range(4000)] + [inner]
    grow = {id(inner): id(inner), id(outer): id(outer)}
    fast = _pass(heap, {id(target)}, grow=grow)
    with _heapscan.python_pass():
        slow = _pass(heap, {id(target)}, grow=grow)
    assert [id(o) for o in fast] == [id(o) for o in slow] == [id(inner), id(outer)]


def test_a_recorded_batch_climbs_through_ids_added_by_its_callback(compiled: Any) -> None:
    # One batch of a snapshot whose referents are recorded: the batch is tested at once
    # against the ids wanted at its start, and after each callback that adds ids the rest
    # of it object by object; the same hits, in the same order, as a pass that traverses.
    target = object()
    chain: list[Any] = [target]
    for _ in range(10):
        chain.append([chain[-1]])
    holders = chain[:0:-1]  # the outermost oldest: each holder is tested after its child
    heap = [[i] for i in range(300)] + holders + [[target]] + [{"i": i} for i in range(300)]
    grow = {id(h): id(h) for h in holders}
    grow[id(heap[310])] = id(heap[310])
    expected = [heap[310], *chain[1:]]
    cache = compiled.edges(1 << 20)
    # traversed; recorded now; read off the recording
    runs = [_climbing_pass(heap, {id(target)}, grow, e)[0] for e in (None, cache, cache)]
    assert compiled.edges_info(cache)[0] == 1
    assert runs[0] == runs[1] == runs[2] == [id(o) for o in expected]


def test_module_dicts_names_each_module_dict_once(compiled: Any) -> None:
    import types

    class Sub(types.ModuleType):
        pass

    plain, sub = types.ModuleType("cm_plain"), Sub("cm_sub")
    modules = {"cm_plain": plain, "cm_again": plain, "cm_sub": sub, 3: plain, "cm_x": object()}
    assert compiled.module_dicts(modules) == {id(vars(plain)): "cm_plain", id(vars(sub)): "cm_sub"}
    with pytest.raises(TypeError, match="must be a dict"):
        compiled.module_dicts([plain])
    search = cudamem.holders._search.Search.__new__(cudamem.holders._search.Search)
    fast = search._module_dicts()
    with _heapscan.python_pass():
        assert search._module_dicts() == fast
    assert fast[id(vars(sys))] == "sys"


def test_arrays_inside_untracked_containers_are_handed_over_with_their_edges(
    compiled: Any,
) -> None:
    t = torch.ones(4)
    box = {"arr": t.numpy()}
    # A dict holding a tuple of untracked objects: a collection untracks both.
    nested = {"a": (t.numpy(), "x")}
    holder = [box, nested]
    gc.collect()
    assert not gc.is_tracked(box) and not gc.is_tracked(nested)

    def arrays_seen() -> tuple[set[int], set[tuple[int, int]]]:
        got: set[int] = set()
        edges: set[tuple[int, int]] = set()

        def on_arrays(found: list[Any], pairs: list[tuple[Any, Any]]) -> bool:
            got.update(id(a) for a in found)
            edges.update((id(c), id(k)) for c, k in pairs)
            return False

        _heap.chunked_pass(
            [holder],
            set(),
            lambda _o: False,
            array_type=np.ndarray,
            on_arrays=on_arrays,
            added=[],
        )
        return got, edges

    fast = arrays_seen()
    with _heapscan.python_pass():
        slow = arrays_seen()
    assert fast == slow
    assert id(box["arr"]) in fast[0] and id(nested["a"][0]) in fast[0]
    assert (id(box), id(box["arr"])) in fast[1]
    assert (id(nested), id(nested["a"])) in fast[1]
    assert (id(nested["a"]), id(nested["a"][0])) in fast[1]


def test_who_holds_gives_the_same_paths_with_and_without_the_compiled_pass(
    compiled: Any,
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(torch.ones(3, 4)).sum()
        loss.backward()
        opt.step()
        losses.append(loss)
    box = {"arr": model[0].weight.detach().numpy()}
    # A first search makes Python wrappers of saved tensors, which later searches see:
    # compare two later ones (frame labels carry line numbers: compare what follows).
    cudamem.who_holds(model[0].weight)
    fast = cudamem.who_holds(model[0].weight)
    with _heapscan.python_pass():
        slow = cudamem.who_holds(model[0].weight)

    def seen(result: Any) -> list[tuple[str, str]]:
        return [(h.path.split(": ", 1)[-1], h.via) for h in result]

    assert seen(fast) == seen(slow)
    paths = [h.path for h in fast]
    assert any(p.endswith("box['arr']") for p in paths), paths
    assert any("losses[" in p for p in paths), paths
    del box


def test_a_pass_while_other_threads_mutate_containers(compiled: Any) -> None:
    target = object()
    shared: list[Any] = [target]
    heap = [shared] + [[i] for i in range(20000)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for lst in heap[1:200]:
                lst.append(target)
                lst.pop()

    th = threading.Thread(target=churn)
    th.start()
    try:
        cache = _heap.edge_cache()  # recorded once, read by the later passes
        for _ in range(20):
            hits = _pass(heap, {id(target)})
            assert shared in hits  # always there; the churned lists may or may not be
            hits = _climbing_pass(heap, {id(target)}, {}, cache)[0]
            assert id(shared) in hits
    finally:
        stop.set()
        th.join(10)
    assert not th.is_alive()


def test_the_pass_keeps_no_reference_and_leaves_gc_as_it_found_it(compiled: Any) -> None:
    target = object()
    heap = [[target] for _ in range(100)]
    before = sys.getrefcount(target), sys.getrefcount(heap), gc.isenabled()
    _pass(heap, {id(target)})
    assert (sys.getrefcount(target), sys.getrefcount(heap), gc.isenabled()) == before


def test_a_callback_that_raises_propagates_and_releases(compiled: Any) -> None:
    target = object()
    heap = [[target]]

    def boom(_o: Any) -> bool:
        raise ValueError("from the callback")

    before = sys.getrefcount(heap)
    with pytest.raises(ValueError, match="from the callback"):
        _heap.chunked_pass(heap, {id(target)}, boom, added=[])
    assert sys.getrefcount(heap) == before and gc.isenabled()


def test_a_deadline_stops_the_compiled_pass(compiled: Any) -> None:
    heap = [[i] for i in range(50000)]
    done, last, whole = compiled.scan(heap, set(), [], lambda o: False, None, -1.0, None, None)
    assert (done, last, whole) == (False, -1, False)
    done, last, whole = compiled.scan(heap, set(), [], lambda o: False, 3, None, None, None)
    assert (done, whole) == (True, False)


def test_bad_arguments_are_refused(compiled: Any) -> None:
    with pytest.raises(TypeError):
        compiled.scan("not a list", set(), [], lambda o: False, None, None, None, None)
    with pytest.raises(TypeError, match="array_type"):
        compiled.scan([], set(), [], lambda o: False, None, None, 3, lambda a, b: False)


def test_validation_drops_a_pass_that_answers_wrong() -> None:
    class Liar:
        @staticmethod
        def scan(*args: Any) -> tuple[bool, int, bool]:
            return True, -1, True  # finds nothing

    assert "differ" in (_heapscan.validate(Liar()) or "")

    class Broken:
        @staticmethod
        def scan(*args: Any) -> tuple[bool, int, bool]:
            raise MemoryError("no")

    assert "MemoryError" in (_heapscan.validate(Broken()) or "")


def _fresh(code: str, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=full,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_switched_off_by_the_environment_and_import_compiles_nothing(tmp_path: Path) -> None:
    out = _fresh(
        """
        import cudamem, torch
        from cudamem.native import heapscan as _heapscan
        print("import", _heapscan.status().state)
        t = torch.ones(2); keep = [t]
        assert "keep[0]" in str(cudamem.who_holds(t))
        print("after", _heapscan.wait(5).state)
        """,
        CUDAMEM_FAST_HEAP="0",
        CUDAMEM_CACHE_DIR=str(tmp_path),
    )
    assert "import idle" in out and "after disabled" in out
    assert not list(tmp_path.rglob("*heapscan*.so"))


def test_no_compiler_leaves_the_python_pass(tmp_path: Path) -> None:
    out = _fresh(
        """
        import cudamem, torch
        from cudamem.native import heapscan as _heapscan
        t = torch.ones(2); keep = [t]
        assert "keep[0]" in str(cudamem.who_holds(t))
        s = _heapscan.wait(30)
        print("state", s.state, s.reason)
        """,
        CC="/nonexistent/cc",
        CUDAMEM_CACHE_DIR=str(tmp_path),
        CUDAMEM_FAST_HEAP="1",  # on, whatever this run's switch: it is the build that fails
    )
    assert "state failed" in out and "no C compiler" in out


def test_all_tensors_are_the_same_objects_in_the_same_order(compiled: Any) -> None:
    from cudamem.holders import _autograd

    keep = [torch.ones(i + 1) for i in range(50)] + [torch.nn.Parameter(torch.ones(2))]
    gc.collect()
    fast = _autograd.all_tensors()
    with _heapscan.python_pass():
        slow = _autograd.all_tensors()
    assert [id(t) for t in fast] == [id(t) for t in slow]
    assert {id(t) for t in keep} <= {id(t) for t in fast}
    assert compiled.instances([1, "a", 2.0, 3], (int,)) == [1, 3]
    with pytest.raises(TypeError, match="types only"):
        compiled.instances([1], (1,))


def test_gc_instances_lists_what_gc_get_objects_lists_in_its_order(compiled: Any) -> None:
    """The in-place walk of gc's lists (3.11: the interpreter's lists; 3.12+:
    PyUnstable_GC_VisitObjects) against a listing: old and young objects, a frozen-free
    heap, hostile instances, gc state and reference counts untouched."""

    class Mark:
        pass

    old = [Mark() for _ in range(200)]
    gc.collect()  # these are in the oldest generation now
    young = [Mark() for _ in range(50)] + [Hostile(1)]
    enabled, counts = gc.isenabled(), sys.getrefcount(old[0])

    def compare() -> tuple[int, int, bool, bool, bool]:
        walked = compiled.gc_instances((Mark, Hostile))
        listed = [o for o in gc.get_objects() if type(o) in (Mark, Hostile)]
        try:
            ids = [id(o) for o in walked]
            return (
                len(walked),
                len(listed),
                all(a is b for a, b in zip(walked, listed, strict=True)),
                {id(o) for o in old + young} == set(ids),
                ids.index(id(young[0])) < ids.index(id(old[0])),  # youngest generation first
            )
        finally:
            walked.clear()
            listed.clear()

    assert compare() == (251, 251, True, True, True)
    assert gc.isenabled() == enabled
    first = old[0]
    after = sys.getrefcount(first) - 1  # less the local just made
    assert after == counts
    assert compiled.gc_instances(()) == []
    with pytest.raises(TypeError, match="tuple"):
        compiled.gc_instances([Mark])
    with pytest.raises(TypeError, match="types only"):
        compiled.gc_instances((1,))


def test_validation_checks_the_walk_of_gcs_lists(compiled: Any) -> None:
    class WrongWalk:
        scan = staticmethod(compiled.scan)
        edges = staticmethod(compiled.edges)
        edges_info = staticmethod(compiled.edges_info)

        @staticmethod
        def gc_instances(types: tuple[type, ...]) -> list[Any]:
            return []  # misses every object

    assert "gc.get_objects" in (_heapscan.validate(WrongWalk()) or "")


def _climbing_pass(
    heap: list[Any], wanted: set[int], grow: dict[int, int], edges: Any, **kw: Any
) -> tuple[list[int], tuple[bool, int, bool]]:
    hits: list[int] = []
    added: list[int] = []

    def on_hit(o: Any) -> bool:
        hits.append(id(o))
        new = grow.get(id(o))
        if new is not None and new not in wanted:
            wanted.add(new)
            added.append(new)
            return True
        return False

    result = _heap.chunked_pass(heap, wanted, on_hit, added=added, edges=edges, **kw)
    return hits, result


def test_an_edge_cache_gives_every_pass_the_same_answers(compiled: Any) -> None:
    """Levels of a search over one snapshot: the first pass records, the later ones read
    the recording, partial passes (``at_least``) and array passes included; each pass
    answers as the same pass without a cache does."""
    t = torch.ones(4)
    arr = t.numpy()
    inner = [t]
    outer = {"inner": inner, "arr": arr}
    hostile = Hostile(inner)
    chain: Any = outer
    for _ in range(30):
        chain = [chain]
    heap = [chain, outer, hostile] + [[i] for i in range(5000)] + [inner]
    heap += [{"j": j} for j in range(2500)]
    grow = {id(inner): id(inner), id(outer): id(outer)}
    cache = _heap.edge_cache()
    assert cache is not None
    plans: list[dict[str, Any]] = [
        {"array_type": np.ndarray, "on_arrays": lambda found, pairs: False},
        {},
        {"at_least": 3},
        {},
    ]
    for wanted, kw in zip(
        [{id(t)}, {id(inner)}, {id(outer)}, {id(arr), id(hostile)}], plans, strict=True
    ):
        with_cache = _climbing_pass(heap, set(wanted), grow, cache, **kw)
        without = _climbing_pass(heap, set(wanted), grow, None, **kw)
        assert with_cache == without
    batches, recorded, full = compiled.edges_info(cache)
    assert batches == (len(heap) + _heap.CHUNK - 1) // _heap.CHUNK and recorded > len(heap)
    assert not full
    # The recording is addresses only: it holds nothing alive.
    before = sys.getrefcount(inner)
    _climbing_pass(heap, {id(t)}, grow, cache)
    assert sys.getrefcount(inner) == before


def test_an_edge_cache_over_budget_or_another_heap_is_not_read(compiled: Any) -> None:
    target = object()
    heap = [[i] for i in range(3000)] + [[target]] + [[i] for i in range(3000)]
    small = compiled.edges(100)  # less than one batch: records nothing
    assert _climbing_pass(heap, {id(target)}, {}, small)[0] == [id(heap[3000])]
    assert compiled.edges_info(small) == (0, 0, True)
    cache = compiled.edges(1 << 20)
    _climbing_pass(heap, {id(target)}, {}, cache)
    other = [*heap[:3000], {"k": target}]  # another list: the cache is bound to `heap`
    assert _climbing_pass(other, {id(target)}, {}, cache)[0] == [id(other[-1])]
    heap.append([target])  # the bound list grew: its recording no longer matches
    assert sorted(_climbing_pass(heap, {id(target)}, {}, cache)[0]) == sorted(
        [id(heap[3000]), id(heap[-1])]
    )
    with pytest.raises(ValueError, match="max_edges"):
        compiled.edges(-1)
    with pytest.raises(ValueError):
        compiled.scan(heap, set(), [], lambda o: False, None, None, None, None, object())


def test_gc_order_lists_the_snapshot_as_gc_get_objects_does(compiled: Any) -> None:
    keep = [torch.ones(i + 1) for i in range(20)]
    gc.collect()
    ranges: list[tuple[int, int]] = []
    heap = _heap.snapshot(ranges)
    assert sum(end - start for start, end in ranges) == len(heap)
    from cudamem.holders import _autograd

    assert [id(t) for t in _autograd.all_tensors(heap, ranges)] == [
        id(t) for t in _autograd.all_tensors()
    ]
    listing = [o for start, end in ranges for o in heap[start:end]]
    assert len(listing) == len(heap) and {id(t) for t in keep} <= {id(o) for o in listing}
    heap.clear()
    listing.clear()
    assert compiled.instances([1, 2, "a", 3, 4], (int,), 1, 4) == [2, 3]
    with pytest.raises(ValueError, match="start <= end"):
        compiled.instances([1], (int,), 2, 1)


def _walk(compiled: Any, kinds: tuple[type, ...], array_type: Any = None) -> tuple[Any, ...]:
    if not hasattr(compiled, "walk"):
        pytest.skip("no in-place walk on this Python: the listing serves")
    cache = compiled.edges(_heap.EDGE_BUDGET)
    with _heap.gc_paused():
        objs, sizes, found = compiled.walk(kinds, cache, array_type)
    return objs, sizes, found, cache


def _arrays_seen(
    objs: list[Any], target: Any, edges: Any
) -> tuple[list[int], set[tuple[int, int]], list[int]]:
    """One array-mode climbing pass for ``target`` over ``objs`` (with the edge cache
    ``edges``, or None): the arrays handed over, in order; the (container, child) steps to
    them; the hits."""
    got: list[int] = []
    pairs_seen: set[tuple[int, int]] = set()

    def on_arrays(arrays: list[Any], pairs: list[tuple[Any, Any]]) -> bool:
        got.extend(id(a) for a in arrays)
        pairs_seen.update((id(c), id(k)) for c, k in pairs)
        return False

    hits = _climbing_pass(
        objs, {id(target)}, {}, edges, array_type=np.ndarray, on_arrays=on_arrays
    )[0]
    return got, pairs_seen, hits


def test_the_walk_lists_what_the_snapshot_lists_and_records_every_batch(compiled: Any) -> None:
    """``walk``: the three generations oldest first (``_heap.snapshot``'s listing), the
    objects of a type in ``gc.get_objects()``'s order, the edge cache bound and complete;
    hostile objects and a cycle included; reference counts and gc state as they were."""

    class Mark:
        pass

    target = torch.ones(2)
    heap, _holders = _heap_with(target)  # hostile objects, a cycle, a deep nest
    old = [Mark() for _ in range(100)]
    gc.collect()
    young = [Mark() for _ in range(20)] + [Hostile(target)]
    enabled, count = gc.isenabled(), sys.getrefcount(target)
    marks: list[Any] = []
    with _heap.gc_paused():
        listing = _heap.snapshot()
        objs, (n2, n1, n0), found, cache = _walk(compiled, (Mark, Hostile))
    try:
        n = len(listing)
        # made after the listing: the snapshot's own lists, the call's arguments
        assert n <= len(objs) <= n + 16 and n2 + n1 + n0 == len(objs)
        assert all(a is b for a, b in zip(objs[:n], listing, strict=False))
        marks += [o for o in gc.get_objects() if type(o) in (Mark, Hostile)]
        assert [id(o) for o in found] == [id(o) for o in marks]
        assert {id(o) for o in old + young} <= {id(o) for o in found}
        batches, recorded, full = compiled.edges_info(cache)
        assert batches == (len(objs) + _heap.CHUNK - 1) // _heap.CHUNK and recorded > n
        assert not full
        # the recording answers as a traversal does (the heap did not change meanwhile)
        with_cache = _climbing_pass(objs, {id(target)}, {}, cache)[0]
        without = _climbing_pass(objs, {id(target)}, {}, None)[0]
        assert with_cache == without and id(young[-1]) in with_cache
    finally:
        listing.clear()
        objs.clear()
        found.clear()
        marks.clear()
        heap.clear()
    assert gc.isenabled() == enabled and sys.getrefcount(target) == count
    del cache  # the recording holds no reference: nothing to let go of
    assert sys.getrefcount(target) == count


def test_the_walk_keeps_arrays_for_the_first_array_pass_only(compiled: Any) -> None:
    """In array mode the walk keeps the arrays and the untracked containers that lead to
    one; the first array-mode pass over its cache hands over what a traversal would, and
    lets them go. Untracked containers with no array below are not kept."""
    t = torch.ones(4)
    box = {"arr": t.numpy()}
    nested = {"a": (t.numpy(), "x")}
    plain = {"n": (1, "x")}  # untracked, no array below: not kept
    holder = [box, nested, plain]
    gc.collect()
    assert not gc.is_tracked(box) and not gc.is_tracked(nested) and not gc.is_tracked(plain)
    counts = [sys.getrefcount(o) for o in (box["arr"], box, plain)]
    objs, _sizes, found, cache = _walk(compiled, (), np.ndarray)
    found.clear()
    try:
        # kept: ``box`` (a tracked list's referent with an array below), not the array
        # inside it (no tracked object refers to it), not ``plain``
        assert [sys.getrefcount(o) for o in (box["arr"], box, plain)] == [
            counts[0],
            counts[1] + 1,
            counts[2],
        ]

        fast = _arrays_seen(objs, t, cache)
        slow = _arrays_seen(objs, t, None)
        assert fast[0] == slow[0] and fast[2] == slow[2]
        assert {id(box["arr"]), id(nested["a"][0])} <= set(fast[0])
        assert (id(box), id(box["arr"])) in fast[1]
        assert (id(nested["a"]), id(nested["a"][0])) in fast[1]
        assert fast[1] <= slow[1]  # the traversal also names steps that lead nowhere
        assert [sys.getrefcount(o) for o in (box["arr"], box, plain)] == counts
        assert _arrays_seen(objs, t, cache)[:2] == slow[:2]  # read off the recording: a traversal
    finally:
        objs.clear()
        holder.clear()


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_walk_lists_the_same_with_or_without_its_chaser(compiled: Any, mode: int) -> None:
    """The chaser thread that follows gc's lists ahead of the walk only reads them: the walk
    lists what the snapshot lists with it off (0), on (1) or reading every entry first (2:
    then it read each entry the walk did, and the walk's own four result lists)."""
    if not hasattr(compiled, "side_thread"):
        pytest.skip("no chaser on this platform")
    keep = [[i] for i in range(30_000)]
    was = compiled.side_thread(mode)
    try:
        with _heap.gc_paused():
            listing = _heap.snapshot()
            objs, (n2, n1, n0), found, cache = _walk(compiled, ())
    finally:
        compiled.side_thread(was)
    n, _edges, side, chased = compiled.walk_stats()
    try:
        assert n == len(objs) == n2 + n1 + n0 and side == 0
        assert all(a is b for a, b in zip(objs[: len(listing)], listing, strict=True))
        assert compiled.edges_info(cache)[1] > n
        if mode == 2:
            assert chased == n + 4
        elif mode == 0:
            assert chased == 0
        else:
            assert 0 <= chased <= n + 4
    finally:
        listing.clear()
        objs.clear()
        found.clear()
        keep.clear()


@pytest.mark.parametrize("mode", ["side thread", "side thread halted", "one thread"])
def test_the_walk_keeps_the_same_arrays_on_a_side_thread_or_without(
    compiled: Any, mode: str
) -> None:
    """The array keeps made on the side thread while the walk records (in lockstep here,
    so that its share is known), on a side thread halted part way because the walk had to
    grow its recording, or by the walk alone: each hands the first array pass what a
    traversal of the same snapshot finds, with the same hits and references as before."""
    if not hasattr(compiled, "side_thread"):
        pytest.skip("no side thread on this platform")
    t = torch.ones(20_000)
    # 20,000 holders in a row, each with its own array two untracked containers down: a
    # keep lost at any step of the thread's loses an array
    spread = [{"a": (t[i : i + 1].numpy(), "x"), "n": i} for i in range(20_000)]
    holders = [[d] for d in spread] + [[(i, "y")] for i in range(20_000)]
    gc.collect()
    assert not gc.is_tracked(spread[0]) and not gc.is_tracked(spread[0]["a"])
    _walk(compiled, (), None)[0].clear()  # the next walk is sized from this one
    grown: list[Any] = []
    if mode == "side thread halted":  # past the walk's slack: it grows, halting the thread
        grown = [[i] for i in range(len(gc.get_objects()) // 4 + 20_000)]
    counts = [sys.getrefcount(d["a"][0]) for d in spread]
    was = compiled.side_thread(0 if mode == "one thread" else 2)
    try:
        objs, _sizes, found, cache = _walk(compiled, (), np.ndarray)
    finally:
        compiled.side_thread(was)
    found.clear()
    n, _edges, side, _chased = compiled.walk_stats()
    try:
        assert n == len(objs)
        if mode == "side thread":
            assert side == n  # every object: at the end it is let finish
        elif mode == "side thread halted":
            assert 0 < side < n - 20_000
        else:
            assert side == 0

        fast = _arrays_seen(objs, t, cache)
        slow = _arrays_seen(objs, t, None)
        assert fast[0] == slow[0] and fast[2] == slow[2]  # the same arrays, in order
        assert {id(d["a"][0]) for d in spread} <= set(fast[0])
        assert {(id(d["a"]), id(d["a"][0])) for d in spread} <= fast[1] <= slow[1]
        assert [sys.getrefcount(d["a"][0]) for d in spread] == counts
    finally:
        objs.clear()
        holders.clear()
        grown.clear()


def test_the_walk_over_budget_leaves_the_cache_unused(compiled: Any) -> None:
    if not hasattr(compiled, "walk"):
        pytest.skip("no in-place walk on this Python")
    target = object()
    keep = [[target] for _ in range(10)]
    small = compiled.edges(100)
    with _heap.gc_paused():
        objs, _sizes, _found = compiled.walk((), small, np.ndarray)
    try:
        assert compiled.edges_info(small) == (0, 0, False)
        hits = _climbing_pass(objs, {id(target)}, {}, small)[0]  # records as it goes
        assert {id(k) for k in keep} <= set(hits)
    finally:
        objs.clear()
    used = compiled.edges(1 << 20)
    _climbing_pass([[target]], {id(target)}, {}, used)
    with pytest.raises(ValueError, match="in use"):
        compiled.walk((), used, None)
    with pytest.raises(TypeError, match="array_type"):
        compiled.walk((), None, 3)
    with pytest.raises(TypeError):
        compiled.walk([int], None, None)
    with pytest.raises(TypeError, match="types only"):
        compiled.walk((1,), None, None)


def test_searches_after_the_walk_survive_mutating_threads_and_hostile_objects(
    compiled: Any,
) -> None:
    """Other threads mutate containers while searches run (the walk itself holds the GIL,
    the passes after it call back into Python); hostile objects and a cycle hold the
    target; a tensor's traversal may visit nothing (torch returns early for a tensor
    only C++ holds): every search answers as the Python pass does."""
    if not hasattr(compiled, "walk"):
        pytest.skip("no in-place walk on this Python")
    target = torch.ones(3)
    hostile = Hostile(target)
    cycle: list[Any] = [target]
    cycle.append(cycle)
    churned: list[list[Any]] = [[i] for i in range(300)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for lst in churned:
                lst.append(target)
                lst.pop()

    th = threading.Thread(target=churn)
    th.start()
    try:
        for _ in range(3):
            paths = [h.path for h in cudamem.who_holds(target)]
            assert any("cycle[0]" in p for p in paths), paths
    finally:
        stop.set()
        th.join(10)
    assert not th.is_alive()
    fast = [h.path.split(": ", 1)[-1] for h in cudamem.who_holds(target)]
    with _heapscan.python_pass():
        slow = [h.path.split(": ", 1)[-1] for h in cudamem.who_holds(target)]
    assert fast == slow
    del hostile
