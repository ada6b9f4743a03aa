"""CPU tests of find_graph_holders(): containers that keep autograd graphs alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cudamem
from cudamem.base.data import to_data
from cudamem.holders import finder as _holders
from cudamem.scalars.logger import ScalarLogger

graph_history: list[torch.Tensor] = []


def test_find_graph_holders_names_seed000_loss_history() -> None:
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    graph_history.clear()
    for _ in range(3):
        graph_history.append(torch.sigmoid(x * 2).mean())
    clean = ScalarLogger()
    clean.append(torch.sigmoid(x * 2).mean())
    try:
        found = cudamem.find_graph_holders(timeout=60.0)
    finally:
        graph_history.clear()
    mine = [h for h in found if h.container.endswith("graph_history")]
    assert len(mine) == 1, str(found)
    (holder,) = mine
    assert holder.tensors == 3
    # saved sigmoid results (x, a leaf, excluded) + MulBackward0 saving the scalar 2 (8 B)
    assert 3 * 256 * 256 * 4 <= holder.graph_bytes <= 3 * 256 * 256 * 4 + 3 * 8
    assert holder.devices == ("cpu",)
    assert holder.example.endswith("graph_history[0]")
    assert "graph_history" in str(found)
    assert to_data(found)["graph_bytes"] >= holder.graph_bytes
    assert "graph_history" in str(holder)
    assert to_data(holder)["tensors"] == 3
    assert not any("clean" in h.container for h in found)


def test_find_graph_holders_keeps_nothing_alive() -> None:
    x = torch.randn(64, requires_grad=True)
    holder_list = [torch.sin(x * 2).sum()]
    ref = weakref.ref(holder_list[0])
    found = cudamem.find_graph_holders(device="cuda:0", timeout=60.0)
    assert len(found) == 0  # nothing on that device
    holder_list.clear()
    gc.collect()
    assert ref() is None


def test_moved_beside_who_holds() -> None:
    assert "find_graph_holders" in cudamem.__all__
    assert cudamem.find_graph_holders is _holders.find_graph_holders
    # The result types are imported from the module that defines them.
    for name in ("GraphHolder", "GraphHolders"):
        assert name in _holders.__all__ and name not in cudamem.__all__


@pytest.mark.parametrize(
    ("kwargs", "error", "word"),
    [
        ({"timeout": None}, TypeError, "timeout"),
        ({"timeout": -1.0}, ValueError, "timeout"),
        ({"max_tensors": "8"}, TypeError, "max_tensors"),
        ({"max_tensors": 0}, ValueError, "max_tensors"),
        ({"device": 0}, TypeError, "device"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, object], error: type[Exception], word: str
) -> None:
    with pytest.raises(error, match=word):
        cudamem.find_graph_holders(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("inner_first", [True, False])
def test_a_graph_is_named_through_its_outermost_owner(inner_first: bool) -> None:
    """An intermediate tensor inside a loss's graph is an owner too; what the two share is
    named through the loss, whichever of them the walk is handed first."""
    from cudamem.holders import _autograd

    w = torch.randn(8, 8, requires_grad=True)
    hidden = (torch.randn(8, 8) @ w).relu()
    loss = (hidden * 2).sum()
    owners = [hidden, loss] if inner_first else [loss, hidden]
    walk = _autograd.walk_graphs(owners)
    (owner, chain) = next((o, c) for o, c, *_rest, label in walk.saved if label == "variable")
    assert owner is loss
    assert chain == (
        "grad_fn SumBackward0 → MulBackward0 → ReluBackward0 → MmBackward0 → AccumulateGrad"
    )
    relu_result = [c for o, c, *_rest, label in walk.saved if label == "saved result"]
    assert relu_result == ["grad_fn SumBackward0 → MulBackward0 → ReluBackward0"]
    assert walk.nodes == 5
