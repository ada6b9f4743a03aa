"""What explains a growth the detector measured: the holders of the storages a captured call
left alive (``name_culprits``), or, where no storage does, cuBLAS workspaces piling up
(``workspace_notes``)."""

from __future__ import annotations

import logging

from ..allocator import backend as _backend
from ..base.format import format_bytes
from ..holders import census
from ..holders.census import StorageSnapshot
from ..holders.culprits import NO_HOLDER, Culprit, group_culprits, held_shapes
from ..holders.unaccounted import unaccounted

__all__ = ["STEP_WORKSPACES", "cublas_workspaces", "name_culprits", "workspace_notes"]


logger = logging.getLogger("cudamem.leaks")


def name_culprits(pending: StorageSnapshot, notes: list[str], floor: int) -> list[Culprit]:
    """Culprits for the storages a captured call left alive, with container totals.

    The containers are named from the survivors, by a holder search of their own: what
    else lives on the device (in a long process, storages an earlier step or test left
    behind, hanging off structures of hundreds of thousands of objects) cannot use up that
    search's limits. Each container is then totalled over every live storage it holds
    through paths of the survivors' shapes (``culprits.held_shapes``): "loss_history: 10
    tensors, 40 MiB" rather than the one captured call's share, and never what the same
    entries reach that no call made (the model a kept traceback's frame holds through its
    closure: it was there before the loop, and a captured call would have left none of
    it). When the search over every storage stopped at a limit before it reached a
    container, that container keeps the survivors' figures and a note says so.
    """
    device_type = _backend.get().storage_device_type()
    survivors = pending.storages(holders=True)
    named = group_culprits(survivors)
    shapes = held_shapes(survivors)
    totals: dict[str, Culprit] = {}
    stopped: set[str] = set()
    if shapes:
        everything = census.live_storages(device_type, holders=True)
        totals = {c.holder: c for c in group_culprits(everything, like=shapes)}
        stopped = {s.holders.stopped for s in everything if s.holders and s.holders.stopped}
    culprits = []
    for c in named:
        total = totals.get(c.holder)
        if c.holder != NO_HOLDER and total is not None and total.nbytes >= c.nbytes:
            culprits.append(total)
            continue
        culprits.append(c)
        if c.holder != NO_HOLDER and stopped:
            notes.append(
                f"{c.holder}: the storages this call left only; the holder search over every "
                f"storage (for the totals) stopped at its {'/'.join(sorted(stopped))} limit"
            )
    # A group holding less in all than ``floor``, the smallest growth counted per call, is
    # not where the growth goes (a framework's latest logged scalar, say): name it only if
    # nothing else is.
    culprits = [c for c in culprits if c.nbytes >= floor] or culprits
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits


#: cuBLAS workspaces of a training step: one for the forward thread, one for autograd's.
STEP_WORKSPACES = 2


def cublas_workspaces() -> list[tuple[int, int, int]]:
    """``(device, bytes, count)`` of the cuBLAS workspaces on each device with a context (the
    census's split of allocated memory: blocks of the workspace size no tensor lives in)."""
    out = []
    for device in _backend.get().initialized_devices():
        try:
            split = unaccounted(device)
        except Exception:
            continue
        if split.cublas_workspaces:
            out.append((device, int(split.cublas_workspaces), int(split.workspace_count)))
    return out


def workspace_notes() -> list[str]:
    """Growth no storage accounts for, when cuBLAS workspaces pile up: name them."""
    try:
        if _backend.get().storage_device_type() != "cuda":
            return []
        piles = cublas_workspaces()
    except Exception as exc:  # never into the user's step
        logger.debug("cudamem: reading the cuBLAS workspaces failed: %r", exc)
        return []
    return [
        f"{format_bytes(nbytes)} of the allocated memory on cuda:{device} is {count} cuBLAS "
        "workspaces held by no tensor: cuBLAS keeps one per handle and stream (a training "
        "step uses two), so a new torch.cuda.Stream per call adds more every call; reuse one "
        "stream, or cudamem.release(clear_cublas=True) frees them"
        for device, nbytes, count in piles
        if count > STEP_WORKSPACES
    ]
