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

from ..base.format import plural
from ..native import heapscan as _heapscan
from . import _autograd
from ._naming import (
    Ref,
    Seg,
)
from ._search_base import _OURS, _OURS_LOCK
from ._search_climb import _Climb
from ._search_roots import _Roots

__all__ = ["Search"]


class Search(_Roots, _Climb):
    """One search for the holders of ``targets`` (storage keys, or objects by identity)."""

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
