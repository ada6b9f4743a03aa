"""Which container is the culprit: the one rule for grouping holder paths.

Leak warnings, ``track(leaks=True)`` reports, OOM post-mortems, ``cudamem run`` and
``cudamem.find_graph_holders`` all turn holder paths into culprits with this module.

A holder path reads from a root:
``__main__.loss_history[3] → grad_fn MeanBackward0 → SigmoidBackward0 saved result``. Its
*first step* (before the first ``→``) is what Python holds. From that step:

* the **container** is the part before the first integer subscript, wherever it is (a
  list or tuple index, or an integer dict key): ``__main__.loss_history[3]`` →
  ``__main__.loss_history``; ``__main__.errors[2].__traceback__.tb_next`` →
  ``__main__.errors``; ``model.step_outputs[7]['preds']`` → ``model.step_outputs``. A step
  without one is its own container: a variable, an attribute, or a dict entry under a
  named key (``activations['fc1']``: a dict's named keys say different things, a list's
  indices do not);
* the **pattern** is the step with every integer subscript written ``[*]``:
  ``__main__.errors[*].__traceback__.tb_next``, ``model.step_outputs[*]['preds']``;
* the **item** is the container's entry: the step up to its first integer subscript
  (``__main__.errors[2]``).

A ``Culprit`` is one container with the number of its items and tensors that keep
memory and their total bytes, so that a list of a thousand losses is one line, never a
thousand lines that a cap on culprits would cut. Holders that no root explains (an object
gc sees no referrer of, such as a view's base tensor, which only the view's C++ side
holds: ``<Tensor object>``; or a reference cycle) never make culprits of their own: a
storage is attributed to a rooted holder when it has one, else to
``(no holder reachable from Python)``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ._present import present

__all__ = [
    "NO_HOLDER",
    "Culprit",
    "HeldStorage",
    "container_of",
    "first_step",
    "group_culprits",
    "item_of",
    "pattern_of",
    "through_graph",
]

#: The group of storages no rooted holder explains.
NO_HOLDER = "(no holder reachable from Python)"

_ARROW = re.compile(r"\s+(?:→|->)\s+")
_INT = re.compile(r"-?\d+")
#: ``train.py:42 in step(): `` (a frame's label, whose file name may contain brackets).
_FRAME_LABEL = re.compile(r"^.*?:\d+ in [^\s]*\(\)(?: \(suspended \w+\))?: ")
#: ``<Tensor object>``: the label of an object no root explains.
_UNROOTED = re.compile(r"^<[^<>\s]+ object>")
_UNROOTED_KINDS = ("unknown", "cycle", "partial")


class HeldStorage(Protocol):
    """What grouping reads of a storage: its bytes and its holders (each a path string or
    an object with ``path`` and ``root_kind``). ``cudamem.census.LiveStorage`` is one."""

    @property
    def nbytes(self) -> int: ...

    @property
    def holders(self) -> Iterable[object] | None: ...


@dataclass(frozen=True, slots=True)
class Culprit:
    """Storages grouped by the container that holds them (see ``cudamem.culprits``)."""

    #: The container: ``__main__.loss_history``, ``model.step_outputs``, a frame's local.
    holder: str
    #: Distinct holding paths (one per tensor held: ``loss_history[0]``, ``[1]``, ...).
    tensors: int
    storages: int
    nbytes: int
    #: Bytes of those held only through autograd graphs (saved tensors).
    autograd_bytes: int
    #: One full path, e.g. ``__main__.loss_history[3] → grad_fn MeanBackward0 → ...``.
    example: str
    #: Entries of the container that keep memory (``step_outputs[0]``, ``[1]``, ...).
    items: int = 0
    #: The paths inside the container, integer subscripts as ``[*]``, most bytes first:
    #: ``model.step_outputs[*]['preds']``.
    patterns: tuple[str, ...] = ()

    def __str__(self) -> str:
        return present(self)


# --------------------------------------------------------------------------- path rules


def first_step(path: str) -> str:
    """What Python holds: the path up to its first ``→`` (a graph edge, a frame)."""
    return _ARROW.split(path, maxsplit=1)[0].strip()


def through_graph(path: str) -> bool:
    """Whether a holder path reaches the storage through an autograd graph."""
    parts = _ARROW.split(path)
    return len(parts) > 1 and any("grad_fn" in p or "saved" in p for p in parts[1:])


def _brackets(step: str, start: int) -> Iterator[tuple[int, int]]:
    """``(open, close)`` of each outermost ``[...]`` of ``step`` from ``start``: quotes and
    nesting respected (a quoted name outside brackets, ``local 'x[0]'``, has none)."""
    depth, quote, opened, i = 0, "", -1, start
    while i < len(step):
        c = step[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "[":
            if depth == 0:
                opened = i
            depth += 1
        elif c == "]" and depth:
            depth -= 1
            if depth == 0:
                yield opened, i
        i += 1


def _int_subscripts(step: str) -> list[tuple[int, int]]:
    """``(open, close)`` of every integer subscript of a step (``[3]``, not ``['a']``)."""
    label = _FRAME_LABEL.match(step)
    return [
        (i, j)
        for i, j in _brackets(step, label.end() if label else 0)
        if _INT.fullmatch(step[i + 1 : j].strip())
    ]


def container_of(path: str) -> str:
    """The container a holder path names (see the module docstring)."""
    step = first_step(path)
    subs = _int_subscripts(step)
    if subs and subs[0][0] > 0:
        return step[: subs[0][0]]
    return step


def item_of(path: str) -> str:
    """The container's entry a holder path goes through: ``errors[2]`` of ``errors[2].x``."""
    step = first_step(path)
    subs = _int_subscripts(step)
    if subs and subs[0][0] > 0:
        return step[: subs[0][1] + 1]
    return step


def pattern_of(path: str) -> str:
    """The first step with every integer subscript as ``[*]``."""
    step = first_step(path)
    out, last = [], 0
    for i, j in _int_subscripts(step):
        out.append(step[last:i])
        out.append("[*]")
        last = j + 1
    out.append(step[last:])
    return "".join(out)


def _unrooted(path: str, root_kind: str | None) -> bool:
    if root_kind is not None:
        return root_kind in _UNROOTED_KINDS
    return bool(_UNROOTED.match(path))


# --------------------------------------------------------------------------- grouping


#: Roots that outlive any one call: a path from one of them names what keeps the memory,
#: where a running frame's local (often a library's ``args`` tuple) only passes it along.
_LASTING_ROOTS = ("global", "class", "ipython")


def _holder_paths(s: HeldStorage) -> list[tuple[str, bool, bool]]:
    """``(path, rooted, lasting)`` of each holder of a storage, most direct first."""
    found = s.holders
    if found is None:
        return []
    out: list[tuple[str, bool, bool]] = []
    for h in found:
        path = getattr(h, "path", h)
        if type(path) is not str:
            continue
        kind = getattr(h, "root_kind", None)
        out.append((path, not _unrooted(path, kind), kind in _LASTING_ROOTS))
    return out


def _candidates(s: HeldStorage) -> tuple[tuple[str, ...], str | None]:
    """The paths a storage may be attributed to, and an unrooted example when none is.

    Rooted holders only (a view's base ``<Tensor object>`` is not a holder of its own);
    lasting roots (module globals, classes, notebook history) before running frames;
    among those, direct ones (not only through an autograd graph) when there are any: a
    parameter that every loss's graph reaches stays the model's.
    """
    paths = _holder_paths(s)
    rooted = [(p, lasting) for p, ok, lasting in paths if ok]
    if not rooted:
        return (), (paths[0][0] if paths else None)
    # Direct holders first (a parameter that every loss's graph reaches stays the model's,
    # a leaf that a test's frame holds stays that frame's); among those, a module global (or
    # class, or notebook history) beats a running frame's local.
    direct = [(p, last) for p, last in rooted if not through_graph(p)]
    pool = direct or rooted
    lasting = tuple(p for p, last in pool if last)
    return (lasting or tuple(p for p, _ in pool)), None


def _in_container(path: str) -> bool:
    """Whether the path goes through an entry of a container: on a tie, the container that
    accumulates beats the loop variable that holds the latest item."""
    step = first_step(path)
    return step.endswith("]") or bool(_int_subscripts(step))


class _Acc:
    __slots__ = ("autograd", "example", "items", "nbytes", "patterns", "steps", "storages")

    def __init__(self, example: str) -> None:
        self.example = example
        self.items: set[str] = set()
        self.steps: set[str] = set()
        self.patterns: dict[str, int] = {}
        self.storages = 0
        self.nbytes = 0
        self.autograd = 0


def group_culprits(
    storages: Iterable[HeldStorage], *, patterns: Collection[str] | None = None
) -> list[Culprit]:
    """Group storages by container; each storage counts once; most bytes first.

    Among a storage's candidate holders, the container with the most entries holding the
    storages given wins (a loss history list rather than the loop's ``loss`` local that also holds
    the latest one). ``patterns``: only holders with those patterns count, and storages
    without one are left out (the totals of culprits already named).
    """
    items = list(storages)
    cands: list[tuple[tuple[str, ...], str | None]] = []
    for s in items:
        paths, unrooted = _candidates(s)
        if patterns is not None:
            paths = tuple(p for p in paths if pattern_of(p) in patterns)
            unrooted = None
        cands.append((paths, unrooted))
    # A container's vote is the number of its entries that hold these storages: the list
    # that accumulates (``outputs[0]``, ``[1]``, ...) beats a framework's ``args`` tuple or
    # ``callbacks`` list that reaches them all through one entry, and the loop's ``loss``.
    entries: dict[str, set[str]] = {}
    for paths, _ in cands:
        for p in paths:
            entries.setdefault(container_of(p), set()).add(item_of(p))
    votes = {g: len(e) for g, e in entries.items()}
    acc: dict[str, _Acc] = {}
    for s, (paths, unrooted) in zip(items, cands, strict=True):
        if paths:
            path = max(
                paths, key=lambda p: (votes.get(container_of(p), 0), _in_container(p), -len(p))
            )
            group = container_of(path)
        elif patterns is not None:
            continue
        else:
            path, group = unrooted or NO_HOLDER, NO_HOLDER
        a = acc.get(group)
        if a is None:
            a = acc[group] = _Acc(path)
        a.storages += 1
        a.nbytes += s.nbytes
        if group != NO_HOLDER:
            a.items.add(item_of(path))
            a.steps.add(first_step(path))
            pattern = pattern_of(path)
            a.patterns[pattern] = a.patterns.get(pattern, 0) + s.nbytes
            if through_graph(path):
                a.autograd += s.nbytes
    culprits = [
        Culprit(
            holder=g,
            tensors=len(a.steps) if g != NO_HOLDER else a.storages,
            storages=a.storages,
            nbytes=a.nbytes,
            autograd_bytes=a.autograd,
            example=a.example,
            items=len(a.items) if g != NO_HOLDER else a.storages,
            patterns=tuple(sorted(a.patterns, key=lambda p: (-a.patterns[p], p))),
        )
        for g, a in acc.items()
    ]
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits
