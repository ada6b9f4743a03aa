"""Validation of the ``device=`` argument that every public call accepts."""

from __future__ import annotations

from typing import Union

import torch

from ..base.format import plural
from . import backend as _backend

__all__ = ["DeviceLike", "resolve_device"]

DeviceLike = Union[int, str, torch.device]


def resolve_device(device: DeviceLike) -> int:
    """``0``, ``'cuda'``, ``'cuda:1'`` or ``torch.device('cuda', 1)`` → a CUDA device index.

    Raises ``ValueError`` for CPU devices, negative or out-of-range indices, and ``TypeError``
    for anything that is not a device. ``'cuda'`` without an index means device 0 unless
    CUDA is already initialised (then the current device), without creating a context.
    """
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"device must be an int, a 'cuda:N' string or a torch.device, "
            f"not {type(device).__name__}"
        )
    if isinstance(device, int):
        index: int | None = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"unknown device {device!r}: {exc}") from None
        if dev.type != "cuda":
            raise ValueError(f"cudamem measures CUDA devices; got {str(dev)!r}")
        index = dev.index
    if index is None:
        index = _backend.get().current_device()
    if index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    count = _backend.get().device_count()
    if count == 0:
        raise ValueError(
            f"cuda:{index} was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})"
        )
    if index >= count:
        raise ValueError(
            f"cuda:{index} does not exist: this process sees {plural(count, 'CUDA device')}"
        )
    return index
