"""What leak finding returns: a span's left-behind storages and a growth finding.

Plain frozen values (``cudamem.leaks`` makes them; ``cudamem.render.leaks`` draws them),
apart from the detector so that a span can name the type of ``span.leaks`` without
importing the detector that hooks into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base.present import Presented, PresentedHtml

if TYPE_CHECKING:
    from .holders.census import LiveStorage
    from .holders.culprits import Culprit

__all__ = ["Growth", "LeakReport"]


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


@dataclass(frozen=True, slots=True)
class Growth(Presented):
    """A sustained rise of a repeated span's allocated level, and who holds it."""

    name: str
    #: Robust per-call growth of the allocated level (bytes).
    per_call: int
    #: Calls of the span observed so far.
    calls: int
    #: Exit levels of the window that triggered the finding, oldest first.
    levels: tuple[int, ...]
    culprits: tuple[Culprit, ...]
    #: Bytes the captured call created that outlived the next call (the named part).
    retained: int | None
    notes: tuple[str, ...] = ()
