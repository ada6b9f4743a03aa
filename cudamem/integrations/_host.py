"""The trainer callbacks' host columns, read from what the worker watcher last measured:

========================  ==================================================================
``host_rss_mib``          this process's RSS
``host_uss_mib``          this process's USS (pages only it maps)
``workers_uss_mib``       the sum of the live DataLoader workers' USS
``pinned_mib``            the pinned-memory pool (in use + cached), CUDA runs only
========================  ==================================================================

No step reads ``/proc``: the watcher's daemon thread does, within its budget (0.5 % of a
core), and a step copies its latest figures. The pinned pool is one counter read.
"""

from __future__ import annotations

from ..allocator import backend as _backend
from ..host import workers
from ..host.ledger import build_pinned

__all__ = ["HOST_METRICS", "HostMeter"]

HOST_METRICS = ("host_rss_mib", "host_uss_mib", "workers_uss_mib", "pinned_mib")
MiB = 1024**2


class HostMeter:
    """Starts the worker watcher for a run (unless one runs already) and reads it per step."""

    def __init__(self) -> None:
        self._watcher: workers.WorkerWatcher | None = None
        self._started = False

    def begin(self) -> None:
        self.end()
        self._started = workers.watcher() is None
        self._watcher = workers.watch_workers()
        self._watcher.sample_self = True
        self._watcher.tick()  # this process read once now: the first steps have its figures

    def end(self) -> None:
        if self._started:
            workers.stop_watching()
        self._watcher, self._started = None, False

    def values(self, cuda: bool) -> dict[str, float]:
        """The latest host figures in MiB (a figure not measured yet is left out)."""
        out: dict[str, float] = {}
        watcher = self._watcher
        if watcher is None:
            return out
        process = watcher.process
        if process is not None and process.rss is not None:
            out["host_rss_mib"] = process.rss / MiB
        if process is not None and process.uss is not None:
            out["host_uss_mib"] = process.uss / MiB
        out["workers_uss_mib"] = watcher.workers_uss() / MiB
        if cuda:
            stats = _backend.get().host_pool_stats()
            if stats is not None:
                out["pinned_mib"] = build_pinned(stats, None, None).owned / MiB
        return out
