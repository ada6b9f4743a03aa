"""CPU tests of who_holds(): one per root and container kind, with exact paths."""

from __future__ import annotations

import asyncio
import collections
import enum
import gc
import json
import sys
import threading
import types
import weakref
from collections.abc import Generator
from typing import Any, ClassVar

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cudamem
from cudamem.holders.finder import Holder
from cudamem.render.json import to_json

M = __name__  # module globals are named from this module


def paths(obj: Any, **kw: Any) -> list[str]:
    return cudamem.who_holds(obj, **kw).paths


def _clear(*names: str) -> None:
    for n in names:
        globals().pop(n, None)


# --------------------------------------------------------------------------- globals


def test_seed_000_list_holds_after_del() -> None:
    global saved
    x = torch.ones(64, 64)
    saved = [x]
    ptr = x.untyped_storage().data_ptr()
    del x
    try:
        result = cudamem.who_holds(saved[0])
        assert result.paths == [f"{M}.saved[0]"]
        h = result[0]
        assert h.root_kind == "global" and h.root == M and h.via == "itself"
        assert h.nbytes == 64 * 64 * 4 and h.device == "cpu"
        assert saved[0].untyped_storage().data_ptr() == ptr
    finally:
        _clear("saved")


def test_caller_reference_marked_once() -> None:
    t = torch.zeros(3)
    result = cudamem.who_holds(t)
    assert len(result) == 1
    h = result[0]
    assert h.caller and h.root_kind == "frame"
    assert h.path.endswith("in test_caller_reference_marked_once(): local 't'")
    assert "your own reference" in str(result)


class Trainer:
    def __init__(self) -> None:
        self.outputs: dict[str, list[Any]] = {"val": [None, None, None]}


def test_nested_containers_and_attributes() -> None:
    global trainer
    trainer = Trainer()
    t = torch.ones(4)
    trainer.outputs["val"][2] = t
    try:
        assert f"{M}.trainer.outputs['val'][2]" in paths(t)
    finally:
        _clear("trainer")


class Slotted:
    __slots__ = ("a", "b")


def test_slots() -> None:
    global slotted
    slotted = Slotted()
    slotted.b = torch.ones(2)
    try:
        assert f"{M}.slotted.b" in paths(slotted.b)
    finally:
        _clear("slotted")


class Color(enum.Enum):
    RED = 1


class OddKey:
    pass


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("k", "['k']"),
        (3, "[3]"),
        (2.5, "[2.5]"),
        (True, "[True]"),
        (None, "[None]"),
        (Color.RED, "[Color.RED]"),
        ((1, "a"), "[(1, 'a')]"),
        ((7,), "[(7,)]"),
    ],
)
def test_dict_keys(key: Any, text: str) -> None:
    global table
    t = torch.ones(1)
    table = {key: t}
    try:
        assert f"{M}.table{text}" in paths(t)
    finally:
        _clear("table")


def test_other_dict_keys_named_by_type() -> None:
    global table
    t = torch.ones(1)
    table = {OddKey(): t}
    try:
        assert f"{M}.table[<OddKey>]" in paths(t)
    finally:
        _clear("table")


def test_tuple_deque_and_set() -> None:
    global tup, dq, st
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    tup = (0, a)
    dq = collections.deque([None, None, b])
    st = {c}
    try:
        assert f"{M}.tup[1]" in paths(a)
        assert f"{M}.dq[2]" in paths(b)
        assert f"{M}.st (set member)" in paths(c)
    finally:
        _clear("tup", "dq", "st")


class Cache:
    store: ClassVar[dict[str, Any]] = {}


def test_class_attribute() -> None:
    t = torch.ones(5)
    Cache.store["a"] = t
    try:
        result = cudamem.who_holds(t)
        # a class outside __main__ is named with its module; in a script: Cache.store['a']
        path = f"{M}.Cache.store['a']"
        assert path in result.paths
        assert [h.root_kind for h in result if h.path == path] == ["class"]
    finally:
        Cache.store.clear()


def _make_closure() -> tuple[Any, torch.Tensor]:
    buf = torch.ones(6)

    def step() -> torch.Tensor:
        return buf

    return step, buf


def test_closure_and_defaults() -> None:
    global step_fn, with_default
    step_fn, t = _make_closure()
    d = torch.ones(7)

    def with_default_(x: torch.Tensor = d) -> torch.Tensor:
        return x

    with_default = with_default_
    del with_default_
    try:
        assert f"{M}.step_fn (closure 'buf')" in paths(t)
        assert f"{M}.with_default.__defaults__[0]" in paths(d)
    finally:
        _clear("step_fn", "with_default")


# --------------------------------------------------------------------------- frames


def _inner(probe: dict[str, Any]) -> None:
    probe["result"] = cudamem.who_holds(probe.pop("t"))


def test_frames_up_the_stack() -> None:
    batch = torch.ones(8)
    probe = {"t": batch}
    _inner(probe)
    result = probe.pop("result")
    line = [h for h in result if "local 'batch'" in h.path]
    assert len(line) == 1
    assert line[0].path.startswith("test_holders.py:")
    assert line[0].path.endswith("in test_frames_up_the_stack(): local 'batch'")
    assert not any("cudamem" in p and ".py:" in p for p in result.paths)


def test_other_thread_frame() -> None:
    ready, done = threading.Event(), threading.Event()
    box: list[torch.Tensor] = []

    def worker() -> None:
        held = torch.ones(9)
        box.append(held)
        ready.set()
        done.wait(10)

    th = threading.Thread(target=worker, name="loader")
    th.start()
    ready.wait(10)
    try:
        t = box.pop()
        found = [p for p in paths(t) if "[thread loader]" in p]
        assert len(found) == 1
        assert found[0].endswith("in worker(): local 'held'")
    finally:
        done.set()
        th.join()


def _gen() -> Generator[int, None, None]:
    kept = torch.ones(10)
    yield 1
    del kept


def test_suspended_generator_and_coroutine() -> None:
    global gen_obj, coro_obj
    gen_obj = _gen()
    next(gen_obj)
    kept = gen_obj.gi_frame.f_locals["kept"]

    async def waiter(x: torch.Tensor) -> None:
        await asyncio.sleep(0)

    c = torch.ones(11)
    coro_obj = waiter(c)
    try:
        p = paths(kept)
        assert any(
            x.startswith(f"{M}.gen_obj → test_holders.py:")
            and x.endswith("in _gen() (suspended generator): local 'kept'")
            for x in p
        ), p
        assert any(x.startswith(f"{M}.coro_obj → ") and "local 'x'" in x for x in paths(c))
    finally:
        coro_obj.close()
        _clear("gen_obj", "coro_obj")


def test_last_traceback() -> None:
    def fail() -> None:
        doomed = torch.ones(12)
        raise ValueError(doomed.shape)

    try:
        fail()
    except ValueError:
        sys.last_traceback = sys.exc_info()[2]
    try:
        tb = sys.last_traceback
        while tb.tb_next is not None:
            tb = tb.tb_next
        t = tb.tb_frame.f_locals["doomed"]
        del tb
        result = cudamem.who_holds(t)
        hits = [h for h in result if h.root_kind == "traceback"]
        assert len(hits) == 1
        assert hits[0].path.startswith("sys.last_traceback.tb_next → test_holders.py:")
        assert hits[0].path.endswith("in fail(): local 'doomed'")
    finally:
        del sys.last_traceback


def test_ipython_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_main = types.ModuleType("__main__")
    t = torch.ones(13)
    fake_main.Out = {12: t}  # type: ignore[attr-defined]
    fake_main._ = t  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))
    result = cudamem.who_holds(t)
    ip = sorted(h.path for h in result if h.root_kind == "ipython")
    assert ip == ["Out[12]", "_"]


# --------------------------------------------------------------------------- torch roots


def test_module_parameters_buffers_and_grad() -> None:
    global model
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model.lin1 = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    try:
        assert f"{M}.model[0].weight" in paths(model[0].weight)
        assert f"{M}.model[1].running_mean" in paths(model[1].running_mean)
        assert f"{M}.model.lin1.bias" in paths(model.lin1.bias)
        grad = model[0].weight.grad
        assert f"{M}.model[0].weight.grad" in [h.path for h in cudamem.who_holds(grad)]
    finally:
        _clear("model")


def test_optimizer_state() -> None:
    global net, optimizer
    net = torch.nn.Module()
    net.lin1 = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(net.parameters())
    net.lin1(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    try:
        exp_avg = optimizer.state[net.lin1.weight]["exp_avg"]
        assert f"{M}.optimizer.state[<{M}.net.lin1.weight>]['exp_avg']" in paths(exp_avg) or (
            f"{M}.optimizer.state[<net.lin1.weight>]['exp_avg']" in paths(exp_avg)
        )
    finally:
        _clear("net", "optimizer")


def test_autograd_saved_tensor_through_loss_history() -> None:
    global loss_history
    x = torch.randn(64, 64, requires_grad=True)
    loss_history = [torch.sigmoid(x * 2).mean() for _ in range(4)]
    try:
        saved = loss_history[3].grad_fn.next_functions[0][0]._saved_result
        result = cudamem.who_holds(saved)
        del saved
        expected = f"{M}.loss_history[3] → grad_fn MeanBackward0 → SigmoidBackward0 saved result"
        hit = [h for h in result if h.path == expected]
        assert len(hit) == 1 and hit[0].via == "saved" and hit[0].is_alias
        assert hit[0].nbytes == 64 * 64 * 4
        # the leaf is held through each graph's AccumulateGrad, and by the caller
        leaf = [h.path for h in cudamem.who_holds(x)]
        assert any(p.endswith("AccumulateGrad variable") for p in leaf)
    finally:
        _clear("loss_history")


def test_saved_tensors_freed_by_backward_are_skipped() -> None:
    x = torch.randn(8, requires_grad=True)
    y = torch.sigmoid(x).sum()
    y.backward()
    out = y.grad_fn.next_functions[0][0]
    result = cudamem.who_holds(x)
    assert all("saved result" not in p for p in result.paths)
    del out


def test_checkpoint_nodes_not_inspected() -> None:
    calls = {"forward": 0}
    lin = torch.nn.Linear(4, 4)

    def block(a: torch.Tensor) -> torch.Tensor:
        calls["forward"] += 1
        return torch.relu(lin(a) * 2)

    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False)
    assert calls["forward"] == 1
    result = cudamem.who_holds(x)
    assert calls["forward"] == 1  # the unpack hook (recomputation) never ran
    assert any(n.startswith("not inspected: grad_fn ReluBackward0") for n in result.notes)
    del out


def test_aliases_view_and_detach() -> None:
    global views
    base = torch.ones(16)
    views = {"view": base[2:5], "detached": base.detach()}
    try:
        by_path = {h.path: h.via for h in cudamem.who_holds(base)}
        assert by_path[f"{M}.views['view']"] == "view"
        assert by_path[f"{M}.views['detached']"] == "alias"
    finally:
        _clear("views")


def test_non_tensor_object_by_identity() -> None:
    global registry
    obj = OddKey()
    registry = {"o": obj}
    try:
        result = cudamem.who_holds(obj)
        assert f"{M}.registry['o']" in result.paths
        assert result.nbytes is None
    finally:
        _clear("registry")


# --------------------------------------------------------------------------- cycles, safety


class Node:
    pass


def test_unreachable_cycle() -> None:
    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        t = torch.ones(17)
        a.payload = t
        del a, b
        result = cudamem.who_holds(t)
        cyc = [h for h in result if h.root_kind == "cycle"]
        assert len(cyc) == 1
        assert cyc[0].path.endswith(".payload") and cyc[0].path.startswith("<Node object>")
        assert "unreachable cycle, freed by gc.collect()" in str(result)
    finally:
        gc.enable()
        gc.collect()


class Hostile:
    calls = 0

    def __getattr__(self, name: str) -> Any:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __getattribute__(self, name: str) -> Any:
        if name not in ("__dict__", "__class__"):
            Hostile.calls += 1
        return object.__getattribute__(self, name)

    def __eq__(self, other: object) -> bool:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __hash__(self) -> int:
        Hostile.calls += 1
        return 1

    def __repr__(self) -> str:
        Hostile.calls += 1
        raise RuntimeError("no")

    def __len__(self) -> int:
        Hostile.calls += 1
        raise RuntimeError("no")

    @property
    def prop(self) -> int:
        Hostile.calls += 1
        raise RuntimeError("no")


class HostileDict(dict):  # type: ignore[type-arg]
    def items(self) -> Any:  # type: ignore[override]
        Hostile.calls += 1
        raise RuntimeError("no")

    def __iter__(self) -> Any:
        Hostile.calls += 1
        raise RuntimeError("no")


class HostileTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        Hostile.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_hostile_objects_are_never_called() -> None:
    global hostile, hostile_map
    t = torch.ones(18)
    h = Hostile()
    object.__setattr__(h, "payload", t)
    hostile_map = HostileDict({h: [t[:2]], "x": t})
    hostile = [h, weakref.proxy(h)]
    sub = torch.ones(3).as_subclass(HostileTensor)
    Hostile.calls = 0
    try:
        result = cudamem.who_holds(t)
        cudamem.who_holds(sub)
        cudamem.live_tensors()
        assert Hostile.calls == 0
        assert f"{M}.hostile[0].payload" in result.paths
        assert f"{M}.hostile_map['x']" in result.paths
        assert f"{M}.hostile_map[<Hostile>][0]" in result.paths
    finally:
        _clear("hostile", "hostile_map")


def test_no_reference_kept() -> None:
    global keeper
    t = torch.ones(19)
    keeper = {"a": [t]}
    ref = weakref.ref(t)
    result = cudamem.who_holds(t)
    text = to_json(result)
    del t, result
    keeper = None
    assert ref() is None
    assert json.loads(text)["holders"]
    _clear("keeper")


def test_no_reference_kept_in_a_function_frame() -> None:
    def body() -> weakref.ref[torch.Tensor]:
        x = torch.ones(20)
        r = weakref.ref(x)
        cudamem.who_holds(x)
        del x  # the f_locals snapshot must not keep it alive until body() returns
        assert r() is None
        return r

    assert body()() is None


def test_deep_nesting_no_recursion_error() -> None:
    global deep
    t = torch.ones(21)
    deep = [t]
    for _ in range(5000):
        deep = [deep]
    try:
        result = cudamem.who_holds(t, max_depth=50)
        assert any("max_depth" in n for n in result.notes)
        deep = [t]
        for _ in range(150):
            deep = [deep]
        result = cudamem.who_holds(t, max_depth=200)
        assert result.paths[0] == f"{M}.deep" + "[0]" * 151
    finally:
        _clear("deep")


def test_six_containers_deep() -> None:
    global root
    t = torch.ones(22)
    root = {"a": [None, {"b": ({"c": [t]},)}]}
    try:
        assert paths(t)[0] == f"{M}.root['a'][1]['b'][0]['c'][0]"
    finally:
        _clear("root")


def test_bounds_note_on_max_nodes_and_timeout() -> None:
    global wide
    t = torch.ones(23)
    wide = [[[t]]]
    try:
        assert any("max_nodes" in n for n in cudamem.who_holds(t, max_nodes=2).notes)
        assert any("timeout" in n for n in cudamem.who_holds(t, timeout=0.0).notes)
    finally:
        _clear("wide")


def test_render_and_json() -> None:
    global shown
    t = torch.ones(24)
    shown = [t, t[1:]]
    try:
        result = cudamem.who_holds(t)
        text = str(result)
        assert text.splitlines()[0] == "Tensor float32[24] on cpu, 96 B: 3 holders"
        assert f"  {M}.shown[1]  (view)" in text.splitlines()
        data = json.loads(to_json(result))
        assert data["nbytes"] == 96 and data["device"] == "cpu"
        assert {h["path"] for h in data["holders"]} >= {f"{M}.shown[0]", f"{M}.shown[1]"}
        assert isinstance(result[0], Holder) and len(result[0:2]) == 2
    finally:
        _clear("shown")


def test_no_cyclic_collection_runs_inside_a_search_and_gc_is_back_on_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a threshold of one allocation, any moment of the search with gc enabled collects:
    # a full collection of a large heap there would eat the search's timeout.
    from cudamem.holders import finder as holders_module

    t = torch.zeros(8)
    held = {"t": t}
    inside: list[bool] = []
    events: list[bool] = []
    search = holders_module._find_holders

    def marked(*args: Any) -> Any:
        inside.append(True)
        try:
            return search(*args)
        finally:
            inside.clear()

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            events.append(bool(inside))

    monkeypatch.setattr(holders_module, "_find_holders", marked)
    before = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(note)
    try:
        found = cudamem.who_holds(t)
        assert gc.isenabled()
        _ = [[] for _ in range(10)]  # and it collects again once the search has returned
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*before)
    assert any("held['t']" in p for p in found.paths), found.paths
    assert held["t"] is t
    assert True not in events
    assert False in events


def test_the_direct_holder_survives_max_paths_when_many_roots_reach_a_graph() -> None:
    # Seventy modules reach one shared dict whose loss's graph reaches the leaf ``x``; the
    # running frame that holds ``x`` directly is read after every module global. The cap on
    # paths keeps direct paths before graph paths, so the real holder is never the one cut.
    names = [f"_cudamem_test_root_{i}" for i in range(70)]

    def ask(obj: torch.Tensor) -> Any:
        return cudamem.who_holds(obj, max_paths=8)

    def owner() -> Any:
        x = torch.randn(64, requires_grad=True)
        shared = {"losses": [torch.sigmoid(x * 2).mean()]}
        for name in names:
            module = types.ModuleType(name)
            module.shared = shared  # type: ignore[attr-defined]
            sys.modules[name] = module
        return ask(x)

    try:
        found = owner()
    finally:
        for name in names:
            sys.modules.pop(name, None)
    assert len(found.holders) <= 8
    assert any(p.endswith("in owner(): local 'x'") for p in found.paths), found.paths
    assert any("AccumulateGrad" in p for p in found.paths)  # the graph paths fill the rest
    assert "more paths than max_paths; the rest are not shown" in found.notes


# --------------------------------------------------------------------------- path structure


class LitModel:
    """A module whose bound method a callback keeps (``self.log = module.log``)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def log(self) -> None:
        pass


class Callback:
    log: Any = None


def test_a_bound_method_reads_as_the_object_it_is_bound_to() -> None:
    global cb
    model = LitModel()
    model.seen.append(torch.ones(16))
    cb = Callback()
    cb.log = model.log
    ref = weakref.ref(model)
    del model
    try:
        assert ref() is not None  # only the bound method keeps the model
        held = cudamem.who_holds(cb.log.__self__.seen[0])
        (h,) = [h for h in held if not h.caller]
        assert h.path == f"{M}.cb.log → LitModel.seen[0]"
        assert "__self__" not in h.path
        assert h.route.container == f"{M}.cb.log → LitModel.seen"
        assert [s.kind for s in h.route.steps] == ["root", "attr", "self", "attr", "index"]
    finally:
        _clear("cb")


def _failing_step() -> None:
    hidden = torch.ones(32)

    def inner() -> torch.Tensor:  # makes ``hidden`` a cell the frame shares
        return hidden

    raise RuntimeError(f"step failed ({inner().numel()} values)")


def test_a_frame_on_a_path_is_named_by_its_function() -> None:
    global errors
    errors = []
    try:
        _failing_step()
    except RuntimeError as exc:
        errors.append(exc)
    try:
        tb = errors[0].__traceback__
        assert tb is not None and tb.tb_next is not None
        hidden = tb.tb_next.tb_frame.f_locals["hidden"]
        held = cudamem.who_holds(hidden)
        mine = [h for h in held if h.path.startswith(f"{M}.errors")]
        assert len(mine) == 1, held.paths
        h = mine[0]
        assert h.path.startswith(f"{M}.errors[0].__traceback__.tb_next → test_holders.py:")
        assert h.path.endswith(" in _failing_step(): local 'hidden'")
        assert "<frame>" not in h.path and "cell_contents" not in h.path
        assert h.route.container == f"{M}.errors"
        assert h.route.item_pattern == f"{M}.errors[*].__traceback__.tb_next"
        assert not h.route.through_graph
        del hidden
    finally:
        _clear("errors")


def test_routes_of_a_real_search_carry_the_graph_and_the_item() -> None:
    global history
    w = torch.ones(64, 64, requires_grad=True)
    history = [(torch.sigmoid(w * 2)).mean() for _ in range(3)]
    try:
        saved = history[1].grad_fn.next_functions[0][0]._saved_result  # type: ignore[union-attr]
        found = cudamem.who_holds(saved)
        graph = [h for h in found if h.route.through_graph]
        assert graph and all(h.via == "saved" for h in graph)
        h = graph[0]
        assert h.route.container == f"{M}.history"
        assert h.route.item == f"{M}.history[1]"
        assert h.route.first_step == f"{M}.history[1]"
        assert [s.kind for s in h.route.steps][:2] == ["root", "index"]
        assert h.route.steps[-1].kind == "graph"
        assert json.loads(to_json(h))["path"] == h.path == str(h.route)
        del saved
    finally:
        _clear("history")
