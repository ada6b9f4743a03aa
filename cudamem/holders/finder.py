"""``who_holds()``: every path that keeps a tensor's memory alive; ``find_graph_holders()``:
the containers that keep autograd graphs alive.

What keeps memory alive is a storage, so a tensor's holders are the holders of every tensor
sharing its storage (views, ``detach()``, ``.data``, tensors saved by autograd). Paths read as
Python from a root: ``__main__.loss_history[3]``, ``Cache.store['a']``,
``train.py:42 in step(): local 'batch'``, ``__main__.model.lin1.weight``,
``__main__.loss_history[3] → grad_fn MeanBackward0 → SigmoidBackward0 saved result``.

The search never calls user code, keeps nothing alive after it returns (results hold only
strings and ints), and is bounded in depth, objects and time; see ``cudamem.holders._search``.
Many references of one shape (``log = [loss] * 3000``, 60,000 dicts in a list that each hold
the tensor) are one ``Holder`` with a ``count``, written ``__main__.log[0..2999]``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..base.args import check_int, check_seconds
from ..base.format import plural
from ..base.frames import own_frame
from ..base.present import Presented, PresentedHtml
from ..base.sequence import ItemSequence
from ..native import heap as _heap
from . import _autograd
from . import _search_base as __search_base
from ._autograd import StorageKey
from ._graph_paths import RawHolder, write
from ._naming import is_sub, type_name
from ._search import Search
from ._search_base import SearchLimits
from .culprits import rank_holders
from .holder_path import HolderPath

__all__ = [
    "GraphHolder",
    "GraphHolders",
    "Holder",
    "Holders",
    "find_graph_holders",
    "who_holds",
]


@dataclass(frozen=True, slots=True)
class Holder(Presented):
    """One path from a root that keeps the queried memory alive."""

    json_properties: ClassVar[tuple[str, ...]] = ("path", "root_kind", "pattern")
    json_order: ClassVar[tuple[str, ...]] = ("path", "root_kind")

    #: The path as structure (``cudamem.holders.holder_path``): its steps, container, pattern, and
    #: whether it goes through an autograd graph. ``path`` is its text.
    route: HolderPath = field(metadata={"json": False})
    #: The root: a module name, a class, a frame (``train.py:42 in step()``), ...
    root: str
    #: ``itself``, ``view``, ``alias``, ``saved``, ``grad``, ``numpy`` (a numpy array sharing
    #: the memory, e.g. from ``t.numpy()``) or ``object``.
    via: str
    #: Bytes of the storage held (``None`` for non-tensor objects).
    nbytes: int | None
    #: ``cpu``, ``cuda:0``, ... (``None`` for non-tensor objects).
    device: str | None
    #: The caller's own reference to the argument of ``who_holds``.
    caller: bool = False
    #: References this entry stands for: ``log = [t] * 3000`` is one entry with 3000, as are
    #: 3000 dicts in one list that each hold it (paths differing only in list indices).
    count: int = 1

    @property
    def path(self) -> str:
        """Python-like path from the root, e.g. ``__main__.trainer.outputs['val'][2]``."""
        return self.route.text

    @property
    def root_kind(self) -> str:
        """``global``, ``class``, ``frame``, ``traceback``, ``ipython``, ``cycle``,
        ``unknown``, or ``partial`` (where a search cut short by a limit had got to, below
        no root yet)."""
        return self.route.root_kind

    @property
    def pattern(self) -> str | None:
        """With ``count > 1``: the path with what varies written as a range or ``*``, e.g.
        ``__main__.log[0..2999]`` or ``__main__.rows[*]['t']``; else ``None``."""
        return self.route.pattern if self.count > 1 else None

    @property
    def is_alias(self) -> bool:
        """Whether the path ends at another tensor sharing the storage."""
        return self.via not in ("itself", "object")


@dataclass(frozen=True, slots=True)
class Holders(ItemSequence[Holder], PresentedHtml):
    """The holders of one object: a read-only sequence of ``Holder``."""

    #: What was asked about, e.g. ``Tensor float32[1024, 1024] on cuda:0``.
    target: str
    nbytes: int | None
    device: str | None
    holders: tuple[Holder, ...]
    #: Bounds that cut the search short, nodes not inspected, other caveats.
    notes: tuple[str, ...] = ()
    elapsed: float = 0.0
    #: The limit that cut the search short (``timeout``, ``max_depth``, ``max_nodes``), or
    #: ``None`` when it ran to the end. When set, the holders are what was found so far.
    stopped: str | None = None

    @property
    def complete(self) -> bool:
        """Whether the search ran to the end (no limit cut it short)."""
        return self.stopped is None

    def _items(self) -> tuple[Holder, ...]:
        """The holders."""
        return self.holders

    @property
    def paths(self) -> list[str]:
        """Every holder's path, in order."""
        return [h.path for h in self.holders]


def who_holds(
    obj: Any,
    *,
    max_depth: int = 40,
    max_nodes: int = 200_000,
    timeout: float = 30.0,
    max_paths: int = 64,
) -> Holders:
    """Name every path that keeps ``obj`` (a tensor's storage, or any object) alive.

    Args:
        obj: a tensor or parameter (its storage is what is held: views, ``detach()``, numpy
            arrays from ``t.numpy()`` and tensors saved by autograd count), or any other
            object (matched by identity).
        max_depth: most references followed from ``obj`` towards a root (``>= 1``).
        max_nodes: most objects explored (``>= 1``).
        timeout: seconds the call may take (``>= 0``); it returns within about 20 % of it,
            with what it found so far and ``stopped='timeout'``.
        max_paths: most holders reported (``>= 1``); paths differing only in list indices
            count as one. Past it, the paths kept are rooted, direct (not through an
            autograd graph) and short ones first; your own reference last.

    Returns:
        ``Holders``, a sequence of ``Holder`` (``print()`` it; JSON:
        ``render.json.to_json()``). The caller's own reference to ``obj`` is shown once,
        marked as the caller's.

    Raises:
        TypeError: a limit of the wrong type (``timeout=None``, ``max_depth="10"``).
        ValueError: a limit out of range (negative, zero depth, NaN timeout).
    """
    limits = SearchLimits.checked(
        max_depth=max_depth, max_nodes=max_nodes, timeout=timeout, max_paths=max_paths
    )
    return find_holders([obj], limits, _caller_frame())[0]


def _caller_frame() -> types.FrameType | None:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and own_frame(frame):
        frame = frame.f_back
    return frame


def find_holders(
    objs: list[Any],
    limits: SearchLimits,
    caller: types.FrameType | None,
    keys: list[StorageKey | None] | None = None,
    nbytes: list[int | None] | None = None,
    labels: list[str] | None = None,
    scan: __search_base.Prepared | None = None,
) -> list[Holders]:
    """Holders of several objects (or storage keys) in one search.

    ``scan``: every tensor, the walk of every graph and the heap snapshot, when the caller
    (the census) has just made them; the search then starts from them instead of scanning
    again.

    ``objs`` is emptied when the search ends (a list of ours holding the targets would be a
    holder in its own right while it lives)."""
    # No cyclic collection from start to end: its own bookkeeping would otherwise set one off
    # (a full collection of a 1.5 M-object heap took 0.4 s, inside a 0.5 s timeout); what
    # the interpreter owes runs at the caller's next allocation instead.
    with _heap.ignored(objs), _heap.gc_paused():  # while it waits for another search, too
        return _find_holders(objs, limits, caller, keys, nbytes, labels, scan)


def _find_holders(
    objs: list[Any],
    limits: SearchLimits,
    caller: types.FrameType | None,
    keys: list[StorageKey | None] | None,
    nbytes: list[int | None] | None,
    labels: list[str] | None,
    scan: __search_base.Prepared | None,
) -> list[Holders]:
    t0 = time.perf_counter()
    if keys is None:
        keys, nbytes = [], []
        for o in objs:
            info = _autograd.storage_of(o) if is_sub(type(o), torch.Tensor) else None
            keys.append(None if info is None else info[0])
            nbytes.append(None if info is None else info[1])
    assert nbytes is not None
    if not __search_base.SEARCH_LOCK.acquire(timeout=_wait(limits.timeout)):
        busy = ("another holder search (another thread) ran for the whole timeout",)
        names = labels if labels is not None else [_describe(o) for o in objs]
        objs.clear()
        return [
            Holders(names[i], nbytes[i], _device_text(keys[i]), (), busy, limits.timeout, "timeout")
            for i in range(len(keys))
        ]
    try:
        left = max(0.0, limits.timeout - (time.perf_counter() - t0))
        raws, notes, targets, stopped, key_names, unnamed = _search_once(
            objs, dataclasses.replace(limits, timeout=left), caller, keys, nbytes, labels, scan
        )
        with _heap.gc_paused():
            left = limits.timeout - (time.perf_counter() - t0)
            key_names.update(_name_odd_keys(unnamed, min(2.0, left * 0.5)))
            per: list[list[Holder]] = [[] for _ in keys]
            for raw in raws:
                holder = _freeze(raw, keys[raw.target], nbytes[raw.target], key_names)
                per[raw.target].append(holder)
    finally:
        __search_base.SEARCH_LOCK.release()
    elapsed = time.perf_counter() - t0
    out = []
    for i in range(len(keys)):
        device = _device_text(keys[i])
        holders = rank_holders(_dedupe_caller(per[i]))
        out.append(
            Holders(targets[i], nbytes[i], device, tuple(holders), tuple(notes), elapsed, stopped)
        )
    return out


def _wait(timeout: float) -> float:
    """``Lock.acquire``'s timeout for a search's own (``-1``: wait as long as it takes)."""
    return -1 if math.isinf(timeout) else timeout


def _search_once(
    objs: list[Any],
    limits: SearchLimits,
    caller: types.FrameType | None,
    keys: list[StorageKey | None],
    nbytes: list[int | None],
    labels: list[str] | None,
    scan: __search_base.Prepared | None,
) -> tuple[list[RawHolder], list[str], list[str], str | None, dict[str, str], list[Any]]:
    """Run one search; what freezing its results needs, with nothing of the heap held but
    the dict keys still to be named (``unnamed``)."""
    search = Search(keys, objs, limits, caller, scan=scan)
    search.nbytes = list(nbytes)
    try:
        with _heap.gc_paused():
            search.run()
        raws = search.holders
        notes = list(dict.fromkeys(search.notes))
        for _owner, chain in search.not_inspected:
            notes.append(f"not inspected: {chain} (saved-tensor hooks, e.g. checkpointing)")
        targets = labels if labels is not None else [_describe(o) for o in objs]
        # Dict keys that are objects (a parameter keying ``optimizer.state``): named by a
        # target's own path when they are targets, else by a small search of their own.
        queried = {id(o): i for i, o in enumerate(objs)}
        key_names: dict[str, str] = {}
        unnamed: list[Any] = []
        by_target: dict[int, list[RawHolder]] = {}
        if search.odd_keys:
            for r in raws:
                by_target.setdefault(r.target, []).append(r)
        for kid, key_obj in search.odd_keys.items():
            if kid in queried:
                name = _key_name(by_target.get(queried[kid], []))
                if name is not None:
                    key_names[str(kid)] = name
            elif len(unnamed) < _MAX_KEY_SEARCH and is_sub(type(key_obj), torch.Tensor):
                unnamed.append(key_obj)
        return raws, notes, targets, search.stopped, key_names, unnamed
    finally:
        search.release()  # before the key search, which must not find our bookkeeping


def _device_text(key: StorageKey | None) -> str | None:
    return None if key is None else _autograd.key_device(key)


def _describe(obj: Any) -> str:

    tp = type(obj)
    if is_sub(tp, torch.Tensor):
        dtype, shape, _ = _autograd.describe_tensor(obj)
        info = _autograd.storage_of(obj)
        where = f" on {_device_text(info[0])}" if info is not None else ""
        return f"{type_name(tp)} {dtype}[{', '.join(map(str, shape))}]{where}"
    return f"{type_name(tp)} object"


def _dedupe_caller(holders: list[Holder]) -> list[Holder]:
    out: list[Holder] = []
    seen_caller = False
    for h in holders:
        if h.caller:
            if seen_caller:
                continue
            seen_caller = True
        out.append(h)
    return out


#: Dict keys that are objects named by a search of their own, at most.
_MAX_KEY_SEARCH = 64


def _name_odd_keys(wanted: list[Any], timeout: float) -> dict[str, str]:
    """Name dict keys that are objects (``optimizer.state[<model.lin1.weight>]``) by a path,
    within ``timeout`` seconds; ``wanted`` is emptied."""
    if not wanted or timeout <= 0:
        wanted.clear()
        return {}
    ids = [id(o) for o in wanted]
    limits = SearchLimits(max_depth=12, max_nodes=20_000, timeout=timeout, max_paths=16)
    mini = Search([None] * len(wanted), wanted, limits, None, light=True)
    names: dict[str, str] = {}
    try:
        mini.run()
        for t, kid in enumerate(ids):
            name = _key_name([r for r in mini.holders if r.target == t])
            if name is not None:
                names[str(kid)] = name
    finally:
        mini.release()
    return names


def _key_name(raws: list[RawHolder]) -> str | None:
    """``<model.lin1.weight>``: the best global path among ``raws``, for naming a dict key.
    A module's parameter (``model.lin1.weight``) is preferred over an optimizer's list."""
    best: tuple[int, int, str] | None = None
    for raw in raws:
        if raw.root_kind != "global" or any(s.kind == "keyof" for s in raw.segs):
            continue
        if raw.via not in ("itself", "object"):
            continue
        path = write(raw, {}).text.removeprefix("__main__.")
        subscripts = any(s.kind in ("index", "key") for s in raw.segs[1:])
        score = (int(subscripts), len(path), path)
        if best is None or score < best:
            best = score
    return None if best is None else f"<{best[2]}>"


def _freeze(
    raw: RawHolder, key: StorageKey | None, nbytes: int | None, key_names: dict[str, str]
) -> Holder:
    route = write(raw, key_names, in_ipython="IPython" in sys.modules)
    return Holder(route, raw.root, raw.via, nbytes, _device_text(key), raw.caller, raw.count)


# --------------------------------------------------------------------------- graph holders


@dataclass(frozen=True, slots=True)
class GraphHolder(Presented):
    """A container (or variable) holding tensors that still carry autograd graphs."""

    #: Path of the container, e.g. ``__main__.loss_history`` (or of the variable itself).
    container: str
    #: ``global``, ``class``, ``frame``, ``traceback``, ``ipython``, ...
    root_kind: str
    #: Tensors with a ``grad_fn`` it holds.
    tensors: int
    #: Bytes of storages saved in their graphs that no graph-free tensor (parameter, input,
    #: detached copy) also holds: what dropping these tensors would free.
    graph_bytes: int
    #: Bytes of the tensors' own storages.
    tensor_bytes: int
    devices: tuple[str, ...]
    #: One of the tensors' paths, e.g. ``__main__.loss_history[3]``.
    example: str

    @property
    def total_bytes(self) -> int:
        """``graph_bytes + tensor_bytes``."""
        return self.graph_bytes + self.tensor_bytes


@dataclass(frozen=True, slots=True)
class GraphHolders(ItemSequence[GraphHolder], Presented):
    """Result of ``find_graph_holders``, largest ``graph_bytes`` first."""

    json_properties: ClassVar[tuple[str, ...]] = ("graph_bytes",)

    holders: tuple[GraphHolder, ...]
    #: Live tensors with a ``grad_fn`` found (searched or not).
    tensors: int
    #: Bounds that cut the search short and other caveats.
    notes: tuple[str, ...] = ()
    elapsed: float = 0.0

    def _items(self) -> tuple[GraphHolder, ...]:
        """The holders."""
        return self.holders

    @property
    def graph_bytes(self) -> int:
        """Sum over containers (a graph shared by two containers counts in each)."""
        return sum(h.graph_bytes for h in self.holders)


class _Group:
    __slots__ = ("example", "owners", "root_kind")

    def __init__(self, root_kind: str, example: str) -> None:
        self.root_kind = root_kind
        self.example = example
        self.owners: list[Any] = []


def find_graph_holders(
    *,
    device: str | None = None,
    max_tensors: int = 256,
    timeout: float = 30.0,
) -> GraphHolders:
    """Containers that hold tensors still carrying autograd graphs, with the bytes those
    graphs keep alive: the check to run when memory grows every step.

    Seed 000's ``loss_history.append(loss)`` shows up as ``__main__.loss_history``: 10
    tensors, 40 MiB of saved ``sigmoid`` results. Uses cudamem's census of live tensors and
    autograd graphs (no user code runs, saved-tensor hooks are not triggered, nothing found
    is kept alive) and ``cudamem.who_holds``'s search to name the containers.

    Args:
        device: only count storages on this device (``'cuda:0'``, ``'cpu'``); default all.
        max_tensors: most graph-carrying tensors whose holders are searched (the rest are
            counted in ``tensors`` and noted).
        timeout: seconds before the search stops (with a note).

    Returns:
        ``GraphHolders``, largest ``graph_bytes`` first; ``print()`` it (JSON:
        ``render.json.to_json()``).
        Graph bytes exclude leaves (parameters, inputs) and anything a graph-free tensor
        also holds; a graph shared by two containers counts in each.
    """
    t0 = time.perf_counter()
    device = _check_graph_args(device, max_tensors, timeout)
    notes: list[str] = []
    groups: dict[str, _Group] = {}
    with warnings.catch_warnings():
        # Reading .grad of non-leaf tensors warns inside the census; nothing to tell the user.
        warnings.simplefilter("ignore", UserWarning)
        tensors = _autograd.all_tensors()
        owners: list[Any] = []
        plain: set[tuple[str, int, int]] = set()  # storages of graph-free tensors
        for t in tensors:
            if _autograd.grad_fn_of(t) is not None:
                owners.append(t)
            else:
                info = _autograd.storage_of(t)
                if info is not None:
                    plain.add(info[0])
        del tensors
        total = len(owners)
        if total > max_tensors:
            notes.append(
                f"searched holders of {max_tensors} of {plural(total, 'tensor')} with graphs"
            )
        try:
            # One search for every tensor with a graph (a single backwards pass over the heap).
            # The targets travel in one list that find_holders empties as it starts, and are
            # kept here only weakly: a list of ours holding them would be named as a holder.
            targets = owners[:max_tensors]
            refs = [weakref.ref(t) for t in targets]
            owners.clear()
            limits = SearchLimits(timeout=max(timeout - (time.perf_counter() - t0), 0.1))
            found_all = find_holders(targets, limits, None)
            for ref, found in zip(refs, found_all, strict=True):
                owner = ref()
                if owner is None:
                    continue
                for h in found:
                    if h.via != "itself" or h.route.held != h.route.steps:
                        continue  # an alias, or a tensor inside another graph
                    name = h.route.container
                    group = groups.get(name)
                    if group is None:
                        group = groups[name] = _Group(h.root_kind, h.path)
                    if not any(o is owner for o in group.owners):
                        group.owners.append(owner)
                del owner
                if found.stopped == "timeout":
                    notes.append("the holder search timed out: some containers may be missing")
                    break
            results = [_measure(name, g, plain, device) for name, g in groups.items()]
        finally:
            owners.clear()
            for g in groups.values():
                g.owners.clear()
    kept = [r for r in results if r is not None]
    kept.sort(key=lambda r: (-r.graph_bytes, -r.tensors, r.container))
    return GraphHolders(tuple(kept), total, tuple(notes), time.perf_counter() - t0)


def _check_graph_args(device: Any, max_tensors: Any, timeout: Any) -> str | None:
    if device is not None and not isinstance(device, str):
        raise TypeError(
            f"device must be a str such as 'cuda:0' or 'cpu', not {type(device).__name__}"
        )
    check_int("max_tensors", max_tensors, minimum=1)
    check_seconds("timeout", timeout)
    return device


def _measure(
    name: str, group: _Group, plain: set[tuple[str, int, int]], device: str | None
) -> GraphHolder | None:
    own: dict[tuple[str, int, int], int] = {}
    for t in group.owners:
        info = _autograd.storage_of(t)
        if info is not None and (device is None or _autograd.key_device(info[0]) == device):
            own[info[0]] = info[1]
    walk = _autograd.walk_graphs(group.owners)
    saved: dict[tuple[str, int, int], int] = {}
    for _owner, _chain, key, nbytes, label in walk.saved:
        if label == "variable" or key in plain or key in own:
            continue  # leaves and tensors held anyway are not what the graph keeps alive
        if device is None or _autograd.key_device(key) == device:
            saved[key] = max(nbytes, saved.get(key, 0))
    if device is not None and not own and not saved:
        return None
    devices = sorted({_autograd.key_device(k) for k in (*own, *saved)})
    return GraphHolder(
        container=name,
        root_kind=group.root_kind,
        tensors=len(group.owners),
        graph_bytes=sum(saved.values()),
        tensor_bytes=sum(own.values()),
        devices=tuple(devices),
        example=group.example,
    )
