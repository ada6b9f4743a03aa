"""The narrow seam between leak/OOM reporting and the census (issue 3).

Leak detection and OOM post-mortems need two things from the census and nothing else:

* :func:`live_keys` — a cheap snapshot of which storages are alive (key → bytes), diffed
  before/after a span to find the storages it created that outlive it;
* :func:`live_storages` — the live storages with bytes, device, dtype, shape and, on request,
  the holder paths of :func:`cudamem.who_holds`.

Everything goes through here so that the census's storage enumeration and path naming are
used, never re-implemented, and so that a census failure (or its absence) degrades into a
report without culprits instead of an exception in the user's training step. A key is
whatever the census identifies a storage by (device and ``data_ptr``); it is hashable plain
data and keeps nothing alive.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LiveStorage",
    "available",
    "cublas_workspaces",
    "key_device",
    "live_keys",
    "live_storages",
    "matches_type",
]


@dataclass(frozen=True, slots=True)
class LiveStorage:
    """One live storage as the census sees it (plain data: no reference to the tensor)."""

    key: Hashable
    nbytes: int
    device: str
    dtype: str | None
    shape: tuple[int, ...] | None
    #: Holder paths (``who_holds`` style), the most direct first; empty when not asked for.
    holders: tuple[str, ...]
    #: Where the storage starts (allocator blocks start there too).
    data_ptr: int | None = None
    #: The census could not inspect every path (a bound was hit, a graph was not inspected).
    truncated: bool = False


def _census() -> Any:
    """The census module, or ``None`` while it does not exist (issue 3 not merged)."""
    try:
        from . import census
    except ImportError:
        return None
    return census


def available() -> bool:
    """Whether the census can be asked at all."""
    return _census() is not None


def matches_type(device: str, device_type: str | None) -> bool:
    """``'cuda:0'`` matches ``'cuda'``; ``None`` matches everything."""
    return device_type is None or device.split(":", 1)[0] == device_type


def key_device(key: Hashable) -> str:
    """The device of a census storage key, ``(device, data_ptr)``."""
    if isinstance(key, tuple) and key and isinstance(key[0], str):
        return key[0]
    return "?"


def live_keys(device_type: str | None) -> dict[Hashable, int] | None:
    """Key → bytes of every live storage on devices of ``device_type`` (``None``: all).

    ``None`` when the census is unavailable. No holder walk: this is the cheap pass.
    """
    census = _census()
    if census is None:
        return None
    return dict(census.live_storage_keys(device_type))


def live_storages(
    device_type: str | None,
    *,
    holders: bool,
    keys: Collection[Hashable] | None = None,
) -> list[LiveStorage] | None:
    """Live storages of ``device_type`` (largest first), with holder paths when ``holders``.

    ``keys`` restricts the result (and the holder search) to those storages. ``None`` when
    the census is unavailable.
    """
    census = _census()
    if census is None:
        return None
    if keys is not None:
        # Only those storages, and a holder search over only them.
        found = census.storages_with_keys(keys, holders=holders)
    else:
        found = census.live_tensors(None, holders=holders)
    out = [
        _convert(entry, holders=holders)
        for entry in found
        if matches_type(str(entry.device), device_type)
    ]
    out.sort(key=lambda s: s.nbytes, reverse=True)
    return out


def _convert(entry: Any, *, holders: bool) -> LiveStorage:
    """A :class:`cudamem.census.LiveStorage` → the plain data leaks and OOM reports use."""
    paths: tuple[str, ...] = ()
    if holders and entry.holders is not None:
        paths = tuple(entry.holders.paths)
    return LiveStorage(
        key=entry.key,
        nbytes=int(entry.nbytes),
        device=str(entry.device),
        dtype=str(entry.dtype),
        shape=tuple(int(d) for d in entry.shape),
        holders=paths,
        data_ptr=int(entry.data_ptr),
        truncated=bool(entry.truncated),
    )


def cublas_workspaces() -> list[tuple[int, int, int]]:
    """``(device, bytes, count)`` of the cuBLAS workspaces on each device with a context (the
    census's split of allocated memory: blocks of the workspace size no tensor lives in);
    empty when there are none or the census cannot tell."""
    census = _census()
    if census is None:
        return []
    from . import _backend

    out = []
    for device in _backend.get().initialized_devices():
        try:
            split = census.unaccounted(device)
        except Exception:
            continue
        if split.cublas_workspaces:
            out.append((device, int(split.cublas_workspaces), int(split.workspace_count)))
    return out
