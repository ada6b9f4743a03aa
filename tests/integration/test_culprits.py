"""The one culprit rule: path parsing, grouping real CPU storages, its users agreeing."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

import cudamem
from cudamem.base.data import to_data
from cudamem.holders import census
from cudamem.holders._storages import StorageRef, ref_of
from cudamem.holders.census import LiveStorage
from cudamem.holders.culprits import NO_HOLDER, Culprit, group_by_owner, group_culprits, held_shapes
from cudamem.holders.finder import Holder, Holders
from cudamem.holders.holder_path import HolderPath, Step
from cudamem.render.leaks import render_culprit

from ..routes import route, split, step

M = "tests.integration.test_culprits"

# What the scenarios keep (module globals: the census names them by path).
errors: list[BaseException] = []
step_outputs: list[dict[str, torch.Tensor]] = []
history: list[torch.Tensor] = []
runs: list[dict[str, torch.Tensor]] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    for box in (errors, step_outputs, history, runs):
        box.clear()
    yield
    for box in (errors, step_outputs, history, runs):
        box.clear()


# --------------------------------------------------------------------------- path rules


@pytest.mark.parametrize(
    ("steps", "container", "pattern", "item"),
    [
        (
            ("__main__.loss_history", "[3]"),
            "__main__.loss_history",
            "__main__.loss_history[*]",
            "__main__.loss_history[3]",
        ),
        (
            (
                "__main__.loss_history",
                "[3]",
                " → grad_fn MeanBackward0 → SigmoidBackward0 saved result",
            ),
            "__main__.loss_history",
            "__main__.loss_history[*]",
            "__main__.loss_history[3]",
        ),
        (
            (
                "__main__.errors",
                "[2]",
                ".__traceback__",
                ".tb_next",
                " → train.py:11 in g(): local 'x'",
            ),
            "__main__.errors",
            "__main__.errors[*].__traceback__.tb_next",
            "__main__.errors[2]",
        ),
        (
            ("m.model", ".step_outputs", "[7]", "['preds']"),
            "m.model.step_outputs",
            "m.model.step_outputs[*]['preds']",
            "m.model.step_outputs[7]",
        ),
        (
            ("__main__.outs", "['val']", "[2]"),
            "__main__.outs['val']",
            "__main__.outs['val'][*]",
            "__main__.outs['val'][2]",
        ),
        (
            ("__main__.activations", "['fc1']"),
            "__main__.activations['fc1']",
            "__main__.activations['fc1']",
            "__main__.activations['fc1']",
        ),
        # A dict's integer keys are indices too (outputs[step] = ...).
        (
            ("__main__.by_step", "[12]"),
            "__main__.by_step",
            "__main__.by_step[*]",
            "__main__.by_step[12]",
        ),
        (
            ("__main__.grid", "[1]", "[-2]"),
            "__main__.grid",
            "__main__.grid[*][*]",
            "__main__.grid[1]",
        ),
        # Keys are steps of their own: brackets and quotes inside them are text.
        (("__main__.d", "['a]b']"), "__main__.d['a]b']", "__main__.d['a]b']", "__main__.d['a]b']"),
        (
            ("__main__.d", "['x[3]']", "[0]"),
            "__main__.d['x[3]']",
            "__main__.d['x[3]'][*]",
            "__main__.d['x[3]'][0]",
        ),
        (
            ("__main__.d", "[(1, 2)]"),
            "__main__.d[(1, 2)]",
            "__main__.d[(1, 2)]",
            "__main__.d[(1, 2)]",
        ),
        (("__main__.last",), "__main__.last", "__main__.last", "__main__.last"),
        (
            ("train.py:42 in step(): local 'loss'",),
            "train.py:42 in step(): local 'loss'",
            "train.py:42 in step(): local 'loss'",
            "train.py:42 in step(): local 'loss'",
        ),
        (
            ("train.py:42 in step(): batch", "[0]"),
            "train.py:42 in step(): batch",
            "train.py:42 in step(): batch[*]",
            "train.py:42 in step(): batch[0]",
        ),
        # A file name with brackets is part of the frame's label, the root step.
        (
            ("exp[1].py:42 in step(): local 'x'",),
            "exp[1].py:42 in step(): local 'x'",
            "exp[1].py:42 in step(): local 'x'",
            "exp[1].py:42 in step(): local 'x'",
        ),
        (
            ("__main__.m", "[0]", ".bias", ".grad"),
            "__main__.m",
            "__main__.m[*].bias.grad",
            "__main__.m[0]",
        ),
        # A bound method's object reads as itself: the container runs through it.
        (
            ("__main__.cb", ".log", " → LitModel", ".seen", "[3]"),
            "__main__.cb.log → LitModel.seen",
            "__main__.cb.log → LitModel.seen[*]",
            "__main__.cb.log → LitModel.seen[3]",
        ),
    ],
)
def test_path_rules(steps: tuple[str, ...], container: str, pattern: str, item: str) -> None:
    path = _self_route(*steps)
    assert path.container == container
    assert path.item_pattern == pattern
    assert path.item == item


def _self_route(root: str, *steps: str) -> HolderPath:
    """``route``, with `` → LitModel`` read as a bound method's object."""
    kinds = [Step("self", s) if s == " → LitModel" else step(s) for s in steps]
    return HolderPath("global", (Step("root", root), *kinds))


def test_first_step_and_through_graph() -> None:
    path = route("__main__.h", "[0]", " → grad_fn MeanBackward0 → SigmoidBackward0 saved result")
    assert path.first_step == "__main__.h[0]"
    assert path.through_graph
    assert not route("__main__.h", "[0]").through_graph
    traceback = route("__main__.e", ".__traceback__", " → train.py:3 in f(): local 'x'")
    assert not traceback.through_graph
    assert traceback.first_step == "__main__.e.__traceback__"


def test_a_path_as_code_in_its_module_writes_it() -> None:
    """``text_in``: the root's module left out where the root lies in that module (a
    notebook's globals, IPython's output cache there), nowhere else, and never a step's."""
    assert route("__main__.losses", "[3]", " → grad_fn MeanBackward0").text_in("__main__") == (
        "losses[3] → grad_fn MeanBackward0"
    )
    assert route("__main__._oh", "[12]", root_kind="ipython").text_in("__main__") == "_oh[12]"
    assert route("train.losses", "[3]").text_in("__main__") == "train.losses[3]"
    assert route("__main___x.y").text_in("__main__") == "__main___x.y"  # not the module
    frame = route("train_step() frame: local '__main__.x'", root_kind="frame")
    assert frame.text_in("__main__") == frame.text
    assert HolderPath("global", ()).text_in("__main__") == ""


def test_deep_paths_stay_linear() -> None:
    deep = route("__main__.x", *["[0]"] * 20_000)
    assert deep.container == "__main__.x"
    assert deep.item_pattern == "__main__.x" + "[*]" * 20_000
    assert HolderPath("global", ()).container == ""  # no steps: nothing, never an error


# --------------------------------------------------------------------------- grouping


def _storage(nbytes: int, *holders: tuple[str, str]) -> LiveStorage:
    """A storage held through ``(path, root_kind)`` pairs."""
    found = tuple(Holder(split(p, kind), "?", "itself", nbytes, "cpu") for p, kind in holders)
    return LiveStorage(
        "cpu", nbytes, "float32", (), 1, False, 0, Holders("T", nbytes, "cpu", found)
    )


def test_unrooted_holders_are_never_culprits_of_their_own() -> None:
    items = [
        # A view's base, which only the view's C++ side holds, beside the view's real holder.
        _storage(100, ("<Tensor object>", "unknown"), (f"{M}.views[0]", "global")),
        _storage(100, (f"{M}.views[1]", "global"), ("<Tensor object>", "unknown")),
        # Nothing rooted at all: one group, whatever the unrooted labels.
        _storage(10, ("<Tensor object>", "unknown")),
        _storage(10, ("<tuple object>[1]._result.closure_loss", "cycle")),
    ]
    groups = group_culprits(items)
    assert [(g.holder, g.storages, g.nbytes) for g in groups] == [
        (f"{M}.views", 2, 200),
        (NO_HOLDER, 2, 20),
    ]
    assert groups[0].items == 2 and groups[0].patterns == (f"{M}.views[*]",)
    assert groups[1].example == "<Tensor object>"


def _frame_storage(nbytes: int, *paths: HolderPath) -> LiveStorage:
    found = tuple(Holder(p, "?", "itself", nbytes, "cpu") for p in paths)
    return LiveStorage(
        "cpu", nbytes, "float32", (), 1, False, 0, Holders("T", nbytes, "cpu", found)
    )


def _in_error(i: int, *local: str) -> HolderPath:
    return route(f"{M}.errors", f"[{i}]", ".__traceback__", ".tb_next", *local)


def test_a_container_totals_only_what_it_holds_as_the_survivors_are_held() -> None:
    """``like``: the kept errors' frames hold each call's input and, through the step's
    closure, the model made before the loop: the total counts the inputs alone."""
    frame = " → train.py:9 in step(): local 'x'"
    inputs = [_frame_storage(100, _in_error(i, frame)) for i in range(4)]
    weight = _frame_storage(
        1000, *(_in_error(i, " → train.py:9 in step(): model", "[0]", ".weight") for i in range(4))
    )
    assert inputs[3].holders is not None
    path = inputs[3].holders[0].route
    assert path.shape == f"{M}.errors[*].__traceback__.tb_next{frame}"
    assert weight.holders is not None
    assert weight.holders[0].route.shape.endswith("step(): model[*].weight")
    shapes = held_shapes(inputs[3:])  # the captured call's survivor
    assert shapes == {path.shape}
    (total,) = group_culprits([*inputs, weight], like=shapes)
    assert (total.holder, total.items, total.storages, total.nbytes) == (f"{M}.errors", 4, 4, 400)
    assert total.example == f"{M}.errors[0].__traceback__.tb_next{frame}"
    # Without ``like`` every storage given counts: the weight, and it is the example.
    (everything,) = group_culprits([*inputs, weight])
    assert (everything.storages, everything.nbytes) == (5, 1400)
    assert everything.example.endswith(".weight")
    assert group_culprits([weight], like=shapes) == []


def test_a_storage_without_holders_is_no_holders() -> None:
    s = LiveStorage("cpu", 8, "float32", (), 1, False, 0, None)
    (culprit,) = group_culprits([s])
    assert (culprit.holder, culprit.example, culprit.nbytes) == (NO_HOLDER, NO_HOLDER, 8)


def _refs(tensors: list[torch.Tensor]) -> list[StorageRef]:
    """Identities of the tensors' storages; empties the list (no holder of ours is left)."""
    refs = [r for r in (ref_of(t) for t in tensors) if r is not None]
    tensors.clear()
    return refs


def _mine(refs: list[StorageRef]) -> list[LiveStorage]:
    """The census's storages (with holders) among ``refs``."""
    return list(census.live_storages("cpu", holders=True, among=refs))


def _raise_with(i: int) -> None:
    x = torch.randn(300, 300)  # kept alive by the traceback's frame
    raise ValueError(i, x.shape)


def test_errors_with_tracebacks_are_one_culprit() -> None:
    for i in range(4):
        try:
            _raise_with(i)
        except ValueError as exc:
            errors.append(exc)
    tensors = []
    for e in errors:
        tb = e.__traceback__
        assert tb is not None and tb.tb_next is not None
        tensors.append(tb.tb_next.tb_frame.f_locals["x"])
    storages = _mine(_refs(tensors))
    (culprit,) = group_culprits(storages)
    assert culprit.holder == f"{M}.errors"
    assert (culprit.items, culprit.tensors, culprit.storages) == (4, 4, 4)
    assert culprit.nbytes == 4 * 300 * 300 * 4
    assert culprit.patterns == (f"{M}.errors[*].__traceback__.tb_next",)
    assert culprit.example.startswith(f"{M}.errors[")


def test_list_of_dicts_is_one_culprit_with_items_and_tensors() -> None:
    for _ in range(5):
        step_outputs.append({"preds": torch.randn(100, 100), "target": torch.randn(100, 50)})
    storages = _mine(_refs([v for d in step_outputs for v in d.values()]))
    (culprit,) = group_culprits(storages)
    assert culprit.holder == f"{M}.step_outputs"
    assert (culprit.items, culprit.tensors, culprit.storages) == (5, 10, 10)
    assert culprit.nbytes == 5 * (40_000 + 20_000)
    assert culprit.patterns == (f"{M}.step_outputs[*]['preds']", f"{M}.step_outputs[*]['target']")
    assert render_culprit(culprit) == f"{M}.step_outputs: 5 items, 10 tensors, 293.0 KiB"
    data = to_data(culprit)
    assert data["items"] == 5 and data["patterns"][0].endswith("['preds']")


def test_huge_container_is_one_culprit() -> None:
    history.extend(torch.full((4,), float(i)) for i in range(3000))
    storages = _mine(_refs(list(history)))
    culprits = group_culprits(storages)
    assert [(c.holder, c.items, c.storages, c.nbytes) for c in culprits] == [
        (f"{M}.history", 3000, 3000, 3000 * 16)
    ]


def test_the_loop_variable_loses_to_the_container_it_feeds() -> None:
    for _ in range(3):
        latest = torch.randn(64)
        history.append(latest)
    storages = _mine(_refs(list(history)))
    (culprit,) = group_culprits(storages)
    assert culprit.holder == f"{M}.history" and culprit.items == 3
    del latest


def test_graph_holders_and_leaks_agree_on_containers() -> None:
    # runs[i]['loss'] keeps a graph: find_graph_holders and leak culprits name one container.
    x = torch.randn(256, 256, requires_grad=True)
    for _ in range(3):
        runs.append({"loss": torch.sigmoid(x * 2).sum()})
    found = cudamem.find_graph_holders(device="cpu", timeout=60.0)
    mine = [h for h in found if "runs" in h.container]
    assert [(h.container, h.tensors) for h in mine] == [(f"{M}.runs", 3)]
    saved = [
        s
        for s in census.live_storages("cpu", holders=True)
        if any(f"{M}.runs[" in p for p in s.paths)
    ]
    culprits = [c for c in group_culprits(saved) if c.holder != NO_HOLDER]
    assert culprits[0].holder == f"{M}.runs"
    assert culprits[0].autograd_bytes >= 3 * 256 * 256 * 4


# --------------------------------------------------------------------------- in a warning


def test_culprit_cap_never_hides_a_container_behind_its_items() -> None:
    from cudamem.allocator import backend as _backend

    from .test_leaks import CpuFake

    fake = CpuFake(devices=1, contexts=(0,))
    cudamem.configure_leaks(max_culprits=2)
    try:
        with _backend.use(fake), warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(6):
                with cudamem.track("step", sync=False):
                    for _ in range(20):  # twenty tensors a call, one list
                        history.append(torch.empty(64 * 1024, dtype=torch.uint8))
                    fake.alloc(20 * 64 * 1024)
    finally:
        cudamem.configure_leaks()
    (warning,) = [w.message for w in record if isinstance(w.message, cudamem.LeakWarning)]
    growth = warning.growth
    assert growth is not None
    top = growth.culprits[0]
    assert top.holder == f"{M}.history"
    kept = 20 * growth.calls  # at the call that warned
    assert (top.items, top.tensors, top.nbytes) == (kept, kept, kept * 64 * 1024)
    assert len(growth.culprits) == 1
    assert f"{M}.history: {kept} tensors, " in str(warning)


def test_culprit_value_is_frozen_and_json_ready() -> None:
    c = Culprit("a.b", 2, 2, 10, 0, "a.b[0]", 2, ("a.b[*]",), "cuda")
    with pytest.raises(AttributeError):
        c.holder = "x"  # type: ignore[misc]
    assert to_data(c) == {
        "holder": "a.b",
        "tensors": 2,
        "storages": 2,
        "nbytes": 10,
        "autograd_bytes": 0,
        "example": "a.b[0]",
        "items": 2,
        "patterns": ["a.b[*]"],
        "device_type": "cuda",
    }
    assert str(c) == "a.b: 2 tensors, 10 B"


def test_the_example_leads_to_a_tensor_that_is_the_storage() -> None:
    """A stored exception keeps the failed step's frame: its activations and, through a
    closure, the model, whose new gradients survived too. The example names the step's own
    local, not the parameter whose ``.grad`` a storage is."""
    tb = ("__main__.errors", "[0]", ".__traceback__", ".tb_next")

    def storage(nbytes: int, *steps: str, via: str) -> LiveStorage:
        h = Holder(route(*tb, *steps), "__main__", via, nbytes, "cpu")
        return LiveStorage(
            "cpu", nbytes, "float32", (), 1, False, 0, Holders("T", nbytes, "cpu", (h,))
        )

    grad = storage(4096, " → train.py:9 in main(): models", "[0]", ".weight", via="grad")
    hidden = storage(1024, " → train.py:3 in step(): local 'hidden'", via="itself")
    bigger = storage(2048, " → train.py:3 in step(): local 'logits'", via="itself")
    for order in ([grad, hidden, bigger], [bigger, hidden, grad], [hidden, grad, bigger]):
        (culprit,) = group_culprits(order)
        assert culprit.holder == "__main__.errors" and culprit.nbytes == 7168
        assert (
            culprit.example
            == "__main__.errors[0].__traceback__.tb_next → train.py:3 in step(): local 'logits'"
        )


def test_group_by_owner_names_the_variable_that_keeps_a_model() -> None:
    def storage(nbytes: int, *holders: Holder) -> LiveStorage:
        return LiveStorage(
            "cpu", nbytes, "float32", (), 1, False, 0, Holders("T", nbytes, "cpu", holders)
        )

    def held(path: HolderPath, caller: bool = False) -> Holder:
        return Holder(path, "__main__", "itself", 8, "cpu", caller)

    frame = "train.py:12 in main(): model"
    items = [
        storage(100, held(route("__main__.model", ".lm_head", ".weight"))),
        storage(50, held(route("__main__.model", ".wte", ".weight"))),
        storage(70, held(route(frame, ".head", ".bias", root_kind="frame"))),
        storage(5, held(route("Cache", ".store", "['a']", root_kind="class"))),
        storage(9, held(route("__main__.t"), caller=True)),  # only the caller's own reference
    ]
    groups = group_by_owner(items)
    assert [(c.holder, c.storages, c.nbytes) for c in groups] == [
        ("__main__.model", 2, 150),
        (frame, 1, 70),
        (NO_HOLDER, 1, 9),
        ("Cache.store", 1, 5),
    ]
    assert groups[0].example == "__main__.model.lm_head.weight"
