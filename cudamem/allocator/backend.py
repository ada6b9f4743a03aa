"""The seam to PyTorch's CUDA caching allocator: the active backend and what reads it.

``get()`` answers the backend every reading goes through (``torch_backend.TorchBackend``, the
real allocator, unless a test swapped it with ``use`` to drive span logic through a fake
allocator); ``reader_status``/``build_reader`` tell and build its C++ counter reader;
``expandable_segments``, ``reserved_for``, ``HistoryLease`` and ``InstalledHook`` are the
allocator settings and hooks cudamem shares. The modules of this seam (``backend_base``,
``torch_backend``, ``backend``) are the only ones in cudamem that call ``torch.cuda`` memory
APIs; the span core reads ``_active`` from this module's namespace.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import ClassVar, TypeVar

import torch

from ..native import states as _native_states
from .backend_base import Backend
from .torch_backend import TorchBackend

__all__ = ["build_reader", "get", "reader_status", "use"]


_lock = threading.Lock()


_torch = TorchBackend()


_active: Backend = _torch


def reader_status() -> _native_states.ReaderStatus:
    """Which counter reader this process's real backend uses (the C++ one or the dict),
    and why. Creates no CUDA context and starts no build."""
    return _torch.reader.status()


def build_reader(*, validate: bool = True) -> _native_states.ReaderStatus:
    """Compile the C++ reader now, on this thread (``python -m cudamem build-reader``),
    ignoring markers left by earlier failures. With ``validate`` and a visible GPU it is
    then checked against the dict read on ``cuda:0``, which initialises CUDA there."""
    backend = _torch
    backend.reader.build_now(force=True)
    if validate and backend.reader.state == _native_states.READY and backend.device_count() > 0:
        probe = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
        backend.counters(0)  # validates it: equal to the dict read, or dropped
        del probe
    return backend.reader.status()


def expandable_segments() -> bool:
    """Whether the allocator maps memory in expandable segments (``expandable_segments:True``
    in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``): reservations then grow in whole
    pages (20 MiB in the large pool) rather than in segments of the request's size."""
    import os

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for part in os.environ.get(var, "").replace(";", ",").split(","):
            key, _, value = part.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


def reserved_for(nbytes: int) -> int:
    """What a large request of ``nbytes`` reserves in a fresh segment: the request itself
    (rounded to 2 MiB) by default, whole 20 MiB pages under expandable segments."""
    step = 20 * 1024**2 if expandable_segments() else 2 * 1024**2
    return -(-nbytes // step) * step


def get() -> Backend:
    """The backend in use."""
    return _active


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
    """Swap the backend for the duration of the block (tests use a fake allocator)."""
    global _active
    with _lock:
        previous = _active
        _active = backend
    try:
        yield backend
    finally:
        with _lock:
            _active = previous


class HistoryLease:
    """Allocation-history recording borrowed by an installed hook (OOM post-mortems,
    automatic snapshot dumps): turned on only when nobody had it on, and off again only by
    the lease that turned it on, so a user's own ``_record_memory_history`` is left alone."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        #: This lease turned recording on and has not given it back.
        self.active = False

    def take(self, max_entries: int, still_wanted: Callable[[], bool]) -> bool:
        """Turn recording on unless it already is; ``True`` when it already was (untouched).

        ``still_wanted`` is asked if the request waits for CUDA to initialise.
        """
        backend = get()
        if backend.is_recording_history():
            return True
        self.active = backend.set_history(True, max_entries, still_wanted)
        return False

    def give_back(self) -> None:
        """Turn recording off if this lease turned it on."""
        if self.active:
            get().set_history(False, 0, None)
            self.active = False


_Hook = TypeVar("_Hook", bound="InstalledHook")


class InstalledHook:
    """What an installed hook (OOM post-mortems, automatic snapshot dumps) shares: ``installed``
    until ``uninstall()``, which runs once under the kind's ``_install_lock``; the history
    settings and a ``HistoryLease`` (taken by ``_take_history``, given back there); a context
    manager that uninstalls at the end of the block. A subclass undoes its own hooks in
    ``_unhook``."""

    _install_lock: ClassVar[threading.Lock]

    def __init__(self, *, record_history: bool, max_entries: int) -> None:
        #: Whether installing turns allocation-history recording on, and its ring's bound.
        self.record_history = record_history
        self.max_entries = max_entries
        self.installed = False
        self._history = HistoryLease()

    def _take_history(self) -> bool:
        """Turn history recording on if this hook was asked to; ``True`` when it already was
        (left as it is)."""
        return self.record_history and self._history.take(self.max_entries, self._wanted)

    def _wanted(self) -> bool:
        """Checked by a history request queued until CUDA initialises."""
        return self.installed

    def _unhook(self) -> None:
        """Undo what installing did (under ``_install_lock``, before the lease goes back)."""

    def _leaving(self, exc: BaseException | None) -> None:
        """At the end of a ``with`` block, before ``uninstall``."""

    def _state(self) -> str:
        return "installed" if self.installed else "uninstalled"

    def uninstall(self) -> None:
        """Stop; turn history recording off again if this hook turned it on."""
        with self._install_lock:
            if not self.installed:
                return
            self.installed = False
            self._unhook()
            self._history.give_back()

    def __enter__(self: _Hook) -> _Hook:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._leaving(exc)
        finally:
            self.uninstall()
