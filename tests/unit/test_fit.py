"""The plan's arithmetic on plain numbers: fits, refusals, the largest n, checkpointing."""

from __future__ import annotations

import math

import pytest

from cudamem.fit._terms import (
    ModuleCost,
    Point,
    checkpoint_per_sample,
    choose_checkpoint,
    fit,
    largest_under,
    relative_error,
    terms_for,
)

MiB = 1 << 20


def test_two_probes_give_the_exact_line() -> None:
    a, b = 1514 * MiB, 846 * MiB
    line = fit([Point(4, 1, a + 4 * b), Point(8, 1, a + 8 * b)], terms_for(1))
    assert line.terms == ("1", "n")
    assert line.fixed == a and line.per_sample() == b
    assert line.at(150) == a + 150 * b


def test_more_probes_than_terms_is_least_squares() -> None:
    # Points off the line by +1, -1, +1, -1: the best line lies between them.
    points = [
        Point(n, 1, 100 + 10 * n + (1 if i % 2 == 0 else -1)) for i, n in enumerate((1, 2, 3, 4))
    ]
    line = fit(points, ("1", "n"))
    assert line.at(2) == pytest.approx(120 + 0.2, abs=1e-9)  # not through any one point exactly
    assert line.per_sample() == pytest.approx(9.6)


def test_two_lengths_fit_the_linear_and_quadratic_terms_per_sample() -> None:
    a, c, d = 1000 * MiB, 3 * 1024, 12  # bytes per token, bytes per token squared

    def peak(n: int, length: int) -> int:
        return a + n * (c * length + d * length * length)

    probes = [(4, 128), (8, 128), (4, 256)]
    line = fit([Point(n, ln, peak(n, ln)) for n, ln in probes], terms_for(2))
    assert line.terms == ("1", "n*L", "n*L^2")
    assert line.at(16, 1024) == pytest.approx(peak(16, 1024), rel=1e-12)
    assert line.per_sample(1024) == pytest.approx(c * 1024 + d * 1024 * 1024)


def test_three_lengths_fit_all_four_terms() -> None:
    def peak(n: int, length: int) -> int:
        return 7 * MiB + n * (5 * MiB + 300 * length + 2 * length * length)

    probes = [(4, 128), (8, 128), (4, 256), (4, 512)]
    line = fit([Point(n, ln, peak(n, ln)) for n, ln in probes], terms_for(3))
    assert line.terms == ("1", "n", "n*L", "n*L^2")
    assert line.at(64, 2048) == pytest.approx(peak(64, 2048), rel=1e-12)


def test_probes_that_cannot_tell_the_terms_apart_are_refused() -> None:
    with pytest.raises(ValueError, match="do not determine the terms"):
        fit([Point(4, 1, 10), Point(4, 1, 10)], ("1", "n"))
    with pytest.raises(ValueError, match="need at least 2 probes, got 1"):
        fit([Point(4, 1, 10)], ("1", "n"))


def test_relative_error() -> None:
    assert relative_error(102, 100) == pytest.approx(0.02)
    assert relative_error(0, 0) == 0.0
    assert math.isinf(relative_error(1, 0))


def test_largest_under_a_budget() -> None:
    def peak(n: int) -> float:
        return 1000.0 + 10.0 * n

    assert largest_under(peak, 1000.0 + 10.0 * 150) == 150
    assert largest_under(peak, 1000.0 + 10.0 * 150 - 1) == 149
    assert largest_under(peak, 1005.0) == 0  # not even one sample
    assert largest_under(lambda n: 0.0, 1.0, limit=1 << 20) == 1 << 20


def _cost(name: str, order: int, kept: float, upto: float, type_name: str = "Block") -> ModuleCost:
    return ModuleCost(name, type_name, 2, order, kept, 1.0, upto, 0.0)


def test_checkpointed_peak_where_it_was_and_inside_the_backward() -> None:
    blocks = [_cost(f"b{i}", i, 10.0, 10.0 * (i + 1)) for i in range(4)]
    # The peak at the loss (100 per sample): lower by each block's saving (10 - 1 output).
    assert checkpoint_per_sample(100.0, blocks[:2]) == pytest.approx(100.0 - 18.0)
    assert checkpoint_per_sample(100.0, []) == 100.0
    # A step whose peak is the forward's end: inside the last block's backward, its
    # recomputed activations come back.
    assert checkpoint_per_sample(40.0, blocks) == pytest.approx(40.0 - 3 * 9.0)


def test_choose_checkpoint_takes_repeated_blocks_as_few_as_needed() -> None:
    blocks = [_cost(f"b{i}", i, 10.0, 10.0 * (i + 1)) for i in range(4)]
    head = _cost("head", 4, 50.0, 90.0, type_name="Head")
    chosen = choose_checkpoint([*blocks, head], 100.0, 100.0 - 18.0)
    assert [m.name for m in chosen] == ["b0", "b1"]  # the head does not repeat
    everything = choose_checkpoint([*blocks, head], 100.0, 0.0)
    assert [m.name for m in everything] == ["b0", "b1", "b2", "b3"]  # as low as it goes
    assert choose_checkpoint([head], 100.0, 0.0) == ()
    stages = [_cost(f"layer{i}", i, 40.0, 40.0 * (i + 1), type_name="Sequential") for i in (1, 2)]
    chosen = choose_checkpoint([*stages, *blocks], 100.0, 90.0)
    assert [m.name for m in chosen] == ["b0", "b1"]  # blocks, not the stages that hold them
