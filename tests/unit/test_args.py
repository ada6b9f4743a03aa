"""The argument rules every public function shares: errors name the argument and the value."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from cudamem.base.args import check_bool, check_int, check_seconds


def test_check_bool_accepts_only_bools() -> None:
    assert check_bool("peak", False) is False
    for bad in (0, 1, None, "yes"):
        with pytest.raises(TypeError, match=rf"^peak must be a bool, not {type(bad).__name__}$"):
            check_bool("peak", bad)


def test_check_int_rejects_bools_floats_and_values_below_the_minimum() -> None:
    assert check_int("top", 0, minimum=0) == 0
    assert check_int("top", -5) == -5  # no minimum, no bound
    for bad in (True, 1.0, "3", None):
        with pytest.raises(TypeError, match=rf"^top must be an int, not {type(bad).__name__}$"):
            check_int("top", bad, minimum=0)
    with pytest.raises(ValueError, match=r"^max_nodes must be >= 1, got 0$"):
        check_int("max_nodes", 0, minimum=1)


def test_check_seconds_takes_any_real_and_refuses_nan_negative_and_bools() -> None:
    assert check_seconds("timeout", 0) == 0.0
    assert check_seconds("timeout", Fraction(1, 4)) == 0.25
    assert math.isinf(check_seconds("timeout", math.inf))
    for bad in (True, "1", None, 1j):
        with pytest.raises(TypeError, match=r"^timeout must be a number of seconds, not "):
            check_seconds("timeout", bad)
    for bad in (-0.5, math.nan):
        with pytest.raises(ValueError, match=r"^timeout must be >= 0 seconds, got "):
            check_seconds("timeout", bad)
