"""Steps 1, 4 and 5 of the holder search (see ``cudamem.holders._search``): the roots gc cannot
see, the paths read off the recorded edges down from each root, and what no root explains
(unreachable cycles, objects held by something gc cannot see, where a search cut short had
got to).
"""

from __future__ import annotations

import sys
import threading
import types
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from ..base.frames import own_frame
from ..native import heapscan as _heapscan
from ._graph_paths import Group, PathReader
from ._naming import (
    Ref,
    Seg,
    class_label,
    frame_label,
    frame_locals,
    is_sub,
    type_module,
    type_name,
)
from ._search_base import (
    _MODULE_DICT,
    _PARTIAL_PER_TARGET,
    _Frames,
    _is_iterator,
    _SearchBase,
    _temporary,
    _thread_names,
)


class _Roots(_SearchBase):
    """The roots gc cannot see (running frames' locals, module dicts), reading the paths off the
    recorded edges down from each root, and what no root explains."""

    def _frames(self) -> _Frames:
        """Locals of every thread's running frames (gc cannot see them)."""
        out = _Frames()
        for part in (out.keep, out.by_value, out.values, out.snapshot_ids, out.own_locals):
            self._own(part)
        try:
            current = sys._current_frames()
        except Exception:
            return out
        names = _thread_names()
        me = threading.get_ident()
        frame: types.FrameType | None = None
        try:
            for ident, top in list(current.items()):
                frame = top
                while frame is not None:
                    out.keep.append(frame)
                    if own_frame(frame):
                        self._own_locals(frame, out)
                    else:
                        self._frame_roots(frame, ident, me, names, out)
                    frame = frame.f_back
        finally:
            # This frame is on the stack it walked: a local naming it would make a cycle
            # (frame -> its own locals -> frame) that outlives the call.
            del current
            top = None  # type: ignore[assignment]
            frame = None
        return out

    def _own_locals(self, frame: types.FrameType, out: _Frames) -> None:
        for _name, value in frame_locals(frame):
            out.own_locals.add(id(value))

    def _frame_roots(
        self, frame: types.FrameType, ident: int, me: int, names: dict[int, str], out: _Frames
    ) -> None:
        try:
            if frame.f_locals is frame.f_globals:
                return  # module level: its globals are a module dict, a root already
        except Exception:
            return
        label = frame_label(frame)
        if ident != me:
            label = f"[thread {names.get(ident, str(ident))}] {label}"
        is_caller = frame is self.caller
        loc = frame.f_locals
        if isinstance(loc, dict):
            # Not emptied while a tracer runs (see frame_locals): never a referrer to name.
            out.snapshot_ids.add(id(loc))
            out.keep.append(loc)
        del loc
        for name, value in frame_locals(frame):
            out.by_value.setdefault(id(value), []).append((label, name, is_caller))
            out.values[id(value)] = value

    def _module_dicts(self) -> dict[int, str]:
        """``id(module.__dict__) → module name`` for all of ``sys.modules`` (one C call
        with the compiled heap pass)."""
        module = _heapscan.native()
        if module is not None and hasattr(module, "module_dicts"):
            found: dict[int, str] = module.module_dicts(sys.modules)  # runs no Python code
            return found
        out: dict[int, str] = {}
        for _ in range(3):
            try:
                items = list(dict.items(sys.modules))
                break
            except RuntimeError:  # another thread imported while we copied
                continue
        else:
            return out
        module_type = types.ModuleType
        for name, mod in items:
            tp = type(mod)
            if type(name) is not str or (tp is not module_type and not is_sub(tp, module_type)):
                continue
            try:
                d = _MODULE_DICT.__get__(mod)
            except Exception:
                continue
            out.setdefault(id(d), name)
        return out

    def _root_entries(self) -> list[tuple[str, str, list[Ref], int, bool, int]]:
        """``(kind, root, head, start id, is_caller, root id)`` of every root reached."""
        entries: list[tuple[str, str, list[Ref], int, bool, int]] = []
        by_value = self.frames.by_value
        for oid in self.roots:
            obj = self.nodes[oid]
            if oid in self.module_dicts:
                for cid, r in self.edges.get(oid, {}).items():
                    for seg in r.segs:
                        head = [Ref((seg,))]
                        entries.append(("global", self.module_dicts[oid], head, cid, False, oid))
            else:
                entries.append(("class", class_label(obj), [], oid, False, oid))
            self.root_ids.append(oid)
        for oid in [o for o in self.nodes if o in by_value]:
            for label, name, is_caller in by_value[oid]:
                head = [Ref((Seg("local", name, label),))]
                entries.append(("frame", label, head, oid, is_caller, oid))
            self.root_ids.append(oid)
        return entries

    def _collect(self) -> None:
        groups: list[dict[tuple[Any, ...], Group]] = [{} for _ in self.keys]
        self._groups = groups
        self.reader = reader = PathReader(
            self.edges, self.nodes, self.start, self.limits.max_paths, self._read_late
        )
        entries = self._root_entries()
        for kind, root, head, start_id, is_caller, root_id in entries:
            if self._read_late():
                self.notes.append("reading the paths stopped at the timeout: some are missing")
                self._stop("timeout")
                break
            for path in reader.walk_down(start_id):
                direct = len(path.refs) == 1 and path.via == "itself"
                caller = is_caller and direct
                if kind == "global" and direct:
                    caller = self._caller_global(root_id)
                reader.add(groups[path.target], kind, root, head, path, caller)
        self._unrooted()
        if self.stopped is not None:
            self._partial()
        for per in groups:
            for g in per.values():
                raw = g.first
                raw.count = g.count
                raw.subs = g.subs()
                self.holders.append(raw)
        if reader.cut:
            self.notes.append("more paths than max_paths; the rest are not shown")

    def _caller_global(self, dict_id: int) -> bool:
        try:
            return (
                self.caller is not None
                and id(self.caller.f_globals) == dict_id
                and (self.caller.f_locals is self.caller.f_globals)
            )
        except Exception:
            return False

    def _unrooted(self) -> None:
        """Holders no root explains: unreachable cycles, and objects gc sees no referrer of.

        Every explored object lies on a path down to an object holding a target. Those that
        no root reaches are either *sources* (no referrer found: something gc cannot see
        holds them, such as C code) or held only by each other: a finite set in which every
        object has a referrer inside the set contains a cycle, garbage that ``gc.collect()``
        frees. Not reported: the call's own temporaries (its argument tuple, a
        ``functools.partial`` around it, cudamem's own locals), tensors a view or a numpy
        array of theirs holds; nor, beside a rooted holder, a running loop's iterator, a
        running function's cell, or a tensor only C++ holds.
        """
        if self.stopped is not None:
            return  # the search did not finish: "no root" would be a guess
        rooted = self._below(self.root_ids)
        unrooted = [oid for oid in self.nodes if oid not in rooted]
        if not unrooted:
            return
        sources = [oid for oid in unrooted if oid not in self.has_parent]
        explained = self._below(sources)
        rest = [oid for oid in unrooted if oid not in explained]
        queried = {id(o) for o in self.objects}
        reps: list[tuple[int, str, bool]] = []  # (id, kind, only if nothing else holds it)
        for oid in sources:
            if oid in queried or oid in self.bases or oid in self.frames.own_locals:
                continue
            obj = self.nodes.get(oid)
            if type_module(type(obj)).startswith("cudamem."):
                continue  # bookkeeping of cudamem running in another thread
            if self._call_temporary(oid, queried):
                continue
            # A loop's iterator, a running function's own cell (a comprehension closes over
            # its locals), a tensor only C++ holds: noise beside a root that explains it.
            tp = type(obj)
            weak = _is_iterator(tp) or tp is types.CellType or is_sub(tp, torch.Tensor)
            reps.append((oid, "unknown", weak))
            if len(reps) >= 8:
                break
        if rest:
            # Discovered last = inside the cycle's closure; name it by an object, not a dict.
            plain = (dict, list, tuple, set, types.CellType, types.FrameType)
            named = [o for o in rest if type(self.nodes.get(o)) not in plain]
            reps.append(((named or rest)[-1], "cycle", False))
        for oid, kind, weak in reps:
            label = f"<{type_name(type(self.nodes.get(oid)))} object>"
            seen: set[int] = set()
            for path in self.reader.walk_down(oid):
                if path.target in seen or (weak and self._groups[path.target]):
                    continue
                seen.add(path.target)
                self.reader.add(self._groups[path.target], kind, label, [], path, False)

    def _call_temporary(self, oid: int, queried: set[int]) -> bool:
        """An argument tuple, kwargs dict or ``functools.partial`` that holds only the queried
        object, directly or through another of those: the call's own temporaries."""
        if not _temporary(self.nodes.get(oid)):
            return False
        paths = self.reader.walk_down(oid)
        if not paths:
            return False
        for path in paths:
            ids = path.ids
            if len(ids) > 3 or ids[-1] not in queried:
                return False
            for i in ids[:-1]:
                if not _temporary(self.nodes.get(i)):
                    return False
        return True

    def _partial(self) -> None:
        """What a search cut short had reached: the farthest objects below no root yet."""
        rooted = self._below(self.root_ids)
        pending = [oid for oid in self.nodes if oid not in rooted and oid not in self.has_parent]
        pending.sort(key=lambda oid: -self.depth.get(oid, 0))
        shown = [0] * len(self.keys)
        for oid in pending[:16]:
            if self._read_late():
                break
            label = f"<{type_name(type(self.nodes.get(oid)))} object>"
            seen: set[int] = set()
            for path in self.reader.walk_down(oid):
                if path.target in seen or shown[path.target] >= _PARTIAL_PER_TARGET:
                    continue
                seen.add(path.target)
                shown[path.target] += 1
                self.reader.add(self._groups[path.target], "partial", label, [], path, False)

    def _below(self, starts: Iterable[int]) -> set[int]:
        """Every explored object reachable down the recorded edges from ``starts``."""
        seen = set(starts)
        queue = deque(seen)
        while queue:
            cur = queue.popleft()
            for cid in self.edges.get(cur, {}):
                if cid not in seen:
                    seen.add(cid)
                    queue.append(cid)
        return seen
