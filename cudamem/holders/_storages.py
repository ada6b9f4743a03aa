"""Storage identity: "is this the same storage, still alive?" without keeping it alive.

``data_ptr`` is only where a storage starts. After a free, the caching allocator hands the
same address to the next block of that size: the gradient ``zero_grad(set_to_none=True)``
dropped and ``backward()`` re-creates lands where the old one was, and a before/after
comparison by address calls it a survivor. What identifies a storage is its ``StorageImpl``.

A ``StorageRef`` holds a *weak* reference to the StorageImpl
(``UntypedStorage._weak_ref()``, the call behind
``torch.multiprocessing.reductions.StorageWeakRef``; PyTorch 2.0 through 2.13 offer the same
three calls: ``_weak_ref``, ``_expired``, ``_free_weak_ref``). A weak reference keeps only the
StorageImpl's small C++ header allocated, never the memory: the data is freed when the last
strong reference goes (``StorageImpl::release_resources``). Because the header stays, no new
StorageImpl can be created at that address while the reference lives, so two refs compare
equal exactly when they name the same storage, at whatever times they were taken, and
``StorageRef.alive`` says whether it still exists. The reference is released when the
``StorageRef`` is garbage collected.

It is cudamem's one storage identity: ``LiveStorage.ref`` and the keys of a
``cudamem.holders.census.StorageSnapshot`` are refs. This module imports only torch: the census, the
autograd walk and the reports build on it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StorageRef", "matches_type", "ref_of"]

_SB: Any = torch.UntypedStorage
_WEAK_REF: Any = _SB._weak_ref
_EXPIRED: Any = _SB._expired
_FREE: Any = _SB._free_weak_ref
_STORAGE = torch._C.TensorBase.__dict__["untyped_storage"]


class StorageRef:
    """A weak reference to one storage (its StorageImpl): identity, never ownership.

    Hashable; equal to another ref exactly when both name the same storage. Copies share
    the reference; a pickled ref comes back detached (never alive, equal only to itself),
    because a process cannot own another's StorageImpl.
    """

    __slots__ = ("__weakref__", "_cdata")

    def __init__(self, storage: Any) -> None:
        """A reference to ``storage`` (an ``UntypedStorage``)."""
        self._cdata: int = int(_WEAK_REF(storage))

    @classmethod
    def _detached(cls) -> StorageRef:
        ref = cls.__new__(cls)
        ref._cdata = 0
        return ref

    @property
    def alive(self) -> bool:
        """Whether the storage still exists (something still holds it)."""
        return self._cdata != 0 and not _EXPIRED(self._cdata)

    def __hash__(self) -> int:
        return hash(self._cdata) if self._cdata else id(self)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not StorageRef:
            return NotImplemented
        return self._cdata != 0 and self._cdata == other._cdata

    def __copy__(self) -> StorageRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> StorageRef:
        return self

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (StorageRef._detached, ())

    def __repr__(self) -> str:
        state = "alive" if self.alive else "freed"
        return f"<StorageRef {self._cdata:#x} {state}>"

    def __del__(self, _free: Any = _FREE) -> None:
        # ``_free`` is bound at definition: at interpreter exit ``torch`` may be gone first.
        cdata, self._cdata = self._cdata, 0
        if cdata:
            try:  # noqa: SIM105 (contextlib may already be torn down at exit)
                _free(cdata)
            except Exception:
                pass


def ref_of(t: Any) -> StorageRef | None:
    """A ``StorageRef`` to a tensor's storage, or ``None`` (no real storage).

    Read through torch's own descriptor with ``__torch_function__`` off; a tensor without a
    real storage (fake, meta, functional wrappers raise or have no data) gives ``None``.
    """
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return StorageRef(_STORAGE(t))
    except Exception:
        return None


def matches_type(device: str, device_type: str | None) -> bool:
    """``'cuda:0'`` matches ``'cuda'``; ``None`` matches everything."""
    return device_type is None or device.split(":", 1)[0] == device_type
