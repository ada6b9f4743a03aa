"""CPU tests of the holder search's scale, limits and honesty (real torch).

Huge containers, deep nesting and cut-short searches; what is not a holder (the call's own
temporaries, a loop's iterator, a view's base) and what is (a numpy array on the memory);
threads. Tensors without memory of their own (FakeTensors left by torch.compile, meta and
functional tensors), which no scan may touch, are tested in a process of their own:
``tests/integration/frameworks/test_compile.py``.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import cudamem
from cudamem.holders.finder import Holder, Holders
from cudamem.render.json import to_json

from ..module_globals import Globals, added_globals

M = __name__


@pytest.fixture
def g() -> Iterator[Globals]:
    """Module globals for a test; every name it adds is removed afterwards."""
    yield from added_globals(__name__)


def mine(result: Holders) -> list[Holder]:
    """Holders other than the caller's own reference."""
    return [h for h in result if not h.caller]


# --------------------------------------------------------------------------- huge containers


def test_one_list_holding_a_tensor_3000_times_is_one_holder(g: Globals) -> None:
    total = torch.ones(3)
    g["log"] = [total] * 3000
    result = cudamem.who_holds(total, timeout=5.0)
    assert result.complete
    (h,) = mine(result)
    assert h.path == f"{M}.log[0]"
    assert h.count == 3000 and h.pattern == f"{M}.log[0..2999]"
    assert f"  {M}.log[0..2999]  (3000 references)" in str(result).splitlines()
    data = json.loads(to_json(result))["holders"]
    assert {"path": f"{M}.log[0]", "count": 3000, "pattern": f"{M}.log[0..2999]"}.items() <= (
        next(d for d in data if not d["caller"]).items()
    )


def test_20000_references_answer_within_a_modest_timeout(g: Globals) -> None:
    t = torch.ones(2)
    g["big"] = [t] * 20000
    result = cudamem.who_holds(t, timeout=10.0)
    assert result.complete, result.notes
    assert [(h.pattern, h.count) for h in mine(result)] == [(f"{M}.big[0..19999]", 20000)]


def test_60000_dicts_sharing_one_tensor_are_one_group(g: Globals) -> None:
    t = torch.ones(4)
    g["rows"] = [{"t": t} for _ in range(60000)]
    result = cudamem.who_holds(t, timeout=30.0)
    assert result.complete, result.notes
    (h,) = mine(result)
    assert h.path == f"{M}.rows[0]['t']"
    assert (h.pattern, h.count) == (f"{M}.rows[0..59999]['t']", 60000)


def test_scattered_indices_are_written_as_a_star(g: Globals) -> None:
    t = torch.ones(5)
    g["sparse"] = [t, None, None, t, t]
    (h,) = mine(cudamem.who_holds(t))
    assert (h.path, h.pattern, h.count) == (f"{M}.sparse[0]", f"{M}.sparse[*]", 3)


def test_views_in_one_list_are_one_group(g: Globals) -> None:
    base = torch.arange(100.0)
    g["views"] = [base[i : i + 1] for i in range(100)]
    groups = [h for h in mine(cudamem.who_holds(base)) if h.via == "view"]
    assert [(h.pattern, h.count) for h in groups] == [(f"{M}.views[0..99]", 100)]


def test_int_keyed_dict_of_dicts_is_one_group(g: Globals) -> None:
    t = torch.ones(6)
    g["by_step"] = {step: {"loss": t} for step in range(500)}
    (h,) = mine(cudamem.who_holds(t))
    assert (h.pattern, h.count) == (f"{M}.by_step[0..499]['loss']", 500)


def test_different_names_stay_apart(g: Globals) -> None:
    t = torch.ones(7)
    g["named"] = {"train": [t], "val": [t]}
    paths = sorted(h.path for h in mine(cudamem.who_holds(t)))
    assert paths == [f"{M}.named['train'][0]", f"{M}.named['val'][0]"]
    assert all(h.count == 1 and h.pattern is None for h in mine(cudamem.who_holds(t)))


def test_many_targets_in_one_search_each_get_their_own_paths(g: Globals) -> None:
    g["pool"] = {f"layer{i}": [torch.full((2,), float(i))] for i in range(300)}
    targets = [v[0] for v in g["pool"].values()]
    found = cudamem.live_tensors("cpu", holders=True)
    by_ptr = {s.data_ptr: s for s in found}
    for i, t in enumerate(targets):
        s = by_ptr[t.untyped_storage().data_ptr()]
        assert s.holders is not None
        assert f"{M}.pool['layer{i}'][0]" in s.holders.paths


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"timeout": None}, TypeError, "timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"timeout": -1.0}, ValueError, "timeout"),
        ({"timeout": math.nan}, ValueError, "timeout"),
        ({"timeout": True}, TypeError, "timeout"),
        ({"max_depth": "10"}, TypeError, "max_depth"),
        ({"max_depth": 2.5}, TypeError, "max_depth"),
        ({"max_depth": -1}, ValueError, "max_depth"),
        ({"max_depth": 0}, ValueError, "max_depth"),
        ({"max_nodes": -5}, ValueError, "max_nodes"),
        ({"max_nodes": None}, TypeError, "max_nodes"),
        ({"max_paths": 0}, ValueError, "max_paths"),
        ({"max_paths": True}, TypeError, "max_paths"),
    ],
)
def test_bad_limits_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        cudamem.who_holds(torch.ones(1), **kwargs)


def test_max_depth_says_so_and_shows_how_far_it_got(g: Globals) -> None:
    t = torch.ones(8)
    deep: Any = [t]
    for _ in range(60):
        deep = [deep]
    g["deep"] = deep
    del deep
    result = cudamem.who_holds(t, max_depth=10)
    assert result.stopped == "max_depth" and not result.complete
    partial = [h for h in result if h.root_kind == "partial"]
    assert len(partial) == 1
    assert partial[0].path == "<list object>" + "[0]" * 10
    text = str(result)
    assert "found before the search stopped (max_depth)" in text.splitlines()[0]
    assert "the search stopped here" in text
    assert "only the caller's temporaries" not in text
    assert json.loads(to_json(result))["stopped"] == "max_depth"


def test_timeout_zero_says_so_and_never_claims_nothing_holds_it(g: Globals) -> None:
    t = torch.ones(9)
    g["held"] = [[t]]
    result = cudamem.who_holds(t, timeout=0.0)
    assert result.stopped == "timeout"
    assert any("timeout" in n for n in result.notes)
    assert "only the caller's temporaries" not in str(result)


def test_max_nodes_says_so(g: Globals) -> None:
    t = torch.ones(10)
    g["wide"] = [[[t]]]
    result = cudamem.who_holds(t, max_nodes=2)
    assert result.stopped == "max_nodes"
    assert any("max_nodes" in n for n in result.notes)


def test_a_complete_search_that_finds_nothing_says_only_temporaries() -> None:
    result = cudamem.who_holds(torch.ones(11))
    assert result.complete and len(result) == 0
    assert "(nothing found: only the caller's temporaries hold it)" in str(result)


def test_max_paths_counts_groups_not_references(g: Globals) -> None:
    t = torch.ones(12)
    g["many"] = {f"k{i}": [t] for i in range(10)}
    result = cudamem.who_holds(t, max_paths=3)
    assert len(mine(result)) <= 3
    assert any("max_paths" in n for n in result.notes)
    g["many"] = [[t] for _ in range(10)]
    (h,) = mine(cudamem.who_holds(t, max_paths=1))
    assert h.count == 10


# --------------------------------------------------------------------------- not holders


def test_the_calls_own_argument_tuple_is_not_a_holder(g: Globals) -> None:
    g["x"] = torch.ones(13)
    opts = {"timeout": 10.0}
    assert [h.path for h in cudamem.who_holds(g["x"], **opts)] == [f"{M}.x"]
    assert [h.path for h in functools.partial(cudamem.who_holds, g["x"])()] == [f"{M}.x"]
    assert [h.path for h in functools.partial(cudamem.who_holds, obj=g["x"])()] == [f"{M}.x"]
    args = (g["x"],)  # a tuple the caller keeps is a holder like any other
    paths = [h.path for h in cudamem.who_holds(*args)]
    assert paths[0] == f"{M}.x" and len(paths) == 2
    assert paths[1].endswith("in test_the_calls_own_argument_tuple_is_not_a_holder(): args[0]")


def test_a_temporary_argument_is_held_by_nothing() -> None:
    opts = {"timeout": 10.0}
    result = cudamem.who_holds(torch.ones(14), **opts)
    assert len(result) == 0 and result.complete


def test_a_loops_iterator_is_not_a_holder(g: Globals) -> None:
    g["saved"] = [torch.ones(15), torch.ones(16)]
    seen = []
    for t in g["saved"]:
        seen.append([h.path for h in mine(cudamem.who_holds(t))])
    assert seen == [[f"{M}.saved[0]"], [f"{M}.saved[1]"]]


def test_a_views_base_is_not_a_holder(g: Globals) -> None:
    g["v"] = torch.ones(17)[2:5]
    assert [h.path for h in cudamem.who_holds(g["v"])] == [f"{M}.v"]
    g["v2"] = torch.ones(18)[1:][2:]  # a view of a view: one base
    assert [h.path for h in cudamem.who_holds(g["v2"])] == [f"{M}.v2"]


def test_views_base_still_named_when_something_holds_it(g: Globals) -> None:
    g["base"] = torch.ones(19)
    g["part"] = g["base"][3:]
    by_path = {h.path: h.via for h in cudamem.who_holds(g["part"])}
    assert by_path == {f"{M}.part": "itself", f"{M}.base": "view"}


# --------------------------------------------------------------------------- numpy


def test_numpy_array_from_tensor_is_a_holder(g: Globals) -> None:
    t = torch.ones(20)
    g["arr"] = t.numpy()
    result = cudamem.who_holds(t)
    by_path = {h.path: h.via for h in mine(result)}
    assert by_path == {f"{M}.arr": "numpy"}
    assert f"{M}.arr  (numpy array)" in str(result)


def test_numpy_array_in_a_dict_is_named_by_its_key(g: Globals) -> None:
    # gc tracks neither the array nor a dict that holds only untracked objects: the dict
    # shows only among the module dict's referents. The tensor is held elsewhere too (the
    # local), which once kept the search from looking for arrays at all.
    t = torch.ones(24)
    g["box"] = {"arr": t.numpy()}
    assert not gc.is_tracked(g["box"])
    by_path = {h.path: h.via for h in mine(cudamem.who_holds(t))}
    assert by_path == {f"{M}.box['arr']": "numpy"}


def test_numpy_array_in_nested_untracked_containers_and_a_local_dict() -> None:
    def keep() -> list[str]:
        t = torch.ones(25)
        box = {"arr": t.numpy()}
        deep = {"a": {"b": (t.numpy(), "x")}}
        paths = sorted(h.path.split(": ", 1)[1] for h in mine(cudamem.who_holds(t)))
        del box, deep
        return paths

    assert keep() == ["box['arr']", "deep['a']['b'][0]"]


def test_numpy_array_behind_from_numpy_is_a_holder(g: Globals) -> None:
    g["a"] = np.zeros(21, dtype=np.float32)
    t = torch.from_numpy(g["a"])
    assert {h.path: h.via for h in mine(cudamem.who_holds(t))} == {f"{M}.a": "numpy"}


def test_numpy_view_in_a_local_is_a_holder() -> None:
    def keep() -> Holders:
        t = torch.zeros(22)
        window = t.numpy()[5:9]
        result = cudamem.who_holds(t)
        del window
        return result

    result = keep()
    hits = [h for h in result if h.via == "numpy"]
    assert len(hits) == 1
    assert hits[0].path.endswith("in keep(): local 'window'")
    assert not any(h.root_kind == "unknown" for h in result)


def test_numpy_memory_elsewhere_is_not_a_holder(g: Globals) -> None:
    t = torch.ones(23)
    g["other"] = np.ones(23, dtype=np.float32)
    assert [h.path for h in mine(cudamem.who_holds(t))] == []


# --------------------------------------------------------------------------- hostile input


class Hostile:
    calls = 0

    def __init__(self, payload: Any) -> None:
        object.__setattr__(self, "payload", payload)

    def __getattr__(self, name: str) -> Any:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __eq__(self, other: object) -> bool:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __hash__(self) -> int:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __repr__(self) -> str:
        Hostile.calls += 1
        raise RuntimeError("no")


class HostileMeta(type):
    def __eq__(cls, other: object) -> bool:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __hash__(cls) -> int:
        Hostile.calls += 1
        raise RuntimeError("no")


class Strange(metaclass=HostileMeta):
    pass


def test_hostile_objects_in_huge_containers_are_never_called(g: Globals) -> None:
    t = torch.ones(24)
    g["crowd"] = [Hostile(t) for _ in range(2000)] + [Strange(), Strange]
    g["boss"] = Hostile([t] * 5000)
    g["table"] = dict.fromkeys(range(3), t)
    Hostile.calls = 0
    result = cudamem.who_holds(t, timeout=30.0)
    cudamem.live_tensors("cpu", holders=True)
    assert Hostile.calls == 0
    patterns = {h.pattern or h.path: h.count for h in mine(result)}
    assert patterns[f"{M}.crowd[0..1999].payload"] == 2000
    assert patterns[f"{M}.boss.payload[0..4999]"] == 5000
    assert patterns[f"{M}.table[0..2]"] == 3


def test_cycles_of_containers_holding_the_tensor(g: Globals) -> None:
    t = torch.ones(25)
    a: list[Any] = [t]
    b: list[Any] = [a]
    a.append(b)
    g["ring"] = b
    del a, b
    paths = [h.path for h in mine(cudamem.who_holds(t))]
    assert paths == [f"{M}.ring[0][0]"]


def test_100k_deep_nesting_stops_at_max_depth_without_recursion(g: Globals) -> None:
    t = torch.ones(26)
    deep: Any = [t]
    for _ in range(100_000):
        deep = [deep]
    g["deep"] = deep
    del deep
    try:
        result = cudamem.who_holds(t, timeout=30.0)
        assert result.stopped == "max_depth"
        (partial,) = [h for h in result if h.root_kind == "partial"]
        assert partial.path == "<list object>" + "[0]" * 40
    finally:
        # unwind from the outside in: freeing 100k nested lists at once recurses in C
        node = g.pop("deep")
        while type(node) is list and node and type(node[0]) is list:
            node = node[0]


# --------------------------------------------------------------------------- closures


def _closure_paths(monkeypatch: pytest.MonkeyPatch, guess: bool) -> tuple[list[str], int]:
    """Holders of a parameter that a chain of closures in this running frame reaches, and
    how many levels read the last ``gc.get_referrers`` scan's answer instead of scanning;
    ``guess=False`` turns off asking about a closure's likely holders ahead of time."""
    from cudamem.holders import _search

    model = torch.nn.Linear(3, 5)

    def step() -> torch.Tensor:
        return model(torch.ones(3))

    def tracked() -> torch.Tensor:
        return step()

    other = torch.ones(2)

    def unrelated() -> torch.Tensor:  # a closure in this frame that does not hold it
        return other

    reread: list[bool] = []
    real = _search.Search._referrers

    def counting(search: _search.Search) -> list[Any]:
        before = search._pool
        found = real(search)
        # the last scan's answer read again: no new scan
        reread.append(before is not None and search._pool is before)
        return found

    with monkeypatch.context() as m:
        m.setattr(_search.Search, "_referrers", counting)
        # No numpy-array pass for this CPU target: its first level would be a heap pass
        # (climbing several levels at once) instead of the scans this test counts.
        m.setattr(_search._autograd, "array_types", lambda: ())
        # And the Python pass: a compiled one makes every level a pass (no scans to count).
        m.setattr(_search._heapscan, "native", lambda: None)
        if not guess:
            m.setattr(_search.Search, "_likely_parents", lambda self: [])
        found = cudamem.who_holds(model.weight)
    assert tracked is not None and unrelated is not None
    return [h.path for h in mine(found)], sum(reread)


def test_closures_of_running_frames_are_named_through_every_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths, _ = _closure_paths(monkeypatch, guess=True)
    where = "in _closure_paths(): "
    assert any(p.endswith(f"{where}model.weight") for p in paths), paths
    assert any(p.endswith(f"{where}step (closure 'model').weight") for p in paths), paths
    assert any(
        p.endswith(f"{where}tracked (closure 'step') (closure 'model').weight") for p in paths
    ), paths
    assert not any("unrelated" in p or "other" in p for p in paths), paths


def test_guessing_a_closures_holders_saves_scans_and_changes_no_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cell, its closure tuple, the function and the next cell are one level each; asking
    about them in the scan that finds the cell answers the next levels without scanning the
    heap again for one object at a time, with the same paths in the same order."""
    guessed, reread = _closure_paths(monkeypatch, guess=True)
    plain, none = _closure_paths(monkeypatch, guess=False)
    assert guessed == plain
    # One level each, all answered by the scan that found the Linear: the cell of 'model',
    # step's closure tuple, step, the cell of 'step', tracked's closure tuple, tracked.
    assert (reread, none) == (6, 0), (reread, none)


# --------------------------------------------------------------------------- threads


def test_four_threads_at_once_find_the_same_paths_as_alone(g: Globals) -> None:
    t = torch.ones(27)
    g["shared"] = {"a": [t] * 100, "b": [{"t": t} for _ in range(200)]}
    del t  # this frame would be a holder seen from the other threads

    def paths() -> list[tuple[str, int]]:
        return sorted(
            (h.pattern or h.path, h.count) for h in cudamem.who_holds(g["shared"]["a"][0])
        )

    alone = paths()
    assert alone == [(f"{M}.shared['a'][0..99]", 100), (f"{M}.shared['b'][0..199]['t']", 200)]
    start = threading.Barrier(4)
    out: list[list[tuple[str, int]]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start.wait(10)
            for _ in range(3):
                out.append(paths())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    assert out == [alone] * 12
