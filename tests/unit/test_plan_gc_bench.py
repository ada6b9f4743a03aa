"""``benchmarks/plan_gc.py`` on the CPU: every way runs a plan with one full collection after
the first step (the warm-up's optimizer state raises the level), one at the start unless the
model given accounts for the allocated bytes, and the planner's freeze is put back whichever
way ran."""

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


@pytest.mark.parametrize(("frozen", "with_model"), [(True, True), (True, False), (False, False)])
def test_each_way_runs_one_later_full_collection(
    plan_gc: Any, frozen: bool, with_model: bool
) -> None:
    # a model whose tensors account for the allocated bytes: no full collection at the start
    real = planner.frozen_heap
    plan = plan_gc.one_plan(frozen, with_model=with_model)
    assert plan.later_count == 1 and plan.seconds > 0 and plan.later_full >= 0
    assert (plan.start_full == 0) is with_model
    assert planner.frozen_heap is real


def test_the_collections_are_counted_and_gc_put_back(plan_gc: Any) -> None:
    import gc

    real = gc.collect
    with plan_gc.counted_collections() as calls:
        gc.collect(1)
        gc.collect()
    assert [generation for generation, _ in calls] == [1, 2]
    assert gc.collect is real
