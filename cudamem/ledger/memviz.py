"""Allocator snapshots for PyTorch's memory viewer, with each live block named by its holder.

``dump_snapshot`` writes the pickle ``torch.cuda.memory._dump_snapshot()`` writes (the dict
of ``torch.cuda.memory._snapshot()``: ``segments``, ``device_traces``, ...), so that
https://pytorch.org/memory_viz and ``torch.cuda._memory_viz`` open it, and adds what only
cudamem knows: for every live block, the path that keeps it alive. The viewer shows a block's
``frames`` as its stack (``filename:line:name``, first frame first), so cudamem puts one
synthetic frame in front of them::

    {'filename': 'cudamem holder', 'line': 0, 'name': '__main__.losses[3]'}

which the viewer prints as ``cudamem holder:0:__main__.losses[3]`` above the allocation stack
(or instead of "block was allocated before _record_history was enabled" when no history was
recorded), and which ``torch.cuda._memory_viz.memory()``'s flame graph shows as the leaf of
each block. The last ``alloc`` event of each live block in ``device_traces`` gets the same
frame, so the "Active Memory Timeline" names holders too. Blocks in which no live tensor lives
are marked as such (a cuBLAS workspace, or memory only C++ holds).

``auto_dump`` writes such a snapshot by itself when the allocator runs out of memory (from
PyTorch's OOM observer, the moment ``malloc`` fails, as PyTorch's documentation suggests) or
when a ``cudamem.LeakWarning`` is about to be issued. Opt-in; ``AutoDump.uninstall``
stops it. ``cudamem.load_snapshot`` reads every file written here back without running code.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import pickle
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..allocator import backend as _backend
from ..allocator import backend_base as _backend_base
from ..allocator.snapshot import CONTAINER_KEY, HOLDER_FILENAME, LIVE_STATES, NOTE_FILENAME
from ..base.args import check_bool
from ..base.present import Presented
from ..growth._warn import add_growth_hook, remove_growth_hook
from ..holders import census

if TYPE_CHECKING:
    from ..growth.report import Growth
    from ..holders.census import LiveStorage

__all__ = [
    "AutoDump",
    "SnapshotDump",
    "annotate_snapshot",
    "auto_dump",
    "dump_snapshot",
]


@dataclass(frozen=True, slots=True)
class SnapshotDump(Presented):
    """A snapshot file written by ``dump_snapshot``. Bytes are ints."""

    path: str
    #: ``dump_snapshot()``, ``oom`` or ``leak``: what made cudamem write it.
    reason: str
    segments: int
    #: Live blocks (allocated, or freed but still in use by a stream) and their bytes.
    blocks: int
    nbytes: int
    #: Live blocks given a holder frame, and their bytes.
    named: int
    named_bytes: int
    #: Allocator history events in the file (``_record_memory_history`` must be on).
    trace_entries: int
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- annotation


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _frame(filename: str, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": 0, "name": name}


def _storage_frame(s: LiveStorage) -> dict[str, Any]:
    """The synthetic frame naming what holds ``s``: the first holder's path, and its
    container under ``CONTAINER_KEY`` (memory_viz reads only filename, line and name)."""
    held = [] if s.holders is None else [h for h in s.holders if not h.caller]
    if held:
        more = f" (+{len(held) - 1} more)" if len(held) > 1 else ""
        frame = _frame(HOLDER_FILENAME, held[0].path + more)
        frame[CONTAINER_KEY] = held[0].route.container
        return frame
    if s.holders is None:
        return _frame(NOTE_FILENAME, "holders not searched")
    if not s.python:
        return _frame(NOTE_FILENAME, "saved by autograd, no path from Python reaches the graph")
    return _frame(NOTE_FILENAME, "no holder reachable from Python (C++ or an unread frame)")


def _device_of(text: str) -> int | None:
    """``'cuda:1'`` → 1; ``None`` for any other device."""
    kind, _, index = text.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def annotate_snapshot(
    snapshot: dict[str, Any],
    storages: Sequence[LiveStorage],
    *,
    workspace_sizes: Mapping[int, Sequence[int]] | None = None,
    match_device: bool = True,
) -> tuple[int, int, int, int]:
    """Put a holder frame in front of each live block's (and its last alloc event's) frames.

    ``storages`` come from the census with holders; a storage lives in the block whose range
    holds its ``data_ptr`` (on the segment's device when ``match_device``). Blocks with no
    storage are marked as cuBLAS workspaces when their requested size is one of
    ``workspace_sizes[device]``, else as memory no live tensor accounts for. Edits
    ``snapshot`` in place; returns ``(live blocks, their bytes, named blocks, their bytes)``.
    """
    per_device: dict[int | None, list[LiveStorage]] = {}
    for s in storages:
        key = _device_of(s.device) if match_device else None
        per_device.setdefault(key, []).append(s)
    index: dict[int | None, tuple[list[int], list[LiveStorage]]] = {}
    for dev, items in per_device.items():
        items.sort(key=lambda s: s.data_ptr)
        index[dev] = ([s.data_ptr for s in items], items)
    sizes = workspace_sizes or {}
    live = live_bytes = named = named_bytes = 0
    # (device, address) of every live block → its frame, for the trace pass below.
    frames_for: dict[tuple[int, int], dict[str, Any]] = {}
    for seg in snapshot.get("segments") or ():
        if not isinstance(seg, dict):
            continue
        dev = _int(seg.get("device"))
        ptrs, items = index.get(dev if match_device else None, ([], []))
        address = _int(seg.get("address"))
        for block in seg.get("blocks") or ():
            if not isinstance(block, dict):
                continue
            size = _int(block.get("size"))
            start = _int(block.get("address", address))
            address = start + size
            if block.get("state") not in LIVE_STATES:
                continue
            live += 1
            live_bytes += size
            # Storages whose data_ptr lies inside [start, start + size): the largest names it.
            lo = bisect.bisect_left(ptrs, start)
            hi = bisect.bisect_left(ptrs, start + size)
            inside = items[lo:hi]
            if inside:
                frame = _storage_frame(max(inside, key=lambda s: s.nbytes))
                if frame["filename"] == HOLDER_FILENAME:
                    named += 1
                    named_bytes += size
            elif _int(block.get("requested_size", size)) in sizes.get(dev, ()):
                frame = _frame(NOTE_FILENAME, "cuBLAS workspace: no tensor; freed by release()")
            else:
                frame = _frame(NOTE_FILENAME, "no live tensor in this block (C++ or autograd)")
            old = block.get("frames")
            block["frames"] = [frame, *(old if isinstance(old, list) else ())]
            frames_for[(dev, start)] = frame
    _annotate_traces(snapshot, frames_for)
    return live, live_bytes, named, named_bytes


def _annotate_traces(
    snapshot: dict[str, Any], frames_for: dict[tuple[int, int], dict[str, Any]]
) -> None:
    """The last ``alloc`` of each live block in the history gets the block's frame."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list):
        return
    for dev, trace in enumerate(traces):
        if not isinstance(trace, list):
            continue
        seen: set[int] = set()
        for event in reversed(trace):
            if not isinstance(event, dict):
                continue
            addr = _int(event.get("addr"))
            action = event.get("action")
            if addr in seen or action not in ("alloc", "free_requested", "free_completed"):
                continue
            seen.add(addr)
            frame = frames_for.get((dev, addr))
            if action == "alloc" and frame is not None:
                old = event.get("frames")
                event["frames"] = [frame, *(old if isinstance(old, list) else ())]


# --------------------------------------------------------------------------- dumping


def _empty_snapshot(devices: int) -> dict[str, Any]:
    # memory_viz indexes device_traces by device: one (empty) list per device, at least one.
    return {"segments": [], "device_traces": [[] for _ in range(max(1, devices))]}


def _storages(device_type: str, notes: list[str]) -> list[LiveStorage]:

    try:
        return list(census.live_storages(device_type, holders=True))
    except Exception as exc:  # the census must not stop the dump
        notes.append(f"holders not named: {type(exc).__name__}: {exc}")
        return []


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cudamem-", suffix=".pickle", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _dump(path: Path, *, holders: bool, reason: str) -> SnapshotDump:
    backend = _backend.get()
    notes: list[str] = []
    snap = backend.history_snapshot()
    if snap is None:
        notes.append("no CUDA context in this process: the snapshot is empty")
        snap = _empty_snapshot(backend.device_count())
    traces = snap.get("device_traces")
    if not isinstance(traces, list):
        traces = snap["device_traces"] = []
    segments = snap.get("segments")
    devices = [_int(s.get("device")) for s in segments or () if isinstance(s, dict)]
    while len(traces) <= max(devices, default=0):
        traces.append([])  # memory_viz reads device_traces[device] for every device shown
    entries = sum(len(t) for t in traces if isinstance(t, list))
    if entries == 0 and segments:
        notes.append(
            "no allocation history: only the current blocks are shown (turn on "
            "torch.cuda.memory._record_memory_history(), or auto_dump(record_history=True), "
            "for the timeline and allocation stacks)"
        )
    if holders:
        device_type = backend.storage_device_type()
        storages = _storages(device_type, notes)
        workspace = {d: backend.cublas_workspace_sizes(d) for d in set(devices)}
        live, live_bytes, named, named_bytes = annotate_snapshot(
            snap, storages, workspace_sizes=workspace, match_device=device_type == "cuda"
        )
        storages.clear()
    else:
        sizes = [
            _int(b.get("size"))
            for seg in segments or ()
            if isinstance(seg, dict)
            for b in seg.get("blocks") or ()
            if isinstance(b, dict) and b.get("state") in LIVE_STATES
        ]
        live, live_bytes, named, named_bytes = len(sizes), sum(sizes), 0, 0
    _write_atomic(path, snap)
    return SnapshotDump(
        path=str(path),
        reason=reason,
        segments=len(segments or ()),
        blocks=live,
        nbytes=live_bytes,
        named=named,
        named_bytes=named_bytes,
        trace_entries=entries,
        notes=tuple(notes),
    )


def dump_snapshot(
    path: str | os.PathLike[str] = "cudamem_snapshot.pickle", *, holders: bool = True
) -> SnapshotDump:
    """Write the allocator's snapshot for pytorch.org/memory_viz, each live block named.

    The file is the pickle ``torch.cuda.memory._dump_snapshot()`` writes (plain data), with a
    synthetic first frame on every live block naming the path that holds it
    (``cudamem holder:0:__main__.losses[3]`` in the viewer). Turn on
    ``torch.cuda.memory._record_memory_history()`` beforehand for allocation stacks and the
    timeline; without it the file still shows every segment and block.

    Args:
        path: the file to write (its folder is created; an existing file is replaced).
        holders: name each block's holder (one census and one holder search over the CUDA
            storages); ``False`` writes PyTorch's snapshot unchanged.

    Returns:
        ``SnapshotDump``: where it went and how many blocks were named. Never creates a
        CUDA context: without one the file holds an empty snapshot (and a note says so).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    check_bool("holders", holders)
    return _dump(Path(os.fspath(path)).expanduser(), holders=holders, reason="dump_snapshot()")


# --------------------------------------------------------------------------- automatic dumps

_lock = threading.Lock()
_active: AutoDump | None = None
#: Backends the observer is attached to (the allocator cannot detach one: it stays, idle).
_observed: weakref.WeakSet[_backend_base.Backend] = weakref.WeakSet()


class AutoDump(_backend.InstalledHook):
    """Automatic snapshot dumps, returned by ``auto_dump``.

    ``files`` lists what was written. ``uninstall()`` stops it (and turns history recording
    off if it turned it on); used as a context manager it uninstalls at the end of the block.
    """

    _install_lock = _lock

    def __init__(
        self,
        directory: Path,
        *,
        oom: bool,
        leaks: bool,
        max_dumps: int,
        holders: bool,
        record_history: bool,
        max_entries: int,
    ) -> None:
        super().__init__(record_history=record_history, max_entries=max_entries)
        self.directory = directory
        self.oom = oom
        self.leaks = leaks
        self.max_dumps = max_dumps
        self.holders = holders
        self.dumps: list[SnapshotDump] = []
        self.errors: list[str] = []
        self._busy = threading.Lock()

    @property
    def files(self) -> tuple[str, ...]:
        """Paths of the snapshots written so far."""
        return tuple(d.path for d in self.dumps)

    def _next_path(self, reason: str) -> Path:
        return self.directory / f"cudamem-{reason}-{os.getpid()}-{len(self.dumps) + 1}.pickle"

    def _dump(self, reason: str) -> None:
        """Write one snapshot; never raises (it runs inside malloc or a span's exit)."""
        if not self.installed or len(self.dumps) >= self.max_dumps:
            return
        if not self._busy.acquire(blocking=False):
            return  # a dump in progress (an OOM inside the census): skip this one
        try:
            self.dumps.append(_dump(self._next_path(reason), holders=self.holders, reason=reason))
            if sys.stderr is not None:
                sys.stderr.write(f"cudamem: {self.dumps[-1]}\n")
        except Exception as exc:
            self.errors.append(f"{reason}: {type(exc).__name__}: {exc}")
        finally:
            self._busy.release()

    def _on_oom(self, device: int, requested: int, total: int, free: int) -> None:
        if self.oom:
            self._dump("oom")

    def _on_growth(self, growth: Growth) -> None:
        if self.leaks:
            self._dump("leak")

    def _unhook(self) -> None:
        global _active
        remove_growth_hook(self._on_growth)
        if _active is self:
            _active = None

    def __repr__(self) -> str:
        return f"<AutoDump {self._state()} into {str(self.directory)!r}, {len(self.dumps)} written>"


def _observer(device: int, requested: int, total: int, free: int) -> None:
    """PyTorch's OOM observer (called inside malloc): hand over to the active AutoDump."""
    guard = _active
    if guard is not None:
        guard._on_oom(int(device), int(requested), int(total), int(free))


def auto_dump(
    directory: str | os.PathLike[str] = ".",
    *,
    oom: bool = True,
    leaks: bool = True,
    max_dumps: int = 5,
    holders: bool = True,
    record_history: bool = False,
    max_entries: int = 100_000,
) -> AutoDump:
    """Dump a named snapshot (``dump_snapshot``) on out-of-memory and on leak warnings.

    Files are ``cudamem-oom-<pid>-<n>.pickle`` and ``cudamem-leak-<pid>-<n>.pickle`` in
    ``directory``; open them at https://pytorch.org/memory_viz.

    Args:
        directory: where the files go (created when the first one is written).
        oom: dump when the allocator fails to allocate (from PyTorch's OOM observer, before
            the ``OutOfMemoryError`` is raised, so the blocks are those that filled the GPU).
        leaks: dump just before each ``cudamem.LeakWarning`` is issued.
        max_dumps: at most this many files (a retry loop can OOM over and over).
        holders: name each live block's holder (a census at dump time).
        record_history: turn allocation-history recording on (Python stacks at allocation,
            costs time on every allocation) for the viewer's timeline; off at uninstall.
        max_entries: bound of the history's ring buffer.

    A second call replaces the first. Returns the ``AutoDump`` (``uninstall()`` it).
    """
    global _active

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, not {type(directory).__name__}")
    for name, value in (("max_dumps", max_dumps), ("max_entries", max_entries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, flag in (
        ("oom", oom),
        ("leaks", leaks),
        ("holders", holders),
        ("record_history", record_history),
    ):
        check_bool(name, flag)
    previous = _active
    if previous is not None:
        previous.uninstall()
    guard = AutoDump(
        Path(os.fspath(directory)).expanduser(),
        oom=oom,
        leaks=leaks,
        max_dumps=max_dumps,
        holders=holders,
        record_history=record_history,
        max_entries=max_entries,
    )
    backend = _backend.get()
    with _lock:
        guard.installed = True
        _active = guard
        if oom and backend not in _observed and backend.attach_oom_observer(_observer):
            _observed.add(backend)
        if leaks:
            add_growth_hook(guard._on_growth)
    guard._take_history()
    return guard
