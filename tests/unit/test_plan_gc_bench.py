"""``benchmarks/plan_gc.py`` on the CPU: both ways run a plan with one full collection after
the first (the warm-up's optimizer state raises the level), and the planner's freeze is put
back whichever way ran."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cudamem.fit import planner

from ..benchmark_import import benchmark


@pytest.fixture(scope="module")
def plan_gc() -> Iterator[Any]:
    with benchmark("plan_gc.py") as module:
        yield module


@pytest.mark.parametrize("frozen", [True, False])
def test_each_way_runs_one_later_full_collection(plan_gc: Any, frozen: bool) -> None:
    real = planner._frozen_heap
    seconds, later, count = plan_gc.one_plan(frozen)
    assert count == 1 and seconds > 0 and later >= 0
    assert planner._frozen_heap is real


def test_the_collections_are_counted_and_gc_put_back(plan_gc: Any) -> None:
    import gc

    real = gc.collect
    with plan_gc.counted_collections() as calls:
        gc.collect(1)
        gc.collect()
    assert [generation for generation, _ in calls] == [1, 2]
    assert gc.collect is real
