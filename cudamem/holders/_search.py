"""The holder search: from target storages back to named roots, in few heap passes.

One search serves any number of targets. Its steps:

1. the roots gc cannot see: locals of every thread's running frames; and module dicts;
2. every tensor object (one heap scan), every live autograd graph walked once (tensor →
   ``grad_fn`` → saved tensors is invisible to gc), ``.grad`` of every tensor, and for CPU
   targets the numpy arrays whose data lies in a target storage (gc does not track arrays);
3. the climb: the referrers of every object found so far that holds a target, level after
   level, until only roots are left. A few objects at a time are looked up with
   ``gc.get_referrers`` (one C scan); more with a chunked pass over a heap snapshot
   (``cudamem.native.heap``), which costs the same for 100 objects or 100,000 and may climb
   several levels at once. Each referrer is named once for all the children it holds
   (``cudamem.holders._naming.name_children``: one walk of a list, however many children);
4. paths are read off the recorded edges, down from each root (``cudamem.holders._graph_paths``);
   paths that differ only in list indices (or hold the same object at many indices) become
   one group with a count;
5. what no root explains: unreachable cycles, objects held by something gc cannot see,
   without the call's own temporaries; where a search cut short had got to.

Every loop checks the deadline. The climb stops at 75 % of ``timeout`` and reading the paths
at 90 % (earlier on a heap whose snapshot takes long to let go), so the whole call holds its
timeout; a search cut short says which limit stopped it and reports what it had found, never
"nothing found". One search runs at a time in a process.

Objects the search holds are released before it returns; ids of cudamem's own containers
(any thread) are ignored as referrers.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.args import check_int, check_seconds
from ..base.format import plural
from ..base.frames import own_frame
from ..native import heap as _heap
from ..native import heapscan as _heapscan
from . import _autograd
from ._autograd import StorageKey
from ._graph_paths import Group, PathReader, RawHolder
from ._naming import (
    Ref,
    Seg,
    class_label,
    frame_label,
    frame_locals,
    instance_dict,
    is_sub,
    name_children,
    type_module,
    type_name,
)

__all__ = ["SEARCH_LOCK", "RawHolder", "Search", "SearchLimits"]

_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
#: Shares of ``timeout`` for climbing and for reading paths (the rest is freezing results
#: and letting go of the heap snapshot, whose cost is reserved as well: _RELEASE_NS each).
_CLIMB_SHARE = 0.75
_READ_SHARE = 0.9
_RELEASE_NS = 60e-9
#: Unrooted objects reported when a limit stopped the search ("found so far").
_PARTIAL_PER_TARGET = 3
#: Builtin iterator types: a running ``for`` loop's iterator lives on the frame's value
#: stack, which gc cannot see, so it looks like an object nothing holds.
_ITERATORS = frozenset({"enumerate", "zip", "map", "filter", "reversed"})
#: Objects asked about beside a level's own in one scan, at most (see Search._referrers),
#: and functions whose closures are indexed for guessing them.
_LIKELY = 16
_CLOSURE_FUNCS = 256
_CLOSURE: Any = vars(types.FunctionType)["__closure__"]
_CELL: Any = vars(types.CellType)["cell_contents"]
_TEMPORARY_TYPES: tuple[type, ...] = (tuple, dict, functools.partial, types.MethodType)

_NONE: dict[int, Ref] = {}
_OURS = _heap.OURS
_OURS_LOCK = _heap.OURS_LOCK
#: One search at a time in the process: a search running in another thread would find the
#: first one's bookkeeping (lists of tensors on its stack) as holders.
SEARCH_LOCK = threading.RLock()


@dataclass(frozen=True)
class SearchLimits:
    """Bounds of one search."""

    max_depth: int = 40
    max_nodes: int = 200_000
    timeout: float = 30.0
    max_paths: int = 64

    @classmethod
    def checked(
        cls, *, max_depth: Any, max_nodes: Any, timeout: Any, max_paths: Any
    ) -> SearchLimits:
        """Limits from a user's arguments: ``TypeError``/``ValueError`` naming a bad one."""
        return cls(
            max_depth=check_int("max_depth", max_depth, minimum=1),
            max_nodes=check_int("max_nodes", max_nodes, minimum=1),
            timeout=check_seconds("timeout", timeout),
            max_paths=check_int("max_paths", max_paths, minimum=1),
        )


@dataclass
class _Frames:
    by_value: dict[int, list[tuple[str, str, bool]]] = field(default_factory=dict)
    values: dict[int, Any] = field(default_factory=dict)
    snapshot_ids: set[int] = field(default_factory=set)
    #: ids of the locals of cudamem's own frames (any thread): its temporaries.
    own_locals: set[int] = field(default_factory=set)
    keep: list[Any] = field(default_factory=list)


#: What the caller (the census) made just before a search, for it to start from: every
#: tensor, the walk of every graph, and the heap snapshot with its edge cache
#: (``_heap.edge_cache``; both ``None`` when it took no snapshot).
Prepared = tuple[list[Any], _autograd.GraphWalk, list[Any] | None, Any]


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
        scan: Prepared | None = None,
    ) -> None:
        self.light = light  # identity targets only: no tensor scan, no autograd walk
        self._scan = scan  # every tensor and the graph walk, made by the caller just now
        self.keys = keys
        self.objects = objects  # the queried objects, one per target
        self.limits = limits
        self.caller = caller
        t0 = time.perf_counter()
        self.deadline = t0 + limits.timeout * _CLIMB_SHARE
        self.read_deadline = t0 + limits.timeout * _READ_SHARE
        self._end = t0 + limits.timeout
        self.notes: list[str] = []
        #: The limit that cut the search short: ``timeout``, ``max_depth`` or ``max_nodes``.
        self.stopped: str | None = None
        self.levels = 0
        self.not_inspected: list[tuple[Any, str]] = []
        self._ids: list[int] = []
        self.keep: list[Any] = []  # our containers stay alive so their ids stay unique
        self._own(objects)
        with _OURS_LOCK:
            _OURS.add(id(self.keep))
        self._ids.append(id(self.keep))
        self.nodes: dict[int, Any] = self._own({})
        self.depth: dict[int, int] = self._own({})
        # parent id -> child id -> every reference from parent to child.
        self.edges: dict[int, dict[int, Ref]] = self._own({})
        self.has_parent: set[int] = self._own(set())
        self.start: dict[int, list[tuple[int, Seg, str]]] = self._own({})
        self.virtual: dict[int, list[tuple[Any, Seg]]] = self._own({})
        #: Tensors held by a view or numpy array of theirs (not holders in their own right).
        self.bases: set[int] = self._own(set())
        self.current: set[int] = self._own(set())
        #: Every id added to ``current``, in order (a compiled pass reads the new ones).
        self._added: list[int] = []
        self.next: set[int] = self._own(set())
        self.holders: list[RawHolder] = []
        self.module_types: tuple[type, ...] = (torch.nn.Module,)
        self.odd_keys: dict[int, Any] = self._own({})
        self.tensors: list[Any] = []
        self.walk: _autograd.GraphWalk | None = None
        self.heap: list[Any] | None = None
        self._edges: Any = None  # the heap's edge cache (_heap.edge_cache), shared by passes
        self._order: list[tuple[int, int]] = []  # the snapshot in gc order (_heap.snapshot)
        if scan is not None and scan[2] is not None:
            self.heap = self._own(scan[2])
            self._edges = scan[3]
            self._reserve(len(self.heap) * _RELEASE_NS)
        self.frames = _Frames()
        self.module_dicts: dict[int, str] = {}
        self.root_ids: list[int] = []
        self.roots: list[int] = []  # module dicts and classes reached
        self._arrays: tuple[type, ...] = ()
        self._array_ids: set[int] = self._own(set())
        self._regions: list[tuple[int, int, int]] = []  # (start, end, target), by start
        self._groups: list[dict[tuple[Any, ...], Group]] = []
        self.reader = PathReader({}, {}, {}, limits.max_paths, self._read_late)
        self.nbytes: list[int | None] = [None] * len(keys)
        # The last gc.get_referrers scan: what it asked about (ids) and found (see _referrers).
        self._ask: list[Any] = []
        self._asked: set[int] = set()
        self._pool: list[Any] | None = None
        self._refers: list[set[int] | None] = []
        self._closures: tuple[dict[int, list[int]], dict[int, Any]] | None = None

    # -- bookkeeping --------------------------------------------------------------------
    def _own(self, container: Any) -> Any:
        with _OURS_LOCK:
            _OURS.add(id(container))
        self._ids.append(id(container))
        self.keep.append(container)
        return container

    def release(self) -> None:
        """Drop every reference the search took."""
        for c in list(self.keep):
            with contextlib.suppress(Exception):
                c.clear()
        self.keep.clear()
        with _OURS_LOCK:
            for i in self._ids:
                _OURS.discard(i)
        self._ids.clear()
        self.tensors = []
        self.walk = None
        self._scan = None
        self.heap = None
        self._edges = None
        self.objects = []
        self.caller = None
        self.not_inspected = []
        self.frames = _Frames()
        self._ask = []
        self._pool = None
        self._refers = []
        self._closures = None

    def timed_out(self) -> bool:
        return time.perf_counter() > self.deadline

    def _stop(self, limit: str) -> None:
        if self.stopped is None:
            self.stopped = limit

    # -- passes ---------------------------------------------------------------------------
    def run(self) -> None:
        self.frames = self._frames()
        self.module_dicts = self._module_dicts()
        self._seed()
        self._climb(bool(self._arrays))  # CPU targets: the first pass finds arrays too
        self._collect()
        self._limit_notes()

    def _limit_notes(self) -> None:
        found = f"after {plural(self.levels, 'level')} and {plural(len(self.nodes), 'object')}"
        if self.stopped == "timeout":
            self.notes.append(
                f"search stopped by its timeout ({self.limits.timeout:g} s) {found}: "
                "holders beyond that are not listed"
            )
        elif self.stopped == "max_depth":
            self.notes.append(
                f"search stopped at depth {self.limits.max_depth} (max_depth) {found}: "
                "holders further from a root are not listed"
            )
        elif self.stopped == "max_nodes":
            self.notes.append(
                f"search stopped after {plural(len(self.nodes), 'object')} (max_nodes): "
                "holders beyond that are not listed"
            )

    def _seed(self) -> None:
        """Objects that hold a target storage directly: tensors, ``.grad``, graph owners,
        numpy arrays in a frame's locals (arrays elsewhere are found by the first pass)."""
        key_index = {k: i for i, k in enumerate(self.keys) if k is not None}
        for i, obj in enumerate(self.objects):
            if self.keys[i] is None:
                self._start(obj, i, Seg("storage", ""), "object")
        if self.light or self.timed_out():
            if self.timed_out():
                self._stop("timeout")
            return
        prepared, self._scan = self._scan, None
        if prepared is not None:
            tensors = prepared[0]
        elif _heapscan.native() is not None:  # one walk of the heap for the passes, too
            tensors = self._walk()
        else:
            tensors = _autograd.all_tensors()
        self.tensors = self._own(tensors)
        for n, t in enumerate(self.tensors):
            if not n & 0xFFF and self.timed_out():
                self._stop("timeout")
                return
            info = _autograd.storage_of(t)
            if info is None or info[0] not in key_index:
                continue
            i = key_index[info[0]]
            target = self.objects[i]
            if t is target:
                via = "itself"
            elif _autograd.is_view(t) or _autograd.is_view(target):
                via = "view"
            else:
                via = "alias"
            base = _autograd.base_of(t)
            if base is not None:
                self.bases.add(id(base))
            self._start(t, i, Seg("storage", ""), via)
        if prepared is not None:
            walk = prepared[1]
        else:
            owners = self._own([t for t in self.tensors if _autograd.has_graph_or_grad(t)])
            known = {id(t) for t in self.tensors}
            walk = _autograd.walk_graphs(owners, deadline=self.deadline, known=known)
        self.walk = walk
        for coll in (walk.saved, walk.grads, walk.not_inspected):
            self._own(coll)
        self._own(walk.py_nodes)
        self.not_inspected = walk.not_inspected
        py_nodes = self._own(list(walk.py_nodes.values()))
        with _OURS_LOCK:
            for coll in (walk.saved, walk.grads, walk.not_inspected, py_nodes):
                for entry in coll:
                    _OURS.add(id(entry))
                    self._ids.append(id(entry))
        if walk.truncated:
            self.notes.append(f"autograd walk stopped after {plural(walk.nodes, 'node')}")
            if self.timed_out():
                self._stop("timeout")
        for owner, chain, key, _nbytes, label in walk.saved:
            if key in key_index:
                seg = Seg("autograd", f"{chain} {label}")
                self._start(owner, key_index[key], seg, "saved")
        for owner, _label, key, _nbytes in walk.grads:
            if key in key_index:
                self._start(owner, key_index[key], Seg("attr", "grad"), "grad")
        for node, owner, chain in py_nodes:
            entry = (owner, Seg("autograd", chain))
            self.virtual.setdefault(id(node), []).append(entry)
            if id(node) in self.nodes:
                self._edge(owner, node, Ref((entry[1],)))
        self._arrays_for_cpu_targets()

    def _arrays_for_cpu_targets(self) -> None:
        """Numpy arrays on the memory of CPU targets: those in frames now; the rest in the
        first pass. gc tracks no array, so a container holding ``t.numpy()`` (which holds
        ``t`` itself, gc cannot see that either) shows only among that container's
        referents: nothing short of a pass over the heap finds it, whether or not ``t`` is
        held elsewhere too."""
        regions = []
        for i, key in enumerate(self.keys):
            if key is not None and key[0] == "cpu":
                nbytes = self.nbytes[i] or 1
                regions.append((key[2], key[2] + max(nbytes, 1), i))
        if not regions:
            return
        self._arrays = _autograd.array_types()
        if not self._arrays:
            return
        regions.sort()
        self._regions = regions
        locals_ = [v for v in self.frames.values.values() if type(v) in self._arrays]
        self._on_arrays(locals_)

    def _on_arrays(self, arrays: list[Any], edges: Sequence[tuple[Any, Any]] = ()) -> bool:
        """Numpy arrays whose data overlaps a CPU target's storage hold it; whether one
        joined the search. ``edges``: ``(container, child)`` from the untracked dicts and
        tuples the arrays were found in (``_heap.untracked_arrays``), named here because
        no heap pass can see those containers as referrers."""
        before = len(self.next)
        starts = [r[0] for r in self._regions]
        for arr in arrays:
            if id(arr) in self._array_ids:
                continue
            self._array_ids.add(id(arr))
            region = _autograd.array_region(arr)
            if region is None or region[1] <= 0:
                continue
            lo, hi = region[0], region[0] + region[1]
            pos = max(bisect.bisect_right(starts, lo) - 1, 0)
            while pos < len(self._regions) and self._regions[pos][0] < hi:
                start, end, target = self._regions[pos]
                if start < hi and lo < end:
                    base = _autograd.array_base(arr)
                    if base is not None and is_sub(type(base), torch.Tensor):
                        self.bases.add(id(base))
                    self._start(arr, target, Seg("storage", ""), "numpy")
                pos += 1
        if edges:
            self._untracked_edges(edges)
        return len(self.next) > before

    def _untracked_edges(self, edges: Sequence[tuple[Any, Any]]) -> None:
        """Record the edges from untracked containers down to arrays now in the search,
        innermost first, so that each container joins the search and its (tracked)
        referrers are found by the climb."""
        parents: dict[int, list[Any]] = {}
        for container, child in edges:
            parents.setdefault(id(child), []).append(container)
        queue = [oid for oid in parents if oid in self.nodes]
        while queue:
            cid = queue.pop()
            child = self.nodes.get(cid)
            if child is None:
                continue
            for container in parents.pop(cid, ()):
                names = name_children(container, {cid: child}, self.module_types, self.odd_keys)
                for r in names.values():
                    self._edge(container, child, r)
                if id(container) in parents:
                    queue.append(id(container))

    def _start(self, obj: Any, target: int, seg: Seg, via: str) -> None:
        self.start.setdefault(id(obj), []).append((target, seg, via))
        if id(obj) not in self.nodes:
            self.nodes[id(obj)] = obj
            self.depth[id(obj)] = 0
            if is_sub(type(obj), type):
                self.roots.append(id(obj))
            self.current.add(id(obj))
            self._added.append(id(obj))
            self.next.add(id(obj))  # found in mid-pass: the next pass looks behind it

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

    def _climb(self, arrays_first: bool) -> None:
        """Referrers of everything found, until only roots are left (or a limit stops it);
        ``arrays_first``: the first pass also finds numpy arrays on a CPU target's memory."""
        first = arrays_first
        need: int | None = None  # batches the next chunked pass must cover (None: all)
        while self.current and self.stopped is None:
            if self.timed_out():
                self._stop("timeout")
                break
            self.levels += 1
            self.next.clear()
            arrays = first
            if not arrays and self._scan_is_cheaper(need):
                found = self._referrers()
                for n, ref in enumerate(found):
                    if not n & 0xFFF and self.timed_out():
                        self._stop("timeout")
                        break
                    self._hit(ref)
                found.clear()
                need = None  # what it found was never looked for: a full pass next
            else:
                done, last, whole = _heap.chunked_pass(
                    self._snapshot(),
                    self.current,
                    self._hit,
                    at_least=need,
                    deadline=self.deadline,
                    array_type=self._arrays[0] if arrays else None,
                    on_arrays=self._on_arrays if arrays else None,
                    added=self._added,
                    edges=self._edges,
                )
                if not done:
                    self._stop("timeout")
                # New finds of a shortened pass were tested against part of the heap only.
                need = last + 1 if whole or last < 0 else None
            first = False
            self.current, self.next = self.next, self.current

    def _walk(self) -> list[Any]:
        """Every tensor, off the heap snapshot taken now with its edge cache recorded
        whole (one walk of gc's lists: ``_heap.walked``) or, where that walk is missing,
        off a listing."""
        kinds = _autograd.tensor_types()
        cpu = any(k is not None and k[0] == "cpu" for k in self.keys)
        arrays = _autograd.array_types() if cpu else ()
        walked = _heap.walked(self._order, kinds, arrays[0] if arrays else None)
        if walked is None:
            return _autograd.all_tensors(self._snapshot(), self._order)
        heap, self._edges, found = walked
        self.heap = self._own(heap)
        self._reserve(len(heap) * _RELEASE_NS)
        return _autograd.all_tensors(found=found, found_types=kinds)

    def _snapshot(self) -> list[Any]:
        """The heap snapshot every pass of this search walks (taken at the first pass), with
        its edge cache."""
        if self.heap is None:
            self.heap = self._own(_heap.snapshot(self._order))
            self._edges = _heap.edge_cache()
            self._reserve(len(self.heap) * _RELEASE_NS)
        return self.heap

    def _referrers(self) -> list[Any]:
        """Every referrer of the objects in ``current``, in heap order, as one
        ``gc.get_referrers`` scan of them would list them.

        The scan also asks about the objects likely to join the search in the next levels
        (the cell, tuple and function of a closure that one of them is in); a level whose
        objects were all asked about by the last scan picks its referrers out of that scan's
        answer (which holds every referrer of each of them) instead of scanning the whole
        heap for one or two objects. Either way the level sees exactly the referrers of its
        own objects, in the same order, so the search runs as if each level had scanned.
        """
        if self._pool is None or not self.current <= self._asked:
            if self._pool is not None:
                self._pool.clear()
                self._ask.clear()
            ask = self._ask = self._own([self.nodes[i] for i in self.current])
            level = len(ask)
            ask += self._likely_parents()
            asked = self._asked = {id(o) for o in ask}
            pool: list[Any] = self._own(gc.get_referrers(*ask))
            self._pool = pool
            if len(ask) == level:  # nothing else asked: the very answer, and no later level's
                self._asked, self._refers = set(), []
                return pool
            # Which asked objects each referrer refers to (ids): one look at each, not one
            # per level (a referrer may be a large container). cudamem's own containers (the
            # heap snapshot refers to everything) go to every level, whose _hit skips them.
            get = gc.get_referents
            self._refers = [
                None if id(r) in _OURS else asked.intersection(map(id, get(r))) for r in pool
            ]
        cur = self.current  # as at the start of the level: the level adds to it as it goes
        picked: list[Any] = self._own(
            [
                r
                for r, ids in zip(self._pool, self._refers, strict=True)
                if ids is None or not cur.isdisjoint(ids)
            ]
        )
        return picked

    def _likely_parents(self) -> list[Any]:
        """Objects not yet found that probably hold what ``current`` holds, a few levels up:
        through the closures of the functions that running frames hold (a cell's holder is
        its closure tuple, whose holder is the function, which may sit in another cell)."""
        if self._closures is None:
            self._closures = self._closure_index()
        parents, objs = self._closures
        if not parents:
            return []
        out: list[Any] = []
        seen = set(self.current)
        queue = list(self.current)
        while queue and len(out) < _LIKELY:
            for pid in parents.get(queue.pop(), ()):
                if pid not in seen and pid not in self.nodes:
                    seen.add(pid)
                    out.append(objs[pid])
                    queue.append(pid)
        return out

    def _closure_index(self) -> tuple[dict[int, list[int]], dict[int, Any]]:
        """``child id → ids of what holds it`` through closures (a cell's contents → the
        cell → its closure tuple → the function), for the functions in running frames'
        locals and the functions in their cells; and ``id → object`` of those holders.
        Ints only in the first dict: our bookkeeping must not refer to what it indexes."""
        parents: dict[int, list[int]] = self._own({})
        objs: dict[int, Any] = self._own({})
        funcs = [v for v in self.frames.values.values() if type(v) is types.FunctionType]
        done: set[int] = set()
        try:
            while funcs and len(done) < _CLOSURE_FUNCS:
                f = funcs.pop()
                if id(f) in done:
                    continue
                done.add(id(f))
                closure = _CLOSURE.__get__(f)
                if type(closure) is not tuple:
                    continue
                objs[id(f)] = f
                objs[id(closure)] = closure
                parents.setdefault(id(closure), []).append(id(f))
                for cell in closure:
                    if type(cell) is not types.CellType:
                        continue
                    objs[id(cell)] = cell
                    parents.setdefault(id(cell), []).append(id(closure))
                    try:
                        value = _CELL.__get__(cell)
                    except ValueError:  # an empty cell
                        continue
                    parents.setdefault(id(value), []).append(id(cell))
                    if type(value) is types.FunctionType:
                        funcs.append(value)
                    del value
                del f, closure
        except Exception:
            pass  # a guess only: what it indexed so far is as good
        funcs.clear()
        return parents, objs

    def _reserve(self, seconds: float) -> None:
        """Keep ``seconds`` at the end of the timeout for letting go of the snapshot."""
        self.deadline = min(self.deadline, self._end - seconds - 0.15 * self.limits.timeout)
        self.read_deadline = min(self.read_deadline, self._end - seconds)

    def _scan_is_cheaper(self, need: int | None) -> bool:
        """Whether ``gc.get_referrers`` (a C scan of the whole heap, comparing each reference
        with every object asked about) beats a chunked pass over the part of the heap that
        ``need`` says is left (~100 ns an object): few objects, or no snapshot yet."""
        k = len(self.current)
        if k > _heap.SMALL:
            return False
        if _heapscan.native() is not None:
            # A compiled pass (~12 ns an object, and it may climb several levels at once)
            # beats a scan (~23 ns an object and more per object asked about) even over the
            # whole heap: a deep path (a loss's graph) no longer costs one scan per level.
            return False
        if self.heap is None or need is None:
            return True
        scan_ns = len(self.heap) * (23 + 0.7 * k)
        pass_ns = min(need * _heap.CHUNK, len(self.heap)) * _heap.PASS_NS
        return scan_ns <= pass_ns

    def _hit(self, ref: Any) -> bool:
        """``ref`` refers to something in ``current``: record and name its edges; whether a
        new object joined the search."""
        rid = id(ref)
        if rid in _OURS or rid in self.frames.snapshot_ids:
            return False
        tp = type(ref)
        if tp is types.FrameType and own_frame(ref):
            return False
        current = self.current
        named = self.edges.get(rid, _NONE)  # known from an earlier pass: name only what is new
        kids = {id(c): c for c in gc.get_referents(ref) if id(c) in current and id(c) not in named}
        if not kids:
            return False
        before = len(self.next)
        for cid, r in name_children(ref, kids, self.module_types, self.odd_keys).items():
            self._edge(ref, kids[cid], r)
        return len(self.next) > before  # a root found is not something to look above

    def _edge(self, ref: Any, child: Any, r: Ref) -> None:
        rid, cid = id(ref), id(child)
        known = rid in self.nodes
        depth = self.depth.get(cid, 0) + 1
        if not known:
            if depth > self.limits.max_depth:
                self._stop("max_depth")
                return
            if len(self.nodes) >= self.limits.max_nodes:
                self._stop("max_nodes")
                return
        self.has_parent.add(cid)
        out = self.edges.get(rid)
        if out is None:
            out = self.edges[rid] = {}
        if cid not in out:
            out[cid] = r
        if known:
            return
        self.nodes[rid] = ref
        self.depth[rid] = depth
        if rid in self.module_dicts or type(ref) is type or is_sub(type(ref), type):
            self.roots.append(rid)
            return  # a root: do not look further up
        self.current.add(rid)
        self._added.append(rid)
        self.next.add(rid)
        for owner, seg in self.virtual.get(rid, ()):
            self._edge(owner, ref, Ref((seg,)))

    # -- reading paths off the recorded edges ---------------------------------------------
    def _read_late(self) -> bool:
        return time.perf_counter() > self.read_deadline

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


def _temporary(obj: Any) -> bool:
    tp = type(obj)
    return any(is_sub(tp, t) for t in _TEMPORARY_TYPES)


def _is_iterator(tp: type) -> bool:
    name = type_name(tp)
    if not (name.endswith("iterator") or name in _ITERATORS):
        return False
    return type_module(tp) == "builtins"


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
