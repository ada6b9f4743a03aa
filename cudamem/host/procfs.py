"""A process's memory as Linux counts it: RSS, PSS and USS from ``/proc/<pid>/smaps_rollup``.

RSS counts every page a process maps, shared or not; forked DataLoader workers share the
parent's pages, so their RSS says nothing about what they cost. PSS divides each shared page
among the processes that map it; USS (``Private_Clean + Private_Dirty``) counts the pages only
this process maps: what its exit would give back. Copy-on-read shows as USS growth while RSS
stays flat.

``ProcFS`` is the seam: the one place that reads files under ``/proc``; tests swap it for a
fake (``use``). Every read answers: a ``ProcessMemory`` whose figures are ``None`` carries the
reason (no ``/proc`` on this system, the process has exited, permission denied).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ..base.present import Presented

__all__ = [
    "ProcFS",
    "ProcessMemory",
    "get",
    "parse_rollup",
    "read_children",
    "read_faults",
    "read_memory",
    "read_name",
    "use",
]

KiB = 1024


@dataclass(frozen=True, slots=True)
class ProcessMemory(Presented):
    """One process's memory at one moment, in bytes. ``rss``/``pss``/``uss`` are ``None``
    when they cannot be measured, and ``reason`` says why."""

    pid: int
    rss: int | None
    pss: int | None
    uss: int | None
    #: Pages swapped out (not in any of the three figures above).
    swap: int | None = None
    reason: str = ""

    @property
    def measured(self) -> bool:
        """Whether USS and PSS were read."""
        return self.uss is not None and self.pss is not None


class ProcFS:
    """Reads ``/proc`` (``root``). ``read(pid, name)`` returns the file's text or raises
    ``FileNotFoundError``/``PermissionError``/``OSError`` as the system does."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def available(self) -> bool:
        """Whether this system has a ``/proc`` with per-process files."""
        return os.path.isdir(os.path.join(self.root, "self"))

    def read(self, pid: int, name: str) -> str:
        with open(os.path.join(self.root, str(pid), name), encoding="ascii") as f:
            return f.read()


_active = ProcFS()
_lock = threading.Lock()


def get() -> ProcFS:
    """The ``/proc`` reader in use."""
    return _active


@contextlib.contextmanager
def use(procfs: ProcFS) -> Iterator[ProcFS]:
    """Swap the ``/proc`` reader for the duration of the block (tests use a fake one)."""
    global _active
    with _lock:
        previous = _active
        _active = procfs
    try:
        yield procfs
    finally:
        with _lock:
            _active = previous


_FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Private_Hugetlb", "Swap")


def parse_rollup(text: str) -> dict[str, int]:
    """``{field: bytes}`` of the ``kB`` lines of an ``smaps``/``smaps_rollup`` text, summed over
    the mappings it lists (``smaps`` has one block per mapping, the rollup one in all)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key not in _FIELDS:
            continue
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = out.get(key, 0) + int(parts[0]) * KiB
    return out


def _figures(pid: int, fields: dict[str, int], reason: str = "") -> ProcessMemory:
    uss = None
    if "Private_Clean" in fields and "Private_Dirty" in fields:
        uss = fields["Private_Clean"] + fields["Private_Dirty"] + fields.get("Private_Hugetlb", 0)
    return ProcessMemory(
        pid=pid,
        rss=fields.get("Rss"),
        pss=fields.get("Pss"),
        uss=uss,
        swap=fields.get("Swap"),
        reason=reason,
    )


def read_memory(pid: int | None = None) -> ProcessMemory:
    """RSS, PSS and USS of ``pid`` (default: this process). Never raises: a figure it cannot
    read is ``None`` and ``reason`` says why."""
    procfs = _active
    pid = os.getpid() if pid is None else pid
    if not procfs.available():
        where = {"darwin": "macOS", "win32": "Windows"}.get(sys.platform, sys.platform)
        return ProcessMemory(
            pid, None, None, None, reason=f"not measured: no /proc on this system ({where})"
        )
    for name in ("smaps_rollup", "smaps"):
        try:
            text = procfs.read(pid, name)
        except FileNotFoundError:
            if not _exists(procfs, pid):
                return ProcessMemory(pid, None, None, None, reason=f"pid {pid} has exited")
            continue  # a kernel before 4.14 has no smaps_rollup: smaps, summed, says the same
        except PermissionError:
            return ProcessMemory(
                pid,
                None,
                None,
                None,
                reason=(
                    f"permission denied reading /proc/{pid}/{name} (another user's process, "
                    "or ptrace is restricted: run as that user)"
                ),
            )
        except ProcessLookupError:
            return ProcessMemory(pid, None, None, None, reason=f"pid {pid} has exited")
        except OSError as exc:
            return ProcessMemory(pid, None, None, None, reason=f"cannot read /proc/{pid}: {exc}")
        fields = parse_rollup(text)
        if not fields:
            # A zombie (exited, not yet reaped) has an empty smaps.
            return ProcessMemory(pid, None, None, None, reason=f"pid {pid} has exited")
        return _figures(pid, fields)
    return ProcessMemory(
        pid, None, None, None, reason=f"not measured: /proc/{pid} has no smaps on this kernel"
    )


def _exists(procfs: ProcFS, pid: int) -> bool:
    try:
        procfs.read(pid, "stat")
    except OSError:
        return False
    return True


def read_faults(pid: int) -> int | None:
    """Minor page faults of ``pid`` so far (``/proc/<pid>/stat``, field 10), ``None`` when it
    cannot be read (exited, no ``/proc``). A forked process copying a shared page on write
    takes one: a cheap sign (microseconds, where ``smaps_rollup`` walks every page table) that
    its private memory may have changed."""
    try:
        text = _active.read(pid, "stat")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    if len(fields) < 8 or not fields[7].isdigit() or fields[0] in ("Z", "X"):
        return None
    return int(fields[7])


def read_children(pid: int) -> tuple[int, ...]:
    """The child processes of ``pid``'s main thread (``/proc/<pid>/task/<pid>/children``,
    Linux 3.5+): a DataLoader's workers are started from it. Empty when unreadable."""
    try:
        text = _active.read(pid, f"task/{pid}/children")
    except OSError:
        return ()
    return tuple(int(p) for p in text.split() if p.isdigit())


def read_name(pid: int) -> str | None:
    """The command name of ``pid`` (``/proc/<pid>/comm``), ``None`` when unreadable."""
    try:
        return _active.read(pid, "comm").strip() or None
    except OSError:
        return None
