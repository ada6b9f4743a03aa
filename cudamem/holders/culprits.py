"""Which container is the culprit: the one rule for grouping holder paths.

Leak warnings, ``track(leaks=True)`` reports, OOM post-mortems, ``cudamem run`` and
``cudamem.find_graph_holders`` all turn holder paths into culprits with this module. It
reads each path's structure (``cudamem.holders.holder_path.HolderPath``), never its text.

A holder path reads from a root:
``__main__.loss_history[3] → grad_fn MeanBackward0 → SigmoidBackward0 saved result``. What
Python holds is the part before the first arrow (a graph edge, a frame). From it:

* the **container** is the part before the first integer subscript, wherever it is (a
  list or tuple index, or an integer dict key): ``__main__.loss_history[3]`` →
  ``__main__.loss_history``; ``__main__.errors[2].__traceback__.tb_next`` →
  ``__main__.errors``; ``model.step_outputs[7]['preds']`` → ``model.step_outputs``. A path
  without one is its own container: a variable, an attribute, or a dict entry under a
  named key (``activations['fc1']``: a dict's named keys say different things, a list's
  indices do not);
* the **pattern** is that part with every integer subscript written ``[*]``:
  ``__main__.errors[*].__traceback__.tb_next``, ``model.step_outputs[*]['preds']``;
* the **item** is the container's entry: up to its first integer subscript
  (``__main__.errors[2]``).

A ``Culprit`` is one container with the number of its items and tensors that keep
memory and their total bytes, so that a list of a thousand losses is one line, never a
thousand lines that a cap on culprits would cut. Holders that no root explains (an object
gc sees no referrer of, such as a view's base tensor, which only the view's C++ side
holds: ``<Tensor object>``; or a reference cycle) never make culprits of their own: a
storage is attributed to a rooted holder when it has one, else to
``(no holder reachable from Python)``.

The example a culprit shows leads to one of its storages: the largest one that is not a
parameter's ``.grad`` (whose path names the parameter), else the largest.

A culprit counts the storages it is given and no others: its bytes, items and example
come from them. The growth detector gives the survivors of one captured call and totals
their containers over everything alive with ``like=held_shapes(survivors)``: a storage
counts only through a path of a survivor's **shape** (``HolderPath.shape``: the whole path,
integer subscripts as ``[*]``). The earlier calls' losses and activations are held that way
(``errors[*].__traceback__.tb_next → step(): loss → grad_fn ... saved mat1``); the model
the same kept frames reach through the step's closure (``... step(): model[*].weight``)
is not, since no call made it, and ``leaks(since=span)`` of the loop names the same culprit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..base.present import Presented
from .holder_path import HolderPath

__all__ = [
    "NO_HOLDER",
    "Culprit",
    "HeldStorage",
    "Routed",
    "direct_first",
    "group_by_owner",
    "group_culprits",
    "held_shapes",
    "rank_holders",
]

H = TypeVar("H", bound="Listed")

#: The group of storages no rooted holder explains.
NO_HOLDER = "(no holder reachable from Python)"


class Routed(Protocol):
    """A holder as grouping reads it (``cudamem.holders.finder.Holder``): its path's structure,
    and how the path's last object holds the storage (``itself``, ``grad``, ``saved``, ...)."""

    @property
    def route(self) -> HolderPath: ...

    @property
    def via(self) -> str: ...

    @property
    def caller(self) -> bool: ...


class Listed(Routed, Protocol):
    """A holder as ranking reads it (``cudamem.holders.finder.Holder``)."""

    @property
    def root(self) -> str: ...


class HeldStorage(Protocol):
    """What grouping reads of a storage: its bytes and its holders.
    ``cudamem.holders.census.LiveStorage`` is one."""

    @property
    def nbytes(self) -> int: ...

    @property
    def holders(self) -> Iterable[Routed] | None: ...


@dataclass(frozen=True, slots=True)
class Culprit(Presented):
    """Storages grouped by the container that holds them (see ``cudamem.holders.culprits``)."""

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
    #: The device type of the storages (``cuda``, ``cpu``), or ``None`` when they are on
    #: several kinds of device or it is not known: what a fix may advise.
    device_type: str | None = None


# --------------------------------------------------------------------------- ranking

#: The order of root kinds in a listing of holders.
_ROOT_RANK = {"global": 0, "ipython": 0, "class": 1, "frame": 2, "traceback": 3, "partial": 5}


def rank_holders(holders: Iterable[H]) -> list[H]:
    """``who_holds``'s order: your own reference last; roots by kind (globals, classes,
    frames, tracebacks, the rest); ``__main__`` first; a tensor as a dict key after the
    paths to it; shortest first."""

    def key(h: H) -> tuple[int, int, int, int, int]:
        route = h.route
        main = 0 if h.root == "__main__" else 1
        rank = _ROOT_RANK.get(route.root_kind, 4)
        return (int(h.caller), rank, main, int(route.as_dict_key), len(route.text))

    return sorted(holders, key=key)


def direct_first(holders: Iterable[H]) -> list[H]:
    """Holders a name Python holds directly first (globals before frames), those through
    autograd graphs after them: which path a report shows first."""
    return sorted(holders, key=lambda h: (h.via == "saved", h.route.root_kind != "global"))


# --------------------------------------------------------------------------- grouping


def _candidates(s: HeldStorage) -> tuple[tuple[Routed, ...], Routed | None]:
    """The paths a storage may be attributed to, and an unrooted example when none is.

    Rooted holders only (a view's base ``<Tensor object>`` is not a holder of its own);
    lasting roots (module globals, classes, notebook history) before running frames;
    among those, direct ones (not only through an autograd graph) when there are any: a
    parameter that every loss's graph reaches stays the model's.
    """
    found = list(s.holders or ())
    rooted = [h for h in found if h.route.rooted]
    if not rooted:
        return (), (found[0] if found else None)
    # Direct holders first (a parameter that every loss's graph reaches stays the model's,
    # a leaf that a test's frame holds stays that frame's); among those, a module global (or
    # class, or notebook history) beats a running frame's local.
    direct = [h for h in rooted if not h.route.through_graph]
    pool = direct or rooted
    lasting = tuple(h for h in pool if h.route.lasting)
    return (lasting or tuple(pool)), None


class _Acc:
    __slots__ = (
        "autograd",
        "devices",
        "example",
        "items",
        "nbytes",
        "patterns",
        "steps",
        "storages",
        "top",
    )

    def __init__(self) -> None:
        self.example = NO_HOLDER
        self.top = (False, -1, 0)  # how good an example the current one is (``_example``)
        self.items: set[str] = set()
        self.steps: set[str] = set()
        self.patterns: dict[str, int] = {}
        self.storages = 0
        self.nbytes = 0
        self.autograd = 0
        #: The device types of the storages (``cuda``, ``cpu``).
        self.devices: set[str] = set()


def _choice(votes: dict[str, int]) -> Callable[[Routed], tuple[int, bool, int]]:
    """Which of a storage's paths names its culprit: the container with the most entries
    holding the storages given, then a path through an entry (the accumulating list
    rather than the loop variable holding the latest item), then the shorter."""

    def key(h: Routed) -> tuple[int, bool, int]:
        r = h.route
        return (votes.get(r.container, 0), r.in_container, -len(r.text))

    return key


def _example(via: str, nbytes: int, text: str) -> tuple[bool, int, int]:
    """How good an example of its culprit a storage's path is (higher is better): not a
    parameter's ``.grad`` (the path names the parameter, which the user did not keep),
    then the larger storage (a loss's saved activations before the scalar), then the
    shorter path."""
    return (via != "grad", nbytes, -len(text))


def _attributed(
    items: list[HeldStorage], like: Collection[str] | None
) -> list[tuple[Routed | None, Routed | None]]:
    """Each storage's chosen holder (``None`` when no rooted one holds it, or with ``like``
    none of those shapes), and an unrooted example for one without.

    Among a storage's candidate holders, the container with the most entries holding the
    storages given wins (a loss history list rather than the loop's ``loss`` local that also
    holds the latest one).
    """
    cands: list[tuple[tuple[Routed, ...], Routed | None]] = []
    for s in items:
        held, unrooted = _candidates(s)
        if like is not None:
            held = tuple(h for h in held if h.route.shape in like)
            unrooted = None
        cands.append((held, unrooted))
    # A container's vote is the number of its entries that hold these storages: the list
    # that accumulates (``outputs[0]``, ``[1]``, ...) beats a framework's ``args`` tuple or
    # ``callbacks`` list that reaches them all through one entry, and the loop's ``loss``.
    entries: dict[str, set[str]] = {}
    for held, _ in cands:
        for h in held:
            entries.setdefault(h.route.container, set()).add(h.route.item)
    best = _choice({g: len(e) for g, e in entries.items()})
    return [(max(held, key=best) if held else None, unrooted) for held, unrooted in cands]


def held_shapes(storages: Iterable[HeldStorage]) -> frozenset[str]:
    """The shapes (``HolderPath.shape``) of the paths ``storages`` are attributed by: what
    ``group_culprits(..., like=)`` totals a container over."""
    found = _attributed(list(storages), None)
    return frozenset(chosen.route.shape for chosen, _ in found if chosen is not None)


def group_culprits(
    storages: Iterable[HeldStorage], *, like: Collection[str] | None = None
) -> list[Culprit]:
    """Group storages by container; each storage counts once; most bytes first.

    A culprit's figures and example come from the storages given, never from others its
    container also reaches. ``like`` (``held_shapes`` of some storages, the survivors of a
    captured call): only holders whose whole path has one of those shapes count, and
    storages without one are left out. That totals a container over the storages it holds
    the way those were held (the loss every call appended, the activations in every kept
    traceback's frame), never what the same entries reach otherwise (the model those frames'
    closure holds, created before the loop).
    """
    items = list(storages)
    acc: dict[str, _Acc] = {}
    for s, (chosen, unrooted) in zip(items, _attributed(items, like), strict=True):
        route: HolderPath | None = None
        if chosen is not None:
            route, via = chosen.route, chosen.via
            group, text = route.container, route.text
        elif like is not None:
            continue
        else:
            group, via = NO_HOLDER, (unrooted.via if unrooted is not None else "itself")
            text = unrooted.route.text if unrooted is not None else NO_HOLDER
        a = acc.get(group)
        if a is None:
            a = acc[group] = _Acc()
        top = _example(via, s.nbytes, text)
        if top > a.top or (top == a.top and text < a.example):  # ties: the first by text
            a.top, a.example = top, text
        a.storages += 1
        a.nbytes += s.nbytes
        a.devices.add(_device_type(s))
        if route is not None:
            a.items.add(route.item)
            a.steps.add(route.first_step)
            pattern = route.item_pattern
            a.patterns[pattern] = a.patterns.get(pattern, 0) + s.nbytes
            if route.through_graph:
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
            device_type=_one(a.devices),
        )
        for g, a in acc.items()
    ]
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits


def _device_type(storage: HeldStorage) -> str:
    """``cuda`` for ``cuda:0``, ``cpu``; ``?`` when the storage does not say."""
    device = getattr(storage, "device", None)
    return device.split(":")[0] if isinstance(device, str) and device else "?"


def _one(devices: set[str]) -> str | None:
    """The one device type of a group, or ``None`` (several, or not known)."""
    return next(iter(devices)) if len(devices) == 1 and "?" not in devices else None


def group_by_owner(storages: Iterable[HeldStorage]) -> list[Culprit]:
    """Group storages by the variable their first holder (not the caller's own reference)
    starts from (``HolderPath.owner``): a model's hundreds of parameters are one line,
    ``__main__.model``, named by what keeps them all. Most bytes first."""
    groups: dict[str, list[int]] = {}  # owner -> [storages, bytes]
    examples: dict[str, str] = {}
    devices: dict[str, set[str]] = {}
    for s in storages:
        held = [h for h in (s.holders or ()) if not h.caller]
        name = held[0].route.owner if held else NO_HOLDER
        g = groups.setdefault(name, [0, 0])
        g[0] += 1
        g[1] += s.nbytes
        examples.setdefault(name, held[0].route.text if held else name)
        devices.setdefault(name, set()).add(_device_type(s))
    culprits = [
        Culprit(n, c, c, b, 0, examples[n], device_type=_one(devices[n]))
        for n, (c, b) in groups.items()
    ]
    culprits.sort(key=lambda c: c.nbytes, reverse=True)
    return culprits
