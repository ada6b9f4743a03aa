"""The holder search: backward BFS from target storages to named roots.

One search serves any number of targets. Its passes:

1. every tensor object, in one heap scan (``gc.get_referrers`` on the tensor types);
2. every live autograd graph, walked once (tensor → ``grad_fn`` → saved tensors is invisible
   to gc), plus ``.grad`` of every tensor;
3. the roots gc cannot see: locals of every thread's running frames;
4. backward BFS from the objects that hold a target storage: each level finds the referrers of
   the whole frontier at once, with ``gc.get_referrers(*frontier)`` (one heap scan, whose cost
   grows with the number of objects asked about) when the frontier is small, or else one
   Python pass over ``gc.get_objects()`` that checks each object's referents against the
   frontier's ids (~0.3 s per 700k objects, independent of the frontier's size).

The search stops at roots (module dicts, classes, running frames) and records, for every object
it reached, the first (shortest) hop towards a target. Paths are read off that tree. Objects the
search holds are released before it returns; ids of its own containers are ignored as referrers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _autograd
from ._autograd import StorageKey
from ._naming import (
    Seg,
    class_label,
    frame_label,
    frame_locals,
    instance_dict,
    is_sub,
    name_edges,
    type_name,
)

__all__ = ["RawHolder", "Search", "SearchLimits", "own_frame"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
#: Above this many frontier objects one Python pass over all objects beats get_referrers.
_BATCH_LIMIT = 150


def own_frame(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs cudamem's own code, subpackages included (never shown)."""
    try:
        return os.path.abspath(frame.f_code.co_filename).startswith(_PKG_DIR + os.sep)
    except Exception:
        return False


@dataclass(frozen=True)
class SearchLimits:
    """Bounds of one search."""

    max_depth: int = 40
    max_nodes: int = 200_000
    timeout: float = 30.0
    max_paths: int = 64


@dataclass
class RawHolder:
    """One root-to-target path, before it is frozen into a :class:`~cudamem.Holder`."""

    target: int  # index of the target storage
    root_kind: str
    root: str
    segs: list[Seg]
    last: Any  # the object whose storage edge ends the path (released after freezing)
    via: str  # how ``last`` holds the storage: itself/view/alias/saved/grad/object
    caller: bool = False


@dataclass
class _Frames:
    by_value: dict[int, list[tuple[str, str, bool]]] = field(default_factory=dict)
    snapshot_ids: set[int] = field(default_factory=set)
    keep: list[Any] = field(default_factory=list)


class Search:
    """One search for the holders of ``targets`` (storage keys, or objects by identity)."""

    def __init__(
        self,
        keys: list[StorageKey | None],
        objects: list[Any],
        limits: SearchLimits,
        caller: types.FrameType | None,
        *,
        light: bool = False,
    ) -> None:
        self.light = light  # identity targets only: no tensor scan, no autograd walk
        self.keys = keys
        self.objects = objects  # the queried objects, one per target (ours: ignored)
        self.limits = limits
        self.caller = caller
        self.deadline = time.perf_counter() + limits.timeout
        self.notes: list[str] = []
        self.not_inspected: list[tuple[Any, str]] = []
        self.ignore: set[int] = set()
        self.keep: list[Any] = []  # our containers stay alive so their ids stay unique
        self._own(objects)
        self.nodes: dict[int, Any] = self._own({})
        # child id -> first (parent id, seg) hop towards a target; parents of each child.
        self.hop: dict[int, tuple[int, Seg]] = self._own({})
        self.parents: dict[int, list[int]] = self._own({})
        self.edges: dict[int, dict[int, Seg]] = self._own({})
        self.start: dict[int, list[tuple[int, Seg, str]]] = self._own({})
        self.virtual: dict[int, list[tuple[Any, Seg]]] = self._own({})
        self.holders: list[RawHolder] = []
        self.module_types: tuple[type, ...] = (torch.nn.Module,)
        self.odd_keys: dict[int, Any] = self._own({})
        self.tensors: list[Any] = []
        self.walk: _autograd.GraphWalk | None = None
        self.truncated_depth = False

    # -- bookkeeping --------------------------------------------------------------------
    def _own(self, container: Any) -> Any:
        self.ignore.add(id(container))
        self.keep.append(container)
        return container

    def release(self) -> None:
        """Drop every reference the search took."""
        for c in self.keep:
            with contextlib.suppress(Exception):
                c.clear()
        self.keep.clear()
        self.tensors = []
        self.walk = None
        self.objects = []
        self.caller = None
        self.not_inspected = []

    def timed_out(self) -> bool:
        return time.perf_counter() > self.deadline

    # -- passes ---------------------------------------------------------------------------
    def run(self) -> None:
        frontier = self._seed()
        frames = self._frames()
        module_dicts = self._module_dicts()
        depth = 0
        while frontier:
            if depth >= self.limits.max_depth:
                self.truncated_depth = True
                self.notes.append(f"search stopped at depth {depth} (max_depth)")
                break
            if len(self.nodes) >= self.limits.max_nodes:
                self.notes.append(f"search stopped after {len(self.nodes)} objects (max_nodes)")
                break
            if self.timed_out():
                self.notes.append(f"search stopped after {self.limits.timeout:g} s (timeout)")
                break
            depth += 1
            frontier = self._level(frontier, frames, module_dicts)
        self._collect(frames, module_dicts)
        frames.keep.clear()

    def _seed(self) -> dict[int, Any]:
        """Objects that hold a target storage directly: tensors, ``.grad`` and graph owners."""
        key_index = {k: i for i, k in enumerate(self.keys) if k is not None}
        frontier: dict[int, Any] = self._own({})
        for i, obj in enumerate(self.objects):
            if self.keys[i] is None:
                self._start(obj, i, Seg("storage", ""), "object", frontier)
        if self.light:
            return frontier
        self.tensors = self._own(_autograd.all_tensors())
        for t in self.tensors:
            info = _autograd.storage_of(t)
            if info is None or info[0] not in key_index:
                continue
            i = key_index[info[0]]
            if t is self.objects[i]:
                via = "itself"
            elif _autograd.is_view(t) or _autograd.is_view(self.objects[i]):
                via = "view"
            else:
                via = "alias"
            self._start(t, i, Seg("storage", ""), via, frontier)
        owners = [t for t in self.tensors if _has_graph_or_grad(t)]
        self._own(owners)
        known = {id(t) for t in self.tensors}
        self.walk = walk = _autograd.walk_graphs(owners, deadline=self.deadline, known=known)
        self._own(walk.saved)
        self._own(walk.grads)
        self._own(walk.py_nodes)
        self.not_inspected = self._own(walk.not_inspected)
        py_nodes = self._own(list(walk.py_nodes.values()))
        for coll in (walk.saved, walk.grads, walk.not_inspected, py_nodes):
            for entry in coll:
                self.ignore.add(id(entry))
        if walk.truncated:
            self.notes.append(f"autograd walk stopped after {walk.nodes} nodes")
        for owner, chain, key, _nbytes, label in walk.saved:
            if key in key_index:
                seg = Seg("autograd", f"{chain} {label}")
                self._start(owner, key_index[key], seg, "saved", frontier)
        for owner, _label, key, _nbytes in walk.grads:
            if key in key_index:
                self._start(owner, key_index[key], Seg("attr", "grad"), "grad", frontier)
        for node, owner, chain in py_nodes:
            entry = (owner, Seg("autograd", chain))
            self.ignore.add(id(entry))
            self.virtual.setdefault(id(node), []).append(entry)
        return frontier

    def _start(self, obj: Any, target: int, seg: Seg, via: str, frontier: dict[int, Any]) -> None:
        self.start.setdefault(id(obj), []).append((target, seg, via))
        if id(obj) not in self.nodes:
            self.nodes[id(obj)] = obj
            frontier[id(obj)] = obj

    def _frames(self) -> _Frames:
        """Locals of every thread's running frames (gc cannot see them)."""
        out = _Frames()
        self._own(out.keep)
        self._own(out.by_value)
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
                    if not own_frame(frame):
                        self._frame_roots(frame, ident, me, names, out)
                    frame = frame.f_back
        finally:
            # This frame is on the stack it walked: a local naming it would make a cycle
            # (frame -> its own locals -> frame) that outlives the call.
            del current
            top = None  # type: ignore[assignment]
            frame = None
        return out

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
            out.keep.append(value)

    def _module_dicts(self) -> dict[int, str]:
        """``id(module.__dict__) → module name`` for all of ``sys.modules``."""
        out: dict[int, str] = {}
        for _ in range(3):
            try:
                items = list(dict.items(sys.modules))
                break
            except RuntimeError:  # another thread imported while we copied
                continue
        else:
            return out
        for name, mod in items:
            if type(name) is not str or not is_sub(type(mod), types.ModuleType):
                continue
            try:
                d = _MODULE_DICT.__get__(mod)
            except Exception:
                continue
            out.setdefault(id(d), name)
        return out

    def _level(
        self, frontier: dict[int, Any], frames: _Frames, module_dicts: dict[int, str]
    ) -> dict[int, Any]:
        """Find the referrers of ``frontier``; return the next frontier."""
        nxt: dict[int, Any] = self._own({})
        # Two parallel lists, both ignored: a (ref, kids) tuple would itself be a referrer of
        # ``ref`` at the next level.
        found_refs: list[Any] = self._own([])
        found_kids: list[list[Any]] = self._own([])
        # Candidates: the referrers of a small frontier (one C-level heap scan), else every
        # object (one Python pass, cheaper than many scans once the frontier is large).
        if len(frontier) <= _BATCH_LIMIT:
            objs = self._own(list(frontier.values()))
            candidates = self._own(gc.get_referrers(*objs))
        else:
            candidates = self._own(gc.get_objects())
        for n, ref in enumerate(candidates):
            if n & 0x3FFF == 0 and self.timed_out():
                break
            if id(ref) in self.ignore:
                continue
            kids = [c for c in gc.get_referents(ref) if id(c) in frontier]
            if kids:
                found_refs.append(ref)
                found_kids.append(kids)
        for cid, child in frontier.items():
            for owner, seg in self.virtual.get(cid, ()):
                self._edge(owner, child, [seg], module_dicts, frames, nxt)
        for ref, kids in zip(found_refs, found_kids, strict=True):
            if type(ref) is types.FrameType and own_frame(ref):
                continue
            if id(ref) in frames.snapshot_ids:
                continue  # a running frame's f_locals snapshot: named from the frame instead
            for child in kids:
                segs = name_edges(ref, child, self.module_types, self.odd_keys)
                self._edge(ref, child, segs, module_dicts, frames, nxt)
        return nxt

    def _edge(
        self,
        ref: Any,
        child: Any,
        segs: list[Seg],
        module_dicts: dict[int, str],
        frames: _Frames,
        nxt: dict[int, Any],
    ) -> None:
        rid, cid = id(ref), id(child)
        plist = self.parents.setdefault(cid, [])
        if rid not in plist:
            plist.append(rid)
        self.edges.setdefault(rid, {}).setdefault(cid, segs[0])
        if rid not in self.hop:
            self.hop[rid] = (cid, segs[0])
        if rid in self.nodes:
            return
        self.nodes[rid] = ref
        if rid in module_dicts or type(ref) is type or is_sub(type(ref), type):
            return  # a root: do not look further up
        nxt[rid] = ref

    # -- reading paths off the tree -------------------------------------------------------
    def _collect(self, frames: _Frames, module_dicts: dict[int, str]) -> None:
        self.root_ids: list[int] = []
        seen_paths: set[tuple[int, str, str]] = set()
        for oid, obj in list(self.nodes.items()):
            roots: list[tuple[str, str, list[Seg], bool]] = []
            if oid in module_dicts:
                for _cid, segs in self._child_segs(oid):
                    for seg in segs:
                        roots.append(("global", module_dicts[oid], [seg], False))
            elif type(obj) is type or is_sub(type(obj), type):
                roots.append(("class", class_label(obj), [], False))
            for label, name, is_caller in frames.by_value.get(oid, ()):
                roots.append(("frame", label, [Seg("local", name, label)], is_caller))
            if roots:
                self.root_ids.append(oid)
            for kind, root, head, is_caller in roots:
                if len(self.holders) >= self.limits.max_paths * max(1, len(self.keys)):
                    self.notes.append("more paths than max_paths; the rest are not shown")
                    return
                start_id = oid
                segs = list(head)
                if oid in module_dicts:
                    # the head seg names the key; the path continues from that child
                    child_id = self._child_for(oid, head[0])
                    if child_id is None:
                        continue
                    start_id = child_id
                for target, tail, last, via in self._walk_down(start_id):
                    key = (target, root, _seg_text(segs + tail))
                    if key in seen_paths:
                        continue
                    seen_paths.add(key)
                    direct = len(tail) == 1 and via == "itself"
                    caller = is_caller and direct
                    if kind == "global" and direct:
                        caller = self._caller_global(oid)
                    self.holders.append(
                        RawHolder(target, kind, root, segs + tail, last, via, caller)
                    )
        self._unrooted(module_dicts, frames)

    def _caller_global(self, dict_id: int) -> bool:
        try:
            return (
                self.caller is not None
                and id(self.caller.f_globals) == dict_id
                and (self.caller.f_locals is self.caller.f_globals)
            )
        except Exception:
            return False

    def _child_segs(self, oid: int) -> list[tuple[int, list[Seg]]]:
        out = []
        for cid, plist in self.parents.items():
            if oid in plist:
                child = self.nodes.get(cid)
                if child is not None:
                    out.append((cid, name_edges(self.nodes[oid], child, self.module_types)))
        return out

    def _child_for(self, oid: int, seg: Seg) -> int | None:
        for cid, segs in self._child_segs(oid):
            if seg in segs:
                return cid
        return None

    def _walk_down(self, oid: int) -> list[tuple[int, list[Seg], Any, str]]:
        """Shortest paths down from ``oid`` to each object holding a target storage:
        ``(target, segs, last, via)``, one per such object (BFS over the recorded edges)."""
        prev: dict[int, tuple[int, Seg] | None] = {oid: None}
        queue = deque([oid])
        out: list[tuple[int, list[Seg], Any, str]] = []
        while queue:
            cur = queue.popleft()
            if cur in self.start:
                segs: list[Seg] = []
                node = cur
                while prev[node] is not None:
                    p, seg = prev[node]  # type: ignore[misc]
                    segs.append(seg)
                    node = p
                segs.reverse()
                for target, seg, via in self.start[cur]:
                    out.append((target, [*segs, seg], self.nodes.get(cur), via))
            for cid, seg in self.edges.get(cur, {}).items():
                if cid not in prev:
                    prev[cid] = (cur, seg)
                    queue.append(cid)
        return out

    def _unrooted(self, module_dicts: dict[int, str], frames: _Frames) -> None:
        """Holders no root explains: unreachable cycles, and objects gc sees no referrer of.

        Every explored object lies on a path down to an object holding a target. Those that
        no root reaches are either *sources* (no referrer found: something gc cannot see
        holds them, such as C code) or held only by each other: a finite set in which every
        object has a referrer inside the set contains a cycle, garbage that ``gc.collect()``
        frees.
        """
        if self.truncated_depth or self.timed_out() or len(self.nodes) >= self.limits.max_nodes:
            return  # the search did not finish: "no root" would be a guess
        rooted = self._below(self.root_ids)
        unrooted = [oid for oid in self.nodes if oid not in rooted]
        if not unrooted:
            return
        sources = [oid for oid in unrooted if not self.parents.get(oid)]
        explained = self._below(sources)
        rest = [oid for oid in unrooted if oid not in explained]
        # A source that is a queried object is held only by the call (a temporary argument).
        queried = {id(o) for o in self.objects}
        reps = [(oid, "unknown") for oid in sources if oid not in queried][:8]
        if rest:
            # Discovered last = inside the cycle's closure; name it by an object, not a dict.
            plain = (dict, list, tuple, set, types.CellType, types.FrameType)
            named = [o for o in rest if type(self.nodes.get(o)) not in plain]
            reps.append(((named or rest)[-1], "cycle"))
        for oid, kind in reps:
            label = f"<{type_name(type(self.nodes.get(oid)))} object>"
            seen: set[int] = set()
            for target, tail, last, via in self._walk_down(oid):
                if target in seen:
                    continue
                seen.add(target)
                self.holders.append(RawHolder(target, kind, label, tail, last, via))

    def _below(self, starts: list[int]) -> set[int]:
        """Every explored object reachable down the recorded edges from ``starts``."""
        seen = set(starts)
        queue = deque(starts)
        while queue:
            cur = queue.popleft()
            for cid in self.edges.get(cur, {}):
                if cid not in seen:
                    seen.add(cid)
                    queue.append(cid)
        return seen


def _seg_text(segs: list[Seg]) -> str:
    return "|".join(f"{s.kind}:{s.text}" for s in segs)


def _has_graph_or_grad(t: Any) -> bool:
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return (
                torch._C.TensorBase.__dict__["grad_fn"].__get__(t) is not None
                or _autograd.grad_of(t) is not None
            )
    except Exception:
        return False


def _thread_names() -> dict[int, str]:
    out: dict[int, str] = {}
    try:
        active = dict(threading._active)  # type: ignore[attr-defined]
    except Exception:
        return out
    for ident, th in active.items():
        d = instance_dict(th)
        name = d.get("_name") if d is not None else None
        if type(name) is str:
            out[ident] = name
    return out
