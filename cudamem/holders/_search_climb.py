"""Step 3 of the holder search (see ``cudamem.holders._search``): the climb from the objects that
hold a target up through their referrers, level after level, until only roots are left.
"""

from __future__ import annotations

import bisect
import gc
import types
from collections.abc import Sequence
from typing import Any

import torch

from ..base.frames import own_frame
from ..native import heap as _heap
from ..native import heapscan as _heapscan
from . import _autograd
from ._naming import (
    Ref,
    Seg,
    is_sub,
    name_children,
)
from ._search_base import (
    _CELL,
    _CLOSURE,
    _CLOSURE_FUNCS,
    _LIKELY,
    _NONE,
    _OURS,
    _RELEASE_NS,
    _SearchBase,
)


class _Climb(_SearchBase):
    """The climb: the referrers of every object found so far that holds a target, level after
    level (``gc.get_referrers`` for a few objects, a chunked heap pass for many), each referrer
    named once for all the children it holds; and where a search starts (``_start``, numpy
    arrays over a CPU target's storage)."""

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
