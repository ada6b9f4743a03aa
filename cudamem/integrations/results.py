"""The integrations' results: plain frozen values, apart from the frameworks that make them.

They import no framework (pytest, transformers, IPython), so their renderers
(``cudamem.render.integrations``, ``cudamem.render.notebook``) register with the other
renderers (the first ``str()`` of a result loads them all) without pulling a framework in.
Each is importable from the integration that returns it, too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..base.present import Presented, PresentedHtml

if TYPE_CHECKING:
    from ..holders.census import LiveStorage
    from ..holders.culprits import Culprit
    from ..holders.finder import Holders
    from ..ledger.reclaim import ReleaseResult

__all__ = ["IPythonHold", "MemoryCheck", "NotebookHolders", "TrainerRelease"]


@dataclass(frozen=True, slots=True)
class MemoryCheck(Presented):
    """What one test left behind and how high it went. Bytes are ints."""

    json_properties: ClassVar[tuple[str, ...]] = ("failed",)

    test: str
    #: ``cuda`` or ``cpu``: which storages were counted.
    device: str
    #: Storages created by the test and alive after it (the largest first), with holders.
    leaked: tuple[LiveStorage, ...]
    leaked_bytes: int
    #: The ``limit_gpu_leaks`` limit, ``None`` when leaks were not checked.
    leak_limit: int | None
    #: ``(device, bytes)``: allocated growth no live storage accounts for (CUDA only).
    unexplained: tuple[tuple[str, int], ...]
    #: ``(device, bytes)``: the most allocated at once beyond the start, ``()`` if unknown.
    peaks: tuple[tuple[str, int], ...]
    #: The ``limit_gpu_memory`` limit, ``None`` when the peak was not checked.
    memory_limit: int | None
    notes: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        """Whether a limit was passed."""
        if self.leak_limit is not None:
            if self.leaked_bytes > self.leak_limit:
                return True
            if any(b > self.leak_limit for _, b in self.unexplained):
                return True
        if self.memory_limit is not None:
            return any(b > self.memory_limit for _, b in self.peaks)
        return False

    @property
    def peak(self) -> int | None:
        """The highest per-device peak, ``None`` when not measured."""
        return max((b for _, b in self.peaks), default=None)


@dataclass(frozen=True, slots=True)
class TrainerRelease(Presented):
    """What ``release_trainer`` dropped, freed, and could not free. Bytes are ints."""

    json_properties: ClassVar[tuple[str, ...]] = ("remaining_bytes",)

    #: The references it set to ``None`` or cleared (``trainer.optimizer``, ...).
    dropped: tuple[str, ...]
    #: Storages of the model, its gradients and the optimizer state before the release.
    tracked: int
    tracked_bytes: int
    #: Those of them that are gone now.
    freed: int
    freed_bytes: int
    #: Those still alive, grouped by what holds them.
    remaining: tuple[Culprit, ...]
    #: ``cudamem.release`` (per GPU: cache returned to CUDA, still allocated).
    release: ReleaseResult | None
    notes: tuple[str, ...] = ()

    @property
    def remaining_bytes(self) -> int:
        """Bytes of tracked storages still alive."""
        return self.tracked_bytes - self.freed_bytes


@dataclass(frozen=True, slots=True)
class IPythonHold:
    """Paths through which IPython itself keeps the object, and the fix."""

    #: ``output`` (Out/_ cache), ``traceback`` (the last error), ``ipython`` (other).
    kind: str
    what: str
    paths: tuple[str, ...]
    fix: str


@dataclass(frozen=True, slots=True)
class NotebookHolders(PresentedHtml):
    """``cudamem.who_holds`` read for a notebook: your holders, then IPython's."""

    holders: Holders
    #: Paths from your own variables (``__main__.`` dropped: ``losses[3]``).
    user: tuple[str, ...]
    ipython: tuple[IPythonHold, ...]

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
