"""``machine_status()``: one line per GPU of the machine (NVML), what this process holds on each,
with no CUDA context created.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ..base.present import Presented
from ..host import ledger as host_ledger
from ..host.ledger import ProcessTree
from . import nvml as _nvml
from .device import FREES

__all__ = ["MachineStatus", "StatusLine", "machine_status"]


class StatusLine(NamedTuple):
    """One line of a device in ``MachineStatus``: what holds ``nbytes`` (``None``:
    NVML cannot tell) and what frees it."""

    label: str
    nbytes: int | None
    frees: str


@dataclass(frozen=True, slots=True)
class MachineStatus(Presented):
    """Every GPU of the machine as NVML sees it, all processes included (``cudamem status``).

    Per device: ``used`` = driver reserve + each process's memory + driver memory NVML
    lists under no process: other containers' processes, or rounding). Read from NVML only,
    so asking creates no CUDA context.
    """

    json_properties: ClassVar[tuple[str, ...]] = ("device_lines",)

    nvml: _nvml.NvmlStatus
    devices: tuple[_nvml.NvmlDevice, ...]
    pid: int
    #: Host memory of the GPU processes NVML lists that run on this machine (and of
    #: ``machine_status(pids=)``), each with its children: DataLoader workers.
    host: tuple[ProcessTree, ...] = ()

    @property
    def device_lines(self) -> tuple[tuple[StatusLine, ...], ...]:
        """``lines`` of every device, in the order of ``devices``."""
        return tuple(tuple(self.lines(d)) for d in self.devices)

    def lines(self, device: _nvml.NvmlDevice) -> list[StatusLine]:
        """``(label, nbytes, frees)`` rows of one device, adding up to NVML used."""
        mem = device.memory
        if mem is None:
            return []
        rows = [StatusLine("driver reserve", mem.reserved, FREES["driver_reserve"])]
        known = mem.reserved or 0
        # This process first, then the others by size (unknown sizes last).
        procs = sorted(
            device.processes or (),
            key=lambda p: (p.pid != self.pid, -(p.used if p.used is not None else -1)),
        )
        for proc in procs:
            who = f"pid {proc.pid}" + (f" {proc.name}" if proc.name else "")
            if proc.pid == self.pid:
                who += " (this process)"
            rows.append(StatusLine(who, proc.used, FREES["other_process"]))
            known += proc.used or 0
        rows.append(
            StatusLine(
                "driver memory outside every process", mem.used - known, FREES["unattributed"]
            )
        )
        return rows


def machine_status(pids: Sequence[int] = ()) -> MachineStatus:
    """The whole machine's GPUs, every process included, from NVML, and the host memory of
    the GPU processes on this machine and of ``pids`` (RSS/PSS/USS, their children's USS and
    PSS). Never raises but for a bad ``pids``."""
    if isinstance(pids, (str, bytes)) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pids
    ):
        raise TypeError(f"pids must be a sequence of positive int process ids, not {pids!r}")
    status = _nvml.status()
    found = _nvml.query_all() if status.available else status
    devices = found if isinstance(found, tuple) else ()
    if isinstance(found, _nvml.NvmlStatus) and status.available:
        status = found
    wanted = list(dict.fromkeys([*pids, *(p.pid for d in devices for p in d.processes or ())]))
    trees = tuple(host_ledger.process_tree(p) for p in wanted)
    local = tuple(t for t in trees if t.process.rss is not None or t.process.pid in pids)
    return MachineStatus(status, devices, os.getpid(), local)
