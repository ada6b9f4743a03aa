"""``who_holds()``: every path that keeps a tensor's memory alive.

What keeps memory alive is a storage, so a tensor's holders are the holders of every tensor
sharing its storage (views, ``detach()``, ``.data``, tensors saved by autograd). Paths read as
Python from a root: ``__main__.loss_history[3]``, ``Cache.store['a']``,
``train.py:42 in step(): local 'batch'``, ``__main__.model.lin1.weight``,
``__main__.loss_history[3] → grad_fn MeanBackward0 → SigmoidBackward0 saved result``.

The search never calls user code, keeps nothing alive after it returns (results hold only
strings and ints), and is bounded in depth, objects and time; see :mod:`cudamem._search`.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

from . import _autograd
from ._autograd import StorageKey
from ._frames import own_frame
from ._naming import Seg, is_sub
from ._search import RawHolder, Search, SearchLimits
from ._sequence import ItemSequence

__all__ = ["Holder", "Holders", "who_holds"]

_IPYTHON_NAMES = ("Out", "_oh", "_", "__", "___")
_TRACEBACK_NAMES = ("last_traceback", "last_exc", "last_value")
_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True, slots=True)
class Holder:
    """One path from a root that keeps the queried memory alive."""

    #: Python-like path from the root, e.g. ``__main__.trainer.outputs['val'][2]``.
    path: str
    #: ``global``, ``class``, ``frame``, ``traceback``, ``ipython``, ``cycle`` or ``unknown``.
    root_kind: str
    #: The root: a module name, a class, a frame (``train.py:42 in step()``), ...
    root: str
    #: ``itself``, ``view``, ``alias``, ``saved``, ``grad`` or ``object``.
    via: str
    #: Bytes of the storage held (``None`` for non-tensor objects).
    nbytes: int | None
    #: ``cpu``, ``cuda:0``, ... (``None`` for non-tensor objects).
    device: str | None
    #: The caller's own reference to the argument of ``who_holds``.
    caller: bool = False

    @property
    def is_alias(self) -> bool:
        """Whether the path ends at another tensor sharing the storage."""
        return self.via not in ("itself", "object")

    def __str__(self) -> str:
        from .render.holders import render_holder

        return render_holder(self)


@dataclass(frozen=True, slots=True)
class Holders(ItemSequence[Holder]):
    """The holders of one object: a read-only sequence of :class:`Holder`."""

    #: What was asked about, e.g. ``Tensor float32[1024, 1024] on cuda:0``.
    target: str
    nbytes: int | None
    device: str | None
    holders: tuple[Holder, ...]
    #: Bounds that cut the search short, nodes not inspected, other caveats.
    notes: tuple[str, ...] = ()
    elapsed: float = 0.0

    def _items(self) -> tuple[Holder, ...]:
        """The holders."""
        return self.holders

    @property
    def paths(self) -> list[str]:
        """Every holder's path, in order."""
        return [h.path for h in self.holders]

    def __str__(self) -> str:
        from .render.holders import render_holders

        return render_holders(self)

    def _repr_html_(self) -> str:
        from .render.notebook import holders_html

        return holders_html(self)


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
        obj: a tensor or parameter (its storage is what is held: views, ``detach()`` and
            tensors saved by autograd count), or any other object (matched by identity).
        max_depth: most references followed from ``obj`` towards a root.
        max_nodes: most objects explored.
        timeout: seconds before the search stops (with a note).
        max_paths: most paths reported.

    Returns:
        :class:`Holders`, a sequence of :class:`Holder` (``print()`` it; JSON:
        ``render.json.to_json()``). The caller's own reference to ``obj`` is shown once,
        marked as the caller's.
    """
    limits = SearchLimits(max_depth, max_nodes, timeout, max_paths)
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
) -> list[Holders]:
    """Holders of several objects (or storage keys) in one search."""
    import time

    t0 = time.perf_counter()
    if keys is None:
        keys, nbytes = [], []
        for o in objs:
            info = _autograd.storage_of(o) if is_sub(type(o), torch.Tensor) else None
            keys.append(None if info is None else info[0])
            nbytes.append(None if info is None else info[1])
    assert nbytes is not None
    search = Search(keys, objs, limits, caller)
    try:
        search.run()
        key_names = _name_odd_keys(search)
        per: list[list[Holder]] = [[] for _ in keys]
        for raw in search.holders:
            per[raw.target].append(_freeze(raw, keys[raw.target], nbytes[raw.target], key_names))
        notes = list(dict.fromkeys(search.notes))
        for _owner, chain in search.not_inspected:
            notes.append(f"not inspected: {chain} (saved-tensor hooks, e.g. checkpointing)")
        targets = labels if labels is not None else [_describe(o) for o in objs]
    finally:
        search.release()
    elapsed = time.perf_counter() - t0
    out = []
    for i, key in enumerate(keys):
        device = None if key is None else _autograd.key_device(key)
        holders = _order(_dedupe_caller(per[i]))
        out.append(Holders(targets[i], nbytes[i], device, tuple(holders), tuple(notes), elapsed))
    return out


def _describe(obj: Any) -> str:
    from ._naming import type_name

    tp = type(obj)
    if is_sub(tp, torch.Tensor):
        dtype, shape, _ = _autograd.describe_tensor(obj)
        info = _autograd.storage_of(obj)
        where = f" on {_autograd.key_device(info[0])}" if info is not None else ""
        return f"{type_name(tp)} {dtype}[{', '.join(map(str, shape))}]{where}"
    return f"{type_name(tp)} object"


def _order(holders: list[Holder]) -> list[Holder]:
    rank = {"global": 0, "ipython": 0, "class": 1, "frame": 2, "traceback": 3}

    def key(h: Holder) -> tuple[int, int, int, int]:
        main = 0 if h.root == "__main__" else 1
        return (int(h.caller), rank.get(h.root_kind, 4), main, len(h.path))

    return sorted(holders, key=key)


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


def _name_odd_keys(search: Search) -> dict[str, str]:
    """Name dict keys that are objects (``optimizer.state[<model.lin1.weight>]``) by a path."""
    names: dict[str, str] = {}
    wanted = [(i, o) for i, o in list(search.odd_keys.items())[:8] if is_sub(type(o), torch.Tensor)]
    if not wanted:
        return names
    limits = SearchLimits(max_depth=12, max_nodes=20_000, timeout=2.0, max_paths=16)
    mini = Search([None] * len(wanted), [o for _, o in wanted], limits, None, light=True)
    try:
        mini.run()
        best: dict[int, tuple[int, str]] = {}
        for raw in mini.holders:
            if raw.root_kind != "global" or any(s.kind == "keyof" for s in raw.segs):
                continue
            path = _join(raw.root_kind, raw.root, raw.segs, {})
            if path.startswith("__main__."):
                path = path[len("__main__.") :]
            # Prefer a module's parameter (``model.lin1.weight``) over an optimizer's list.
            score = (
                0 if not any(s.kind in ("index", "key") for s in raw.segs[1:]) else 1,
                len(path),
            )
            prev = best.get(raw.target)
            if prev is None or score < (prev[0], len(prev[1])):
                best[raw.target] = (score[0], path)
        for t, (_, path) in best.items():
            names[str(wanted[t][0])] = f"<{path}>"
    finally:
        mini.release()
    return names


def _freeze(
    raw: RawHolder, key: StorageKey | None, nbytes: int | None, key_names: dict[str, str]
) -> Holder:
    kind, root = raw.root_kind, raw.root
    segs = raw.segs
    if kind == "global" and segs and segs[0].kind == "key":
        name = _unquote(segs[0].text)
        if root == "sys" and name in _TRACEBACK_NAMES:
            kind = "traceback"
        elif root == "__main__" and name in _IPYTHON_NAMES and "IPython" in sys.modules:
            kind = "ipython"
    path = _join(kind, root, segs, key_names)
    if kind == "ipython" and path.startswith("__main__."):
        path = path[len("__main__.") :]
    raw.last = None
    device = None if key is None else _autograd.key_device(key)
    return Holder(path, kind, root, raw.via, nbytes, device, raw.caller)


def _unquote(text: str) -> str | None:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        inner = text[1:-1]
        return inner if inner.isidentifier() else None
    return None


def _join(kind: str, root: str, segs: list[Seg], key_names: dict[str, str]) -> str:
    """Write a path: root, then each step in Python syntax (see :class:`Seg`)."""
    out: list[str] = []
    i = 0
    if kind in ("global", "traceback", "ipython") and segs and segs[0].kind == "key":
        name = _unquote(segs[0].text)
        out.append(f"{root}.{name}" if name is not None else f"vars({root})[{segs[0].text}]")
        i = 1
    elif kind == "frame" and segs and segs[0].kind == "local":
        out.append(_local(segs[0], segs[1:]))
        i = 1
    else:
        out.append(root)
    while i < len(segs):
        seg = segs[i]
        nxt = segs[i + 1] if i + 1 < len(segs) else None
        if seg.kind == "dictattrs":
            name = _unquote(nxt.text) if nxt is not None and nxt.kind == "key" else None
            after = segs[i + 2] if i + 2 < len(segs) else None
            if (
                seg.extra == "m"
                and name in _MODULE_CONTAINERS
                and after is not None
                and after.kind == "key"
                and after.text.strip("'").isdigit()
            ):
                out.append(_module_child(after.text.strip("'")))
                i += 3
                continue
            if name is None:
                out.append(".__dict__")
                i += 1
                continue
            after = segs[i + 2] if i + 2 < len(segs) else None
            inner = _unquote(after.text) if after is not None and after.kind == "key" else None
            if seg.extra == "m" and name in _MODULE_CONTAINERS and inner is not None:
                out.append(_module_child(inner))  # model._parameters['w'] -> model.w
                i += 3
                continue
            out.append(f".{name}")
            i += 2
            continue
        if seg.kind == "closure":
            if nxt is not None and nxt.kind == "index":
                names = seg.text.split(",")
                idx = int(nxt.text)
                var = names[idx] if idx < len(names) else nxt.text
                out.append(f" (closure '{var}')")
                skip = 2
                third = segs[i + 2] if i + 2 < len(segs) else None
                if third is not None and third.text == "cell_contents":
                    skip = 3
                i += skip
                continue
            out.append(".__closure__")
        elif seg.kind == "local":
            out.append(" → " + _local(seg, segs[i + 1 :]))
        elif seg.kind == "attr":
            inner = _unquote(nxt.text) if nxt is not None and nxt.kind == "key" else None
            if (
                seg.extra == "m"
                and seg.text in _MODULE_CONTAINERS
                and nxt is not None
                and (inner is not None or nxt.text.strip("'").isdigit())
            ):
                out.append(_module_child(inner or nxt.text.strip("'")))
                i += 2
                continue
            out.append(f".{seg.text}")
        elif seg.kind in ("key", "index"):
            text = key_names.get(seg.extra, seg.text) if seg.extra else seg.text
            out.append(f"[{text}]")
        elif seg.kind == "member":
            out.append(" (set member)")
        elif seg.kind == "keyof":
            out.append(" (dict key)")
        elif seg.kind in ("via", "autograd"):
            out.append(f" → {seg.text}" if seg.kind == "autograd" else f" → <{seg.text}>")
        # storage / tbframe: nothing to write
        i += 1
    return "".join(out)


def _module_child(name: str) -> str:
    """``.lin1`` for a named child, ``[0]`` for ``Sequential``/``ModuleList`` entries."""
    return f"[{name}]" if name.isdigit() else f".{name}"


def _local(seg: Seg, rest: list[Seg]) -> str:
    more = any(s.kind not in ("storage", "tbframe") for s in rest)
    return f"{seg.extra}: {seg.text}" if more else f"{seg.extra}: local '{seg.text}'"
