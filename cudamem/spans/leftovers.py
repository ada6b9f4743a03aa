"""What a span left behind: ``LeakReport``, the storages created during a span that were
still alive after it, with holders (``span.leaks``, ``cudamem.leaks(since=span)``).

A plain frozen value (growth detection makes it; ``cudamem.render.leaks`` draws it), apart
from the detector so that a span can name the type of ``span.leaks`` without importing the
detector that hooks into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.present import PresentedHtml

if TYPE_CHECKING:
    from ..holders.census import LiveStorage
    from ..holders.culprits import Culprit

__all__ = ["LeakReport"]


@dataclass(frozen=True, slots=True)
class LeakReport(PresentedHtml):
    """Storages created during a span that were still alive after it, with holders."""

    span: str
    #: When the storages were checked: ``'at exit'`` or ``'now'``.
    checked: str
    count: int
    nbytes: int
    #: The largest ones (at most ``MAX_LISTED``); ``count``/``nbytes`` cover all.
    storages: tuple[LiveStorage, ...]
    culprits: tuple[Culprit, ...]
    notes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0
