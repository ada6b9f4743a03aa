"""The dataset's large Python containers: named with their element count and object bytes,
found without running the user's ``repr``/``__eq__``/``__hash__``/``__len__``."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Subset

from cudamem.host import _dataset_walk
from cudamem.host._dataset_walk import large_containers


class Items:
    def __init__(self, n: int) -> None:
        self.items = [{"id": i, "label": i % 10} for i in range(n)]
        self.name = "train"
        self.small = list(range(10))


class Trap:
    """Any of these running fails the test."""

    def __repr__(self) -> str:
        raise AssertionError("repr ran")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("__eq__ ran")

    def __hash__(self) -> int:
        raise AssertionError("__hash__ ran")

    def __len__(self) -> int:
        raise AssertionError("__len__ ran")


class Trapped:
    def __init__(self) -> None:
        self.records = [Trap() for _ in range(3000)]
        self.index = Trap()
        self.index.rows = {i: (i, str(i)) for i in range(5000)}  # type: ignore[attr-defined]


def test_a_list_of_dicts_is_named_with_its_count_and_bytes() -> None:
    ds = Items(20_000)
    (found,) = large_containers(ds)
    assert (found.path, found.kind, found.count, found.element) == (
        "dataset.items",
        "list",
        20_000,
        "dict",
    )
    exact = sys.getsizeof(ds.items) + sum(sys.getsizeof(d) for d in ds.items)
    # the dicts themselves at least, and at most twice that with their keys and values
    assert exact <= found.nbytes <= 2 * exact


def test_arrays_and_tensors_are_not_python_containers() -> None:
    class Arrays:
        def __init__(self) -> None:
            self.labels = np.arange(100_000)
            self.features = torch.zeros(100_000)
            self.blob = b"x" * 100_000

    assert large_containers(Arrays()) == ()


def test_wrappers_are_walked_into_with_the_path_through_them() -> None:
    inner = Items(5000)
    sub = Subset(inner, list(range(4000)))  # type: ignore[arg-type]
    paths = {c.path: c for c in large_containers(ConcatDataset([sub]))}
    assert "dataset.datasets" not in paths  # a list of one dataset: too small to name
    found = {c.path: c for c in large_containers(sub)}
    assert found["dataset.indices"].count == 4000 and found["dataset.indices"].element == "int"
    assert found["dataset.dataset.items"].count == 5000


def test_user_objects_are_sized_without_running_their_methods() -> None:
    found = {c.path: c for c in large_containers(Trapped())}
    assert found["dataset.records"].element == "Trap" and found["dataset.records"].count == 3000
    assert found["dataset.index.rows"].kind == "dict"
    assert found["dataset.index.rows"].element == "tuple"


def test_the_walk_is_bounded_in_depth() -> None:
    class Node:
        def __init__(self, child: object) -> None:
            self.child = child

    deep: object = Items(2000)
    for _ in range(_dataset_walk.MAX_DEPTH + 2):
        deep = Node(deep)
    assert large_containers(deep) == ()
    shallow = Node(Node(Items(2000)))
    assert [c.path for c in large_containers(shallow)] == ["dataset.child.child.items"]


@pytest.mark.parametrize("n", [999, 1000])
def test_small_containers_are_not_worth_naming(n: int) -> None:
    assert len(large_containers(Items(n))) == (n >= _dataset_walk.MIN_ELEMENTS)
