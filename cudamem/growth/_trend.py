"""How fast a series of levels rises: the robust per-call slope the growth detector
reports (Theil–Sen: the median of the pairwise slopes, so one outlier call can neither fake
nor hide a trend), measured from the call before the window's first rise on."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["rate", "theil_sen", "trimmed"]


def theil_sen(levels: Sequence[int]) -> float:
    """Median of pairwise slopes of equally spaced ``levels`` (bytes per call)."""
    slopes = sorted(
        (levels[j] - levels[i]) / (j - i)
        for i in range(len(levels))
        for j in range(i + 1, len(levels))
    )
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return float(slopes[mid]) if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def trimmed(levels: Sequence[int], rises: Sequence[bool]) -> tuple[int, ...]:
    """The window's ``levels`` from the call before its first rise on (flat calls before a
    leak began would drag the slope down); ``rises[i]`` is whether the change from
    ``levels[len(levels) - len(rises) - 1 + i]`` to the next level rose."""
    levels = tuple(levels)
    for i, rose in enumerate(rises):
        if rose:
            return levels[len(levels) - len(rises) - 1 + i :]
    return levels


def rate(levels: Sequence[int], rises: Sequence[bool]) -> float:
    """The per-call slope of the trimmed window (``trimmed``), in bytes."""
    return theil_sen(trimmed(levels, rises))
