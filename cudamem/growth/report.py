"""What growth detection returns: ``Growth``, a repeated span's sustained rise of its
allocated level and who holds it (``cudamem.render.leaks`` draws it). A plain frozen value;
a span's own leak report is ``cudamem.spans.leftovers.LeakReport``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.present import Presented

if TYPE_CHECKING:
    from ..holders.culprits import Culprit

__all__ = ["Growth"]


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
