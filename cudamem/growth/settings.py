"""What growth detection is told and what it tells: ``LeakSettings`` (its thresholds, checked
by ``_validate``) and ``LeakWarning`` (the warning it raises, carrying the ``Growth``).

``configure_leaks``/``leak_settings`` (``cudamem.growth.detector``) set and read the live
settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..base.present import Presented
from .report import Growth

if TYPE_CHECKING:
    pass


__all__ = ["LeakSettings", "LeakWarning"]


class LeakWarning(UserWarning):
    """Memory keeps growing across calls of a span. ``warning.growth`` has the details."""

    def __init__(self, message: str, growth: Growth | None = None) -> None:
        super().__init__(message)
        self.growth = growth


@dataclass(frozen=True, slots=True)
class LeakSettings(Presented):
    """Thresholds of growth detection (see the module docstring for the rule)."""

    #: Watch repeated spans at all.
    enabled: bool = True
    #: Calls not judged; the level after the last of them is the baseline (the first step
    #: allocates optimizer state, cuBLAS workspaces, caches).
    warmup: int = 1
    #: Calls looked at: the last ``window`` level changes.
    window: int = 8
    #: Calls of the window that must have risen by ``min_bytes_per_call`` or more.
    min_rises: int = 3
    #: Smallest per-call growth that counts (a rise, and the window's robust slope).
    min_bytes_per_call: int = 64 * 1024
    #: Warn again for the same holders when the rate changes by this factor.
    rate_change: float = 2.0
    #: Share of the per-call growth the survivors of a call must hold for a warning.
    min_explained: float = 0.5
    #: Holder groups named in a warning.
    max_culprits: int = 5
    #: Print an out-of-memory post-mortem when an OOM leaves a span (see ``cudamem.on_oom``).
    span_oom_reports: bool = True


def _validate(s: LeakSettings) -> None:
    def positive_int(name: str, value: Any, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    positive_int("warmup", s.warmup, 1)
    positive_int("window", s.window, 2)
    positive_int("min_rises", s.min_rises, 2)
    positive_int("min_bytes_per_call", s.min_bytes_per_call, 1)
    positive_int("max_culprits", s.max_culprits, 1)
    if s.min_rises > s.window:
        raise ValueError(f"min_rises ({s.min_rises}) cannot exceed window ({s.window})")
    if not isinstance(s.rate_change, (int, float)) or not s.rate_change > 1.0:
        raise ValueError(f"rate_change must be a number > 1, got {s.rate_change!r}")
    explained = s.min_explained
    if isinstance(explained, bool) or not isinstance(explained, (int, float)):
        raise ValueError(f"min_explained must be a number in (0, 1], got {explained!r}")
    if not 0.0 < explained <= 1.0:
        raise ValueError(f"min_explained must be a number in (0, 1], got {explained!r}")
    for name in ("enabled", "span_oom_reports"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(s, name)!r}")
