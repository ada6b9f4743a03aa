"""Reading paths off the graph a holder search recorded, grouped by shape.

The search (``cudamem.holders._search``) records, for every object it reached, which objects it
refers to and how (``parent id -> child id -> Ref``). Reading walks down from each root, BFS,
to the objects that hold a target storage. Paths are *grouped*: a step that holds one object
many times (``[t] * 3000``) and sibling paths that differ only in list indices or int dict
keys (60,000 dicts in one list that each hold the tensor) become one group with a count and,
where the indices run without gaps, a range (``log[0..2999]``). Each holding object gets one
path per shape of the container that holds it, the shortest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._naming import Ref, Seg, resolve_lazy
from .holder_path import HolderPath, Step

__all__ = ["Group", "Path", "PathReader", "RawHolder", "write"]


@dataclass
class RawHolder:
    """One group of root-to-target paths, before it is frozen into a
    ``cudamem.holders.finder.Holder``."""

    target: int  # index of the target storage
    root_kind: str
    root: str
    refs: list[Ref]  # the first path of the group, one Ref per step
    via: str  # how ``last`` holds the storage: itself/view/alias/saved/grad/numpy/object
    caller: bool = False
    #: References the group stands for (paths times the references on each step).
    count: int = 1
    #: Step index -> subscript written for it (``0..2999`` or ``*``) where the group varies.
    subs: dict[int, str] = field(default_factory=dict)

    @property
    def segs(self) -> list[Seg]:
        """The first path's steps."""
        return [r.seg for r in self.refs]


class Path(NamedTuple):
    """Paths of one shape from a walk's start down to one object holding a target."""

    target: int
    refs: list[Ref]  # the first path, one Ref per step
    via: str
    ids: list[int]  # the objects along the first path, start first
    #: References of this shape (parallel paths through sibling items, times each step's).
    times: int
    #: Step -> (lowest, highest) list index or int key seen there, where steps are indices.
    ranges: dict[int, tuple[int, int]]
    #: Steps that vary in a way no range can write (several dict keys, scattered indices).
    stars: set[int]


class Group:
    """Paths of one target, root and shape (list indices aside), while they are read."""

    __slots__ = ("count", "first", "ranges", "rank", "stars")

    def __init__(
        self, first: RawHolder, rank: tuple[bool, bool, bool, int] = (False, False, False, 0)
    ) -> None:
        self.first = first
        #: How good a path it is when ``max_paths`` must cut (``_rank``; lower is better).
        self.rank = rank
        self.count = 0
        self.ranges: dict[int, tuple[int, int]] = {}
        self.stars: set[int] = set()

    def add(self, path: Path, offset: int) -> None:
        self.count += path.times
        _merge(self.ranges, path.ranges, offset)
        self.stars.update(i + offset for i in path.stars)

    def subs(self) -> dict[int, str]:
        """Subscripts for the steps that vary: ``lo..hi`` for one step that covers a
        contiguous range once per reference, ``*`` otherwise."""
        varying = set(self.stars)
        varying.update(i for i, (lo, hi) in self.ranges.items() if lo != hi)
        if len(varying) == 1:
            (i,) = varying
            if i not in self.stars:
                lo, hi = self.ranges[i]
                if hi - lo + 1 == self.count:
                    return {i: f"{lo}..{hi}"}
        return dict.fromkeys(varying, "*")


def _merge(into: dict[int, tuple[int, int]], new: dict[int, tuple[int, int]], offset: int) -> None:
    for i, (lo, hi) in new.items():
        old = into.get(i + offset)
        into[i + offset] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


class Mult:
    """References multiplied along a walk: a ``[t] * 3000`` step, or sibling paths merged."""

    __slots__ = ("owner", "ranges", "stars", "times")

    def __init__(self, owner: int) -> None:
        self.owner = owner  # the node that may change it; others share it read-only
        self.times = 1
        self.ranges: dict[int, tuple[int, int]] = {}
        self.stars: set[int] = set()

    @classmethod
    def copy(cls, base: Mult | None, owner: int) -> Mult:
        m = cls(owner)
        if base is not None:
            m.times, m.ranges, m.stars = base.times, dict(base.ranges), set(base.stars)
        return m

    @classmethod
    def step(cls, base: Mult | None, r: Ref, depth: int, owner: int) -> Mult:
        """``base`` followed by the step ``r`` at ``depth`` (its references multiply)."""
        m = cls.copy(base, owner)
        m.times *= r.times
        if r.times > 1:
            if _collapsible(r.segs[0]) and r.span is not None:
                _merge(m.ranges, {depth: r.span}, 0)
            else:
                m.stars.add(depth)
        elif _collapsible(r.segs[0]):
            v = int(r.segs[0].text)
            _merge(m.ranges, {depth: (v, v)}, 0)
        return m

    def absorb(self, other: Mult) -> None:
        self.times += other.times
        _merge(self.ranges, other.ranges, 0)
        self.stars.update(other.stars)


def _chain(prev: dict[int, tuple[int, Ref] | None], node: int) -> tuple[list[Ref], list[int]]:
    """The first path down to ``node``: its steps and the objects along it, root first."""
    refs: list[Ref] = []
    ids = [node]
    while True:
        step = prev[node]
        if step is None:
            break
        refs.append(step[1])
        node = step[0]
        ids.append(node)
    refs.reverse()
    ids.reverse()
    return refs, ids


def _through(prev: dict[int, tuple[int, Ref] | None], node: int, x: int) -> bool:
    """Whether the first path down to ``node`` passes through ``x``."""
    while True:
        if node == x:
            return True
        step = prev[node]
        if step is None:
            return False
        node = step[0]


def _chain_ranges(
    prev: dict[int, tuple[int, Ref] | None], node: int, into: dict[int, tuple[int, int]]
) -> None:
    """Add the single list indices on the first path down to ``node`` to ``into``."""
    for depth, r in enumerate(_chain(prev, node)[0]):
        if r.times == 1 and _collapsible(r.segs[0]):
            v = int(r.segs[0].text)
            _merge(into, {depth: (v, v)}, 0)


def _collapsible(seg: Seg) -> bool:
    """List indices and int dict keys: what varies between items of one container."""
    if seg.kind == "index":
        return True
    text = seg.text[1:] if seg.text.startswith("-") else seg.text
    return seg.kind == "key" and not seg.extra and text.isdigit()


def _shape(seg: Seg) -> tuple[str, str, str]:
    return (seg.kind, "*" if _collapsible(seg) else seg.text, seg.extra)


#: A walk down the recorded edges, run by ``PathReader._drive`` (see ``PathReader._walk``).
_Walk = Generator[int, bool | None, list[Path]]
#: Funnel walks waiting on each other, at most, before a walk goes on without funnels.
_NESTED = 256

#: Holders no root explains (``cudamem.holders._search``): kept only while there is room.
_UNROOTED = frozenset({"unknown", "cycle", "partial"})


def _rank(kind: str, refs: list[Ref], caller: bool) -> tuple[bool, bool, bool, int]:
    """Which paths ``max_paths`` keeps first (lower first): rooted before unrooted, direct
    holders before paths through an autograd graph, then the shorter; the caller's own
    reference (which the caller knows of) last."""
    graph = any(seg.kind == "autograd" for r in refs for seg in r.segs)
    return (caller, kind in _UNROOTED, graph, len(refs))


class PathReader:
    """Walks down the recorded edges of one search (see the module notes)."""

    def __init__(
        self,
        edges: dict[int, dict[int, Ref]],
        nodes: dict[int, Any],
        start: dict[int, list[tuple[int, Seg, str]]],
        max_paths: int,
        late: Callable[[], bool],
    ) -> None:
        self.edges = edges
        self.nodes = nodes
        self.start = start  # object id -> (target, storage seg, via) for each target it holds
        self.max_paths = max_paths
        self.late = late  # whether the time for reading is up
        #: Whether a group was left out for ``max_paths``.
        self.cut = False
        #: ``walk_down``'s answers by start: many roots lead to one object (every test
        #: module's ``cudamem`` global), and its walk is the same each time.
        self._walked: dict[int, list[Path]] = {}
        #: The objects a walk from a funnel reached (see ``_funnel``), by funnel: those it
        #: reached itself (the funnel left out), and the funnel below whose walk it took
        #: over (whose objects it reached too).
        self._reached: dict[int, tuple[set[int], int | None]] = {}
        self._walking: set[int] = set()
        #: Funnel walks that may wait on each other (``_drive``); 0: no funnels.
        self.nested = _NESTED
        #: ``add``'s worst kept group of a full ``per`` (by ``id``): key and rank.
        self._worst: dict[int, tuple[tuple[Any, ...], tuple[bool, bool, bool, int]]] = {}

    def add(
        self,
        per: dict[tuple[Any, ...], Group],
        kind: str,
        root: str,
        head: list[Ref],
        path: Path,
        caller: bool,
    ) -> None:
        """Count ``path`` (below ``head``, the root's own steps) into its group in ``per``.

        At most ``max_paths`` groups: past that, a new group replaces the worst kept one
        when it ranks better (``_rank``: rooted first, direct before through an autograd
        graph, then shorter, the caller's own reference last), so the paths cut are the longest ones
        through graphs, not the frame or variable that holds the object itself, whichever
        order the roots are read in."""
        refs = head + path.refs
        key = (kind, root, path.via, caller, tuple(_shape(r.seg) for r in refs))
        group = per.get(key)
        if group is None:
            rank = _rank(kind, refs, caller)
            if len(per) >= self.max_paths:
                self.cut = True
                # The worst kept group (the first of equal ranks), known until ``per`` changes.
                worst = self._worst.get(id(per))
                if worst is None:
                    k = max(per, key=lambda k: per[k].rank)
                    worst = self._worst[id(per)] = (k, per[k].rank)
                if worst[1] <= rank:
                    return
                del per[worst[0]]
                del self._worst[id(per)]
            raw = RawHolder(path.target, kind, root, refs, path.via, caller)
            group = per[key] = Group(raw, rank)
        group.add(path, len(head))

    def walk_down(self, oid: int) -> list[Path]:
        """Shortest paths down from ``oid`` to the objects holding a target storage (BFS over
        the recorded edges): for each such object, one ``Path`` per shape of the last
        step's container (``log[i]``, ``rows[i]['t']``), sibling paths of that shape (60,000
        dicts in one list that each hold the object) counted into it. Read-only results,
        computed once per start."""
        walked = self._walked.get(oid)
        if walked is None:
            walked = self._walked[oid] = self._drive(oid)
        return walked

    def _drive(self, oid: int) -> list[Path]:
        """The walk from ``oid`` and the funnel walks it waits on (``_walk`` asks for them),
        run from an explicit stack, not the C stack: a walk down a 100,000-deep chain
        narrows at every level. Past ``nested`` walks waiting on each other the nested ones
        are dropped and the walk from ``oid`` goes on without funnels (its own BFS: the same
        paths, unshared), so a deep chain costs one walk down it, not one per level."""
        stack: list[tuple[int, _Walk, list[Any]]] = [(oid, self._walk(oid), [])]
        send: bool | None = None  # what the waiting walk's ``yield`` gets
        try:
            while True:
                f, gen, found = stack[-1]
                try:
                    ask = gen.send(send)
                except StopIteration as stop:
                    paths: list[Path] = stop.value
                    stack.pop()
                    if not stack:
                        return paths
                    self._walking.discard(f)
                    self._reached[f] = (found[0], found[1])
                    self._walked.setdefault(f, paths)
                    send = True
                    continue
                if ask in self._walking:
                    send = False  # a cycle: the walk from ``ask`` is one under way
                elif len(stack) > self.nested:
                    for g, waiting, _ in stack[1:]:
                        self._walking.discard(g)
                        waiting.close()
                    del stack[1:]
                    send = None
                else:
                    self._walking.add(ask)
                    found = []
                    stack.append((ask, self._walk(ask, found), found))
                    send = None  # starts it
        finally:
            for g, _, _ in stack[1:]:
                self._walking.discard(g)

    def _walk(self, oid: int, reached: list[Any] | None = None) -> _Walk:
        """``walk_down``'s BFS; ``reached`` receives what ``_reached`` keeps for ``oid``.

        Where the walk narrows to one object (the queue holds only it, as every module's
        ``__spec__`` narrows to its loader, pytest's assertion rewriter, that reaches the
        whole test session), the rest of the walk is that object's own walk below the path
        down to it, when nothing reached before lies below it: that walk is done once and
        shared by every start that narrows to it (``_funnel``).

        A generator run by ``_drive``: where the walk from a funnel is still to be done, it
        yields the funnel and gets back ``True`` once that walk is done, ``False`` where it
        cannot stand for the rest (a cycle: that walk is under way), ``None`` where no
        funnel can (too many walks wait on each other: this one goes on alone)."""
        prev: dict[int, tuple[int, Ref] | None] = {oid: None}
        level = {oid: 0}
        sig = {oid: 0}
        mult: dict[int, Mult] = {}  # only where references multiply or paths merge
        shapes: dict[Seg, int] = {}
        incoming: dict[int, list[tuple[int, Ref, int]]] = {}  # holder -> (parent, ref, sig)
        holders: list[int] = []
        edges, nodes, start = self.edges, self.nodes, self.start
        queue = deque([oid])
        n = 0
        rest: list[Path] = []  # the paths below a funnel, when the walk narrowed to one
        funnels = True
        while queue:
            n += 1
            if not n & 0x3FF and self.late():
                break
            cur = queue.popleft()
            if cur in start:
                holders.append(cur)
            elif not queue and cur != oid and funnels and cur in edges:
                done = cur in self._reached or (yield cur)
                below_funnel = self._funnel(cur, prev, oid) if done else None
                if done is None:
                    funnels = False
                elif below_funnel is not None:
                    rest = self._shifted(below_funnel, prev, cur, level[cur], mult.get(cur))
                    if reached is not None:
                        reached[:] = [set(prev), cur]
                        reached[0].discard(oid)
                    break
            below = edges.get(cur)
            if below is None:
                continue
            depth, s_cur, m_cur = level[cur], sig[cur], mult.get(cur)
            for cid, r in below.items():
                if cid not in nodes:
                    continue
                seg = r.segs[0]
                if seg.kind == "lazy":
                    r = below[cid] = self._resolve(cur, cid, r)
                    seg = r.segs[0]
                elif seg.kind == "framelocals":
                    continue  # the frame names those values itself
                shape = shapes.get(seg)
                if shape is None:
                    shape = shapes[seg] = hash(_shape(seg))
                csig = hash((s_cur, shape))
                if cid in start:
                    incoming.setdefault(cid, []).append((cur, r, csig))
                if cid not in prev:
                    prev[cid] = (cur, r)
                    level[cid] = depth + 1
                    sig[cid] = csig
                    queue.append(cid)
                    if r.times > 1:
                        mult[cid] = Mult.step(m_cur, r, depth, cid)
                    elif m_cur is not None:
                        mult[cid] = m_cur
                elif level[cid] == depth + 1 and sig[cid] == csig and cid not in start:
                    # Another parent of the same shape: its paths are counted in.
                    mine = mult.get(cid)
                    if mine is None or mine.owner != cid:
                        mine = Mult.copy(mine, cid)
                        _chain_ranges(prev, cid, mine.ranges)
                        mult[cid] = mine
                    other = Mult.step(m_cur, r, depth, cid)
                    _chain_ranges(prev, cur, other.ranges)
                    mine.absorb(other)
        out: list[Path] = []
        for x in holders:
            if x == oid:
                out.extend(self._emit(x, [], [x], None))
                continue
            groups: dict[int, tuple[int, Ref, Mult]] = {}
            for k, (parent, r, csig) in enumerate(incoming.get(x, ())):
                if not k & 0x3FF and k and self.late():
                    break  # the references counted so far stand
                if level[parent] >= level[x] and _through(prev, parent, x):
                    continue  # a path through the holder itself (a cycle back to it)
                m = Mult.step(mult.get(parent), r, level[parent], x)
                _chain_ranges(prev, parent, m.ranges)
                group = groups.get(csig)
                if group is not None:
                    group[2].absorb(m)
                elif len(groups) < self.max_paths:
                    groups[csig] = (parent, r, m)
            for parent, r, m in groups.values():
                refs, ids = _chain(prev, parent)
                out.extend(self._emit(x, [*refs, r], [*ids, x], m))
        out.extend(rest)
        if reached is not None and not reached:
            reached[:] = [set(prev), None]
            reached[0].discard(oid)
        return out

    def _funnel(
        self, f: int, prev: dict[int, tuple[int, Ref] | None], oid: int
    ) -> list[Path] | None:
        """The walk from ``f`` (done), where it can stand for the rest of the walk from
        ``oid`` that narrowed to ``f`` (``prev``: what that walk reached so far): nothing it
        reaches was reached before, so every object below ``f`` gets the same first path
        and the same parents of its shape as in one long walk. (The start itself may be
        reached again when ``f`` is its only child and it holds no target: it then adds
        nothing below ``f``, as objects often refer back to what refers to them.) ``None``
        where that is not so, or the time is up."""
        keys = prev.keys()
        back = len(self.edges.get(oid, ())) == 1 and oid not in self.start
        below: int | None = f
        k = 0
        while below is not None:  # the objects reached below ``f``, funnel by funnel
            k += 1
            if not k & 0x3FF and self.late():
                return None
            own, below = self._reached[below]
            if keys.isdisjoint(own):
                continue
            overlap = own.intersection(keys)
            overlap.discard(f)  # ``f`` itself, reached again from below: nothing new
            if overlap and (not back or overlap != {oid}):
                return None
        return self._walked[f]

    @staticmethod
    def _shifted(
        paths: list[Path],
        prev: dict[int, tuple[int, Ref] | None],
        f: int,
        depth: int,
        m: Mult | None,
    ) -> list[Path]:
        """``f``'s paths as paths of a walk that reached ``f`` at ``depth`` by its first path
        (``prev``) with the references ``m`` (``None``: once, no indices varying)."""
        head_refs, head_ids = _chain(prev, f)
        ranges: dict[int, tuple[int, int]] = {}
        times, stars = 1, set[int]()
        if m is not None:
            _merge(ranges, m.ranges, 0)
            times, stars = m.times, set(m.stars)
        _chain_ranges(prev, f, ranges)
        out = []
        for p in paths:
            own = dict(ranges)
            _merge(own, p.ranges, depth)
            out.append(
                Path(
                    p.target,
                    [*head_refs, *p.refs],
                    p.via,
                    [*head_ids, *p.ids[1:]],
                    times * p.times,
                    own,
                    stars | {i + depth for i in p.stars},
                )
            )
        return out

    def _resolve(self, parent: int, child: int, r: Ref) -> Ref:
        """Name an instance attribute edge now that the climb is over."""
        p, c = self.nodes.get(parent), self.nodes.get(child)
        seg = resolve_lazy(p, c, r.segs[0]) if p is not None else Seg("via", "object")
        return Ref((seg,), r.times, r.span)

    def _emit(self, x: int, refs: list[Ref], ids: list[int], m: Mult | None) -> list[Path]:
        """One path per target the object ``x`` holds."""
        ranges: dict[int, tuple[int, int]] = {}
        times, stars = 1, set()
        if m is not None:
            ranges, times, stars = m.ranges, m.times, m.stars
        return [
            Path(target, [*refs, Ref((seg,))], via, ids, times, ranges, stars)
            for target, seg, via in self.start[x]
        ]


# --------------------------------------------------------------------------- writing

_IPYTHON_NAMES = ("Out", "_oh", "_", "__", "___")
_TRACEBACK_NAMES = ("last_traceback", "last_exc", "last_value")
_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules")
_INT_TEXT = frozenset("-0123456789")


def write(raw: RawHolder, key_names: dict[str, str], *, in_ipython: bool = False) -> HolderPath:
    """``raw`` as a ``HolderPath``: each step in Python syntax (see ``Seg``); dict keys that
    are objects named by ``key_names``; the steps where the group's paths differ marked
    with their range or ``*``. A path from ``sys.last_traceback`` (and the like) has the
    root kind ``traceback``, one from IPython's output history (``in_ipython``)
    ``ipython``."""
    kind, root, segs = raw.root_kind, raw.root, raw.segs
    if kind == "global" and segs and segs[0].kind == "key":
        name = _unquote(segs[0].text)
        if root == "sys" and name in _TRACEBACK_NAMES:
            kind = "traceback"
        elif root == "__main__" and name in _IPYTHON_NAMES and in_ipython:
            kind = "ipython"
    steps = _steps(kind, root, segs, key_names, raw.subs if raw.count > 1 else {})
    return HolderPath(kind, steps)


def _unquote(text: str) -> str | None:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        inner = text[1:-1]
        return inner if inner.isidentifier() else None
    return None


def _int_of(text: str) -> int | None:
    body = text[1:] if text.startswith("-") else text
    return int(text) if body.isdigit() and set(text) <= _INT_TEXT else None


def _steps(
    kind: str, root: str, segs: list[Seg], key_names: dict[str, str], subs: dict[int, str]
) -> tuple[Step, ...]:
    out: list[Step] = []
    i = 0
    if kind in ("global", "traceback", "ipython") and segs and segs[0].kind == "key":
        name = _unquote(segs[0].text)
        if kind == "ipython":
            head = name if name is not None else f"vars({root})[{segs[0].text}]"
        else:
            head = f"{root}.{name}" if name is not None else f"vars({root})[{segs[0].text}]"
        out.append(Step("root", head))
        i = 1
    elif kind == "frame" and segs and segs[0].kind == "local":
        out.append(Step("root", _local(segs[0], segs[1:])))
        i = 1
    else:
        out.append(Step("root", root))
    while i < len(segs):
        seg = segs[i]
        nxt = segs[i + 1] if i + 1 < len(segs) else None
        after = segs[i + 2] if i + 2 < len(segs) else None
        if seg.kind == "dictattrs":
            name = _unquote(nxt.text) if nxt is not None and nxt.kind == "key" else None
            if name is None:
                out.append(Step("attr", ".__dict__"))
                i += 1
                continue
            child: str | None = None
            if after is not None and after.kind == "key":
                child = after.text.strip("'")
                child = child if child.isdigit() else _unquote(after.text)
            if seg.extra == "m" and name in _MODULE_CONTAINERS and child is not None:
                out.append(_module_child(child))  # model._parameters['w'] -> model.w
                i += 3
                continue
            out.append(Step("attr", f".{name}"))
            i += 2
            continue
        if seg.kind == "closure":
            if nxt is not None and nxt.kind == "index":
                names = seg.text.split(",")
                idx = int(nxt.text)
                var = names[idx] if idx < len(names) else nxt.text
                out.append(Step("closure", f" (closure '{var}')"))
                i += 3 if after is not None and after.text == "cell_contents" else 2
                continue
            out.append(Step("attr", ".__closure__"))
        elif seg.kind == "local":
            if nxt is not None and nxt.kind == "attr" and nxt.text == "cell_contents":
                i += 1  # the frame's cell for a variable its inner functions share
            out.append(Step("frame", " → " + _local(seg, segs[i + 1 :])))
        elif seg.kind == "self":
            out.append(Step("self", f" → {seg.text}"))  # the object a bound method is bound to
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
            out.append(Step("attr", f".{seg.text}"))
        elif seg.kind in ("key", "index"):
            text = key_names.get(seg.extra, seg.text) if seg.extra else seg.text
            object_key = seg.kind == "key" and bool(seg.extra)  # a key named by type or path
            out.append(Step(seg.kind, f"[{text}]", _int_of(text), subs.get(i), object_key))
        elif seg.kind == "member":
            out.append(Step("member", " (set member)"))
        elif seg.kind == "keyof":
            out.append(Step("keyof", " (dict key)"))
        elif seg.kind == "autograd":
            out.append(Step("graph", f" → {seg.text}"))
        elif seg.kind == "via":
            out.append(Step("object", f" → <{seg.text}>"))
        # storage / tbframe: nothing to write
        i += 1
    return tuple(out)


def _module_child(name: str) -> Step:
    """``.lin1`` for a named child, ``[0]`` for ``Sequential``/``ModuleList`` entries."""
    return Step("index", f"[{name}]", int(name)) if name.isdigit() else Step("attr", f".{name}")


def _local(seg: Seg, rest: list[Seg]) -> str:
    more = any(s.kind not in ("storage", "tbframe") for s in rest)
    return f"{seg.extra}: {seg.text}" if more else f"{seg.extra}: local '{seg.text}'"
