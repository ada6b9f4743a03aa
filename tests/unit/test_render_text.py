"""The text primitives every renderer uses: byte sizes, durations, aligned tables."""

from __future__ import annotations

import pytest

from cudamem.base.format import format_bytes, format_duration
from cudamem.render.text import render_table

MiB = 1024**2


@pytest.mark.parametrize(
    ("n", "signed", "text"),
    [
        (None, False, "n/a"),
        (0, False, "0 B"),
        (0, True, "+0 B"),
        (1023, False, "1023 B"),
        (1024, False, "1.0 KiB"),
        (1536, False, "1.5 KiB"),
        (256 * MiB, False, "256.0 MiB"),
        (256 * MiB, True, "+256.0 MiB"),
        (-256 * MiB, False, "-256.0 MiB"),
        (-256 * MiB, True, "-256.0 MiB"),
        (3 * 1024**3 // 2, False, "1.5 GiB"),
        (2048 * 1024**3, False, "2048.0 GiB"),
    ],
)
def test_format_bytes(n: int | None, signed: bool, text: str) -> None:
    assert format_bytes(n, signed=signed) == text


def test_unknown_bytes_never_read_as_zero() -> None:
    assert format_bytes(None, signed=True) == "n/a"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0 µs"),
        (0.0000424, "42 µs"),
        (0.0032, "3.2 ms"),
        (0.9994, "999.4 ms"),
        (2.5, "2.50 s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_table_aligns_first_column_left_and_the_rest_right() -> None:
    text = render_table(["name", "bytes"], [["a", "1.0 KiB"], ["longer", "2 B"]], title="T")
    assert text.splitlines() == [
        "T",
        "name      bytes",
        "------  -------",
        "a       1.0 KiB",
        "longer      2 B",
    ]


def test_table_align_per_column_and_no_trailing_spaces() -> None:
    text = render_table(["a", "b", "c"], [["x", "y", ""]], align="lrl")
    assert text.splitlines() == ["a  b  c", "-  -  -", "x  y"]


def test_table_refuses_mismatched_rows_and_align() -> None:
    with pytest.raises(ValueError, match="align has 1 column, headers have 2"):
        render_table(["a", "b"], [], align="l")
    with pytest.raises(ValueError, match="row has 1 cell, expected 2"):
        render_table(["a", "b"], [["only"]])
