"""The state one holder search works on (``_SearchBase``: the targets, the recorded edges, the
deadlines, the containers it owns), its limits (``SearchLimits``) and the constants and small
rules its passes share. ``_search.Search`` runs the passes, ``_search_climb`` and
``_search_roots`` hold them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.args import check_int, check_seconds
from ..native import heap as _heap
from . import _autograd
from ._autograd import StorageKey
from ._graph_paths import Group, PathReader, RawHolder
from ._naming import (
    Ref,
    Seg,
    instance_dict,
    is_sub,
    type_module,
    type_name,
)

__all__ = ["SEARCH_LOCK", "Prepared", "SearchLimits"]

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


class _SearchBase:
    """The state of one search (what every pass reads and writes), and its bookkeeping: the
    containers it owns, the deadlines, the limit that stopped it."""

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

    def _reserve(self, seconds: float) -> None:
        """Keep ``seconds`` at the end of the timeout for letting go of the snapshot."""
        self.deadline = min(self.deadline, self._end - seconds - 0.15 * self.limits.timeout)
        self.read_deadline = min(self.read_deadline, self._end - seconds)

    # -- reading paths off the recorded edges ---------------------------------------------
    def _read_late(self) -> bool:
        return time.perf_counter() > self.read_deadline


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
